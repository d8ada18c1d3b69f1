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

**Reuse** (`HostPool`, on while `enable_host_pool` holds; `tandem serve` turns it on). Making a large store costs
the OS's page faults and, pinned, CUDA's registration: on an H200's host 22 ms for each 268 MB store, 2.8 s of a
128K prompt's 22.3 s prefill at the 8B shape, paid again by every request a server starts (and by a request that
copies a kept prefix, most of its time to first token). With a pool, a store whose last view dies keeps its
mapping, faulted in and registered, for the next store of about its size, which only zeroes it (the stores must
start zeroed, above). A store that finds none first gives back free mappings at least its size, so the pool holds
about what the stores it lent held at their peak; `HostPool.trim` gives back the rest (an idle server does).

**Ahead of time** (`HostPool.reserve`). Where many requests arrive at once, none finds an ended one's store, and
each would map and page-lock its own on the thread that runs the model, stalling every running stream. A caller
that knows a request's store sizes in advance (`tandem serve`, at admission) reserves them: the pool's worker
thread makes them (from free mappings, zeroed, or mapped, faulted in by a memset and registered anew; CUDA's
registration gives up the GIL, but one that faults the pages in itself kept the model's thread waiting for as long
as it ran) while the model runs, and the request's stores draw from its reservation (`Reservation.drawn`, around
the code that makes them) without zeroing again. What the request leaves undrawn goes to the free mappings.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import threading
import weakref
from collections import deque

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
    `pin`; from the host pool's free mappings where it is on and holds one of about this size. Raises MemoryError
    when the memory cannot be had (RuntimeError from CUDA's own allocator)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not huge or nbytes < HUGE_PAGE or not huge_pages_supported():
        return torch.zeros(shape, dtype=dtype, pin_memory=pin)
    pool = _pool
    mapping = reused = None
    if pool is not None:
        mapping = pool.draw(nbytes, pin)  # made ahead for this request, zeroed
        if mapping is None:
            mapping = reused = pool.take(nbytes, pin)
    if mapping is None:
        mapping = _new_mapping(nbytes, pin)
    view = memoryview(mapping)[:nbytes]
    tensor = torch.frombuffer(view, dtype=torch.uint8).view(dtype).view(shape)
    if pool is not None:
        pool.lend(view, mapping)
    if reused is not None:
        tensor.zero_()
    return tensor


def _new_mapping(nbytes: int, pin: bool, fault_in: bool = False) -> _Mapping:
    """A new anonymous mapping of `nbytes` (zeros), page-locked when `pin`. `fault_in`: its pages are faulted in
    by a memset first (the host pool's worker; see `Reservation.fill`)."""
    try:
        mapping = _Mapping(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as err:
        raise MemoryError(f"mmap of {nbytes} bytes failed: {err}") from err
    # before any page is touched: the first touch picks the page size (and an anonymous page reads as zeros)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    if fault_in:
        _zero(mapping, nbytes)
    if pin:
        cudart = torch.cuda.cudart()
        address = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
        # faults in every page not in memory yet (huge where the kernel finds them) and locks it
        err = cudart.cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED)
        if int(err) != 0:
            raise MemoryError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
        mapping._cudart, mapping._address = cudart, address
    return mapping


class HostPool:
    """Large host stores' mappings kept, faulted in and registered, for the next stores (module docstring, Reuse).

    A mapping lent to a store comes back when the store's last view dies (a finalizer on the buffer the tensor
    holds). `take` lends the smallest free mapping of the same kind (pinned or not) that holds the store and is at
    most `fit` times its size."""

    def __init__(self, fit: float = 1.25) -> None:
        self.fit = fit
        # reentrant: a store may die (its finalizer returning a mapping) in a collection inside a locked section
        self._lock = threading.RLock()
        self._free: list[_Mapping] = []
        # stores served from the pool, stores mapped anew while it is on, mappings given back to the OS, stores
        # drawn from reservations (made ahead by the worker, which counts them as reused or made)
        self.reused = self.made = self.given_back = self.ahead = 0
        # reservations waiting for the worker thread (`reserve`), started with the first
        self._pending: deque[Reservation] = deque()
        self._wake = threading.Condition(self._lock)
        self._worker: threading.Thread | None = None
        self._closed = False
        # the reservation this thread's stores draw from (`Reservation.drawn`)
        self._drawing = threading.local()

    def reserve(self, sizes, pinned: bool) -> Reservation:
        """Make stores of `sizes` bytes (those of at least a huge page: the smaller never come from the pool) of
        one kind ahead of their request, on the pool's worker thread, in the order asked. Returns at once."""
        reservation = Reservation(self, [n for n in sizes if n >= HUGE_PAGE], pinned)
        with self._lock:
            if not reservation.sizes or self._closed:
                reservation.done.set()
                return reservation
            self._pending.append(reservation)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="tandem-host-stores", daemon=True)
                self._worker.start()
            self._wake.notify()
        return reservation

    def draw(self, nbytes: int, pinned: bool) -> _Mapping | None:
        """A mapping made ahead for a store of `nbytes`, zeroed, from the reservation this thread draws from
        (the smallest within the fit), or None."""
        reservation = getattr(self._drawing, "reservation", None)
        if reservation is None or reservation.pinned != pinned:
            return None
        with self._lock:
            best = self._best_fit(reservation.mappings, nbytes)
            if best is not None:
                self.ahead += 1
            return best

    def _best_fit(self, mappings: list[_Mapping], nbytes: int, pinned: bool | None = None) -> _Mapping | None:
        """The smallest of `mappings` (of that kind, unless `pinned` is None) holding `nbytes` within the fit,
        taken out of the list; or None. Called under the lock."""
        fits = [
            m for m in mappings
            if (pinned is None or _pinned(m) == pinned) and nbytes <= len(m) <= nbytes * self.fit
        ]  # fmt: skip
        if not fits:
            return None
        best = min(fits, key=len)
        mappings.remove(best)
        return best

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                reservation = self._pending.popleft()
            reservation.fill()

    def take(self, nbytes: int, pinned: bool) -> _Mapping | None:
        """A free mapping for a store of `nbytes`, or None: then free mappings of at least `nbytes` in all, the
        largest first, go back to the OS before the caller maps a new one."""
        with self._lock:
            best = self._best_fit(self._free, nbytes, pinned)
            if best is not None:
                self.reused += 1
                return best
            self.made += 1
            dropped, freed = [], 0
            for mapping in sorted(self._free, key=len, reverse=True):
                if freed >= nbytes:
                    break
                dropped.append(mapping)
                freed += len(mapping)
            for mapping in dropped:
                self._free.remove(mapping)
            self.given_back += len(dropped)
        del dropped  # unregistered and unmapped here, outside the lock (`_Mapping.__del__`)
        return None

    def lend(self, view: memoryview, mapping: _Mapping) -> None:
        """`mapping` is lent to the store whose tensor holds `view`: it comes back when `view` dies."""
        weakref.finalize(view, self._came_back, mapping).atexit = False

    def _came_back(self, mapping: _Mapping) -> None:
        with self._lock:
            if _pool is self:
                self._free.append(mapping)
                return
            self.given_back += 1  # the pool is off: the mapping goes with the finalizer's reference

    def close(self) -> None:
        """Stop the worker after the store it makes now; reservations not begun end empty."""
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending), deque()
            self._wake.notify()
        for reservation in pending:
            reservation.done.set()

    def trim(self) -> None:
        """Give every free mapping back to the OS."""
        with self._lock:
            dropped, self._free = self._free, []
            self.given_back += len(dropped)
        del dropped

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(len(m) for m in self._free)

    def stats(self) -> dict:
        """Stores served from the pool and mapped anew while it was on, those of them made ahead of their request
        (`reserve`), and the free bytes it holds now."""
        return {"reused": self.reused, "made": self.made, "ahead": self.ahead, "free_bytes": self.free_bytes}


