"""The memory bandwidths a decode step is bound by and the matmul rate a prefill is bound by, measured in the same
run as the benchmark, and the machine they were measured on.

* `hbm_bandwidth`: GPU memory read (a decode step reads every weight once);
* `host_read_bandwidth`: host memory read by the CPU kernels' threads (the CPU tier's attention reads);
* `pcie_h2d_bandwidth`: pinned host memory to the GPU (what an offloading cache pays per byte);
* `matmul_rate`: a large square matmul on the GPU (what a prefill's FLOPs run at, at best).

The bandwidths return GB/s (1e9 bytes per second), best of several timed runs after a warm-up; the matmul rate
TFLOP/s, the median of its runs.

>>> from tandem.bench import bandwidth
>>> bandwidth.host_read_bandwidth(threads=4, nbytes=256 << 20)  # e.g. 40.2
"""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
import time
from pathlib import Path

import torch

from tandem.kernels import cpu

GIB = 1 << 30


def _cuda_device(device) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise ValueError("device: CUDA is not available on this machine")
    return device


def event_seconds(fn, reps: int, device: torch.device, warmups: int = 1) -> list[float]:
    """Seconds of each of `reps` calls of `fn()` after `warmups` untimed ones, timed with CUDA events on the
    current stream of `device`."""
    with torch.cuda.device(device):
        for _ in range(warmups):
            fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return times


def matmul_rate(
    device="cuda", dtype: torch.dtype = torch.bfloat16, size: int = 8192, reps: int = 20
) -> float:
    """TFLOP/s of a square `dtype` matmul of `size` on `device`, the median of `reps` runs after two untimed ones:
    the hardware limit a prefill's FLOPs are held against."""
    device = _cuda_device(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    times = sorted(event_seconds(lambda: a @ b, reps, device, warmups=2))
    return 2 * size**3 / times[len(times) // 2] / 1e12


def _best_event_seconds(fn, reps: int, device: torch.device) -> float:
    """Fastest of `reps` calls of `fn()` after one warm-up (`event_seconds`)."""
    return min(event_seconds(fn, reps, device))


def hbm_bandwidth(device="cuda", nbytes: int = 2 * GIB, reps: int = 10, mode: str = "read") -> float:
    """GB/s of GPU memory, best of `reps` after a warm-up.

    mode "read" (default) sums a bf16 buffer of `nbytes` into one fp32 value: bytes counted = `nbytes`, the
    bytes read, as a decode step reads its weights. mode "copy" copies the buffer into a second one: bytes
    counted = 2 * `nbytes` (each byte is read once and written once).
    """
    device = _cuda_device(device)
    if mode not in ("read", "copy"):
        raise ValueError(f"mode: expected 'read' or 'copy', got {mode!r}")
    numel = nbytes // 2
    src = torch.ones(numel, dtype=torch.bfloat16, device=device)
    if mode == "read":
        seconds = _best_event_seconds(lambda: src.sum(dtype=torch.float32), reps, device)
        moved = numel * 2
    else:
        dst = torch.empty_like(src)
        seconds = _best_event_seconds(lambda: dst.copy_(src), reps, device)
        moved = 2 * numel * 2
    return moved / seconds / 1e9


def host_read_bandwidth(threads: int | None = None, nbytes: int = 2 * GIB, reps: int = 5) -> float:
    """GB/s of a STREAM-like read: the CPU kernels' `read_sum` over an fp32 buffer of `nbytes` (touched
    first, so no page faults are timed) with `threads` threads; best of `reps` after a warm-up.

    Without the compiled kernels, `read_sum` falls back to `torch.sum` (torch's thread count).
    """
    data = torch.ones(max(1, nbytes // 4))
    cpu.read_sum(data, num_threads=threads)
    return read_bandwidth(data, threads, reps)


def read_bandwidth(data: torch.Tensor, threads: int | None = None, reps: int = 5) -> float:
    """GB/s of reading the fp32 tensor `data` with `read_sum` (already touched), best of `reps`."""
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        cpu.read_sum(data, num_threads=threads)
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def pcie_h2d_bandwidth(device="cuda", nbytes: int = GIB, reps: int = 5) -> float:
    """GB/s of copying `nbytes` from pinned host memory to the GPU, best of `reps` after a warm-up."""
    device = _cuda_device(device)
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds = _best_event_seconds(lambda: dst.copy_(src, non_blocking=True), reps, device)
    return nbytes / seconds / 1e9


def parse_cache_size(text: str) -> int | None:
    """Bytes of a sysfs cache size ("32768K", "300M", "1024"); None if it is not one."""
    text = text.strip()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(text[-1:].upper())
    digits = text[:-1] if scale else text
    return int(digits) * (scale or 1) if digits.isdigit() else None


def last_level_cache_bytes(default: int = 256 << 20) -> int:
    """Size of the CPU's largest cache (Linux sysfs); `default` where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            sizes.append(parse_cache_size((index / "size").read_text()))
        except OSError:
            continue
    return max((s for s in sizes if s), default=default)


def machine_info(threads: int) -> dict:
    """Host CPU, memory, kernel settings and software versions; the GPU (name, memory, CUDA) when present."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        cxx = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        cxx = "unknown"
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    info = {
        "hostname": socket.gethostname(),
        "cpu_model": model,
        "cores": cores,
        "memory_gb": round(mem_gb, 1),
        "llc_mb": round(last_level_cache_bytes() / 2**20),
        "threads": threads,
        "isa": cpu.isa(),
        "prefetch": list(cpu.prefetch_config()),
        "torch": torch.__version__,
        "compiler": cxx,
        "gpu": None,
        "gpu_memory_gb": None,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = props.name
        info["gpu_memory_gb"] = round(props.total_memory / 1e9, 1)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def machine_slug(info: dict) -> str:
    """A file-name-safe name of the CPU, e.g. 'intel-xeon-platinum-8480-16c'."""
    model = re.sub(r"\(R\)|\(TM\)|CPU|Processor|@.*$|\d+-Core", "", info["cpu_model"])
    model = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"{model}-{info['cores']}c"
