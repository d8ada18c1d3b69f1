"""Host memory for the host tier: large stores on transparent huge pages, page-locked for the GPU on request.

Each decode step reads a few percent of every layer's host store, scattered in 4 KiB-sized pieces (one
16-token block of one KV head is 4 KiB in bf16 at head_dim 128), so with 4 KiB pages almost every block read
misses the TLB, and the page-table entries it then needs are cold too. On 2 MiB pages the CPU kernel's calls got
faster in isolation, the GPU's zero-copy reads kept their speed, the stores allocated and filled faster, and whole
decode steps gained within their noise: the numbers and their results folder are in docs/cpu-kernels.md § Huge
pages.

`host_zeros` maps large stores anonymously and asks for huge pages with `madvise(MADV_HUGEPAGE)` before the
first touch (Linux THP in "always" or "madvise" mode; elsewhere it is the plain allocation), then, when pinned,
page-locks them with `cudaHostRegister` (mapped, so the GPU reads them in place through UVA). The mapping stays
registered until the last tensor viewing it is freed.

Every store starts zeroed: the rows past the live ones must read as padding (valid False, finite K/V), whatever an
allocator hands back. torch's pinned-memory allocator recycles the blocks of freed tensors with their old bytes,
so an uninitialised `valid` store made a later cache in the same process attend another cache's leftovers as
live rows (a policy whose selection reaches a block past the live ones then read them). An anonymous mapping is
zero-filled by the kernel on first touch, so the large stores get this for free; the others (under a huge page,
or with `huge_pages` off) pay a memset.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20
_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


class _Mapping(mmap.mmap):
    """An anonymous mapping that undoes its CUDA registration before it is unmapped (a subclass's __del__
    runs before mmap's own deallocation, once no tensor views it)."""

    _cudart = None
    _address = 0

    def __del__(self) -> None:
        if self._cudart is not None:
            try:
                self._cudart.cudaHostUnregister(self._address)
            except Exception:  # interpreter shutdown: CUDA may be gone already, and the process with it
                pass


def huge_pages_supported() -> bool:
    """True where `host_zeros(huge=True)` can ask the OS for huge pages (Linux with THP not "never")."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def available_host_bytes() -> int | None:
    """The host's available memory (Linux `MemAvailable`: free plus reclaimable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_zeros(shape, dtype: torch.dtype, *, pin: bool, huge: bool = True) -> torch.Tensor:
    """A zeroed host tensor, on huge pages when `huge` and it spans at least one, page-locked for the GPU when
    `pin`. Raises MemoryError when the memory cannot be had (RuntimeError from CUDA's own allocator)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not huge or nbytes < HUGE_PAGE or not huge_pages_supported():
        return torch.zeros(shape, dtype=dtype, pin_memory=pin)
    try:
        mapping = _Mapping(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as err:
        raise MemoryError(f"mmap of {nbytes} bytes failed: {err}") from err
    # before any page is touched: the first touch picks the page size (and an anonymous page reads as zeros)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)
    if pin:
        cudart = torch.cuda.cudart()
        # faults every page in (huge where the kernel finds them) and locks it
        err = cudart.cudaHostRegister(tensor.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED)
        if int(err) != 0:
            raise MemoryError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
        mapping._cudart, mapping._address = cudart, tensor.data_ptr()
    return tensor


def empty_pinned_cache() -> None:
    """Give back the pinned host blocks torch's host allocator keeps after their tensors died (CUDA builds; the
    function's name differs across torch versions, and a build without it keeps them)."""
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        empty = getattr(torch._C, name, None)
        if empty is not None:
            empty()
            return