class Reservation:
    """Host stores made ahead of one request by a pool's worker thread (`HostPool.reserve`).

    sizes:    the stores' bytes, made in this order
    mappings: those made and not yet drawn (zeroed: freshly mapped, or a free one zeroed by the worker)
    done:     set once the worker is through (or the pool closed before it began); `error` holds what stopped it
              (the request's own stores then map anew, and raise where memory is short)
    """

    def __init__(self, pool: HostPool, sizes: list[int], pinned: bool) -> None:
        self.pool, self.sizes, self.pinned = pool, sizes, pinned
        self.mappings: list[_Mapping] = []
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._released = False

    def fill(self) -> None:
        """Make the stores (the worker thread)."""
        pool = self.pool
        try:
            for nbytes in self.sizes:
                if self._released or _pool is not pool:
                    break
                mapping = pool.take(nbytes, self.pinned)
                if mapping is None:
                    # faulted in before CUDA registers it: registration faulting the pages in itself held the
                    # model's thread for as long as it ran (at the 8B shape on an H200, 8 requests' 44 GB made
                    # this way stalled one prefill chunk 22 s; faulted in first, the chunks went on at 1.6x their
                    # time: docs/serve.md § Host pool)
                    mapping = _new_mapping(nbytes, self.pinned, fault_in=True)
                else:
                    _zero(mapping, nbytes)
                with pool._lock:
                    if self._released:
                        pool._came_back(mapping)
                    else:
                        self.mappings.append(mapping)
        except Exception as err:  # the worker goes on with the next reservation
            self.error = err
        finally:
            self.done.set()

    @contextlib.contextmanager
    def drawn(self):
        """While inside, the stores this thread makes draw from this reservation, once the worker is through with
        it (waited for here); on leaving, what is left goes to the pool's free mappings."""
        self.done.wait()
        local = self.pool._drawing
        local.reservation = self
        try:
            yield self
        finally:
            local.reservation = None
            self.release()

    def release(self) -> None:
        """Give what is left undrawn to the pool's free mappings (also what the worker makes from now on)."""
        pool = self.pool
        with pool._lock:
            self._released = True
            left, self.mappings = self.mappings, []
            for mapping in left:
                pool._came_back(mapping)


def _zero(mapping: _Mapping, nbytes: int) -> None:
    """Zero the first `nbytes` of `mapping` (faulting its pages in) on one thread, which ctypes lets give up the
    GIL: torch's zero_ would take every core, which the decode steps' CPU parts use meanwhile."""
    ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(mapping)), 0, nbytes)


def _pinned(mapping: _Mapping) -> bool:
    return mapping._cudart is not None


_pool: HostPool | None = None


def enable_host_pool() -> HostPool:
    """Turn the host pool on for this process (a no-op where it is on) and return it."""
    global _pool
    if _pool is None:
        _pool = HostPool()
    return _pool


def disable_host_pool() -> None:
    """Turn the host pool off: its free mappings go back to the OS now, the lent ones when their stores die."""
    global _pool
    pool, _pool = _pool, None
    if pool is not None:
        pool.close()
        pool.trim()


def host_pool() -> HostPool | None:
    """The process's host pool, or None where it is off."""
    return _pool


def empty_pinned_cache() -> None:
    """Give back the pinned host blocks torch's host allocator keeps after their tensors died (CUDA builds; the
    function's name differs across torch versions, and a build without it keeps them)."""
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        empty = getattr(torch._C, name, None)
        if empty is not None:
            empty()
            return
