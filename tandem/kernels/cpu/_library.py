"""Builds, caches and loads the compiled CPU kernels.

The kernels are plain C++ with OpenMP (no torch headers, so a build takes seconds, not minutes),
compiled by the system compiler on first use into a cache directory and called through ctypes with raw
data pointers; ctypes releases the GIL for the duration of each call.

Environment:
    TANDEM_CACHE_DIR    cache root (default ~/.cache/tandem); the library lands in <root>/cpu-kernels/
    CXX                 compiler (default g++, then c++)
    TANDEM_CPU_KERNELS  "off" disables the compiled kernels (the torch reference runs instead)
    TANDEM_CPU_ISA      force one SIMD path: scalar | avx2 | avx512 | avx512bf16 (must be supported here)
    TANDEM_CPU_SANITIZE "1" builds the library with AddressSanitizer + UndefinedBehaviorSanitizer (a separate
                        cached build; python must run with the ASan runtime preloaded: docs/cpu-kernels.md)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

ISA_NAMES = ("scalar", "avx2", "avx512", "avx512bf16")  # index = the C++ `Isa` enum
# the C++ `Dtype` enum; int8 / float8_e4m3fn: K/V stores of 8-bit codes only (with scales), never q or digests
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}
# csrc/dispatch.cpp's tandem_abi_version: 2 added AttendArgs' scale fields, 3 CertifyArgs, 4 stores, 5 ranked rows,
# 6 ranked rows as a hand-off task
ABI_VERSION = 6
# Prefetch distance (rows), locality hint and line step: the best of a same-run sweep of the two-pass kernel on
# the 16-core Xeon GPU host, 192 rows ahead into L2 (docs/cpu-kernels.md, "Prefetch sweeps")
DEFAULT_PREFETCH = (192, 1, 64)

_SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
_CXX_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fno-math-errno")
# TANDEM_CPU_SANITIZE=1: every error aborts (no recovery), so a test run fails on the first finding
_SANITIZE_FLAGS = (
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-g",
)


def _flags() -> tuple[str, ...]:
    sanitize = os.environ.get("TANDEM_CPU_SANITIZE", "") == "1"
    return _CXX_FLAGS + _SANITIZE_FLAGS if sanitize else _CXX_FLAGS


class AttendArgs(ctypes.Structure):
    """Mirror of `tandem::AttendArgs` in csrc/tandem_cpu.h (same field order)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_scale", ctypes.c_float),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("k_stride_b", ctypes.c_int64),
        ("k_stride_h", ctypes.c_int64),
        ("k_stride_row", ctypes.c_int64),
        ("v_stride_b", ctypes.c_int64),
        ("v_stride_h", ctypes.c_int64),
        ("v_stride_row", ctypes.c_int64),
        ("indices", ctypes.c_void_p),
        ("lengths", ctypes.c_void_p),
        ("key_mask", ctypes.c_void_p),
        ("batch", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("nq", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("width", ctypes.c_int64),
        ("cap", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("prefetch_rows", ctypes.c_int64),
        ("prefetch_hint", ctypes.c_int64),
        ("prefetch_step", ctypes.c_int64),
        ("k_scale", ctypes.c_void_p),  # 8-bit stores: [B, Hkv, S] fp32, row r scaled by entry r // scale_rows
        ("v_scale", ctypes.c_void_p),
        ("ks_stride_b", ctypes.c_int64),
        ("ks_stride_h", ctypes.c_int64),
        ("vs_stride_b", ctypes.c_int64),
        ("vs_stride_h", ctypes.c_int64),
        ("scale_rows", ctypes.c_int64),
        ("stores", ctypes.c_void_p),  # [B] RowStore, one per request, or None: every request in k / v above
    ]


class RowStore(ctypes.Structure):
    """Mirror of `tandem::RowStore` in csrc/tandem_cpu.h: one request's host store in a call over requests that
    each keep their own (`AttendArgs.stores`)."""

    _fields_ = [
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("k_stride_h", ctypes.c_int64),
        ("k_stride_row", ctypes.c_int64),
        ("v_stride_h", ctypes.c_int64),
        ("v_stride_row", ctypes.c_int64),
        ("key_mask", ctypes.c_void_p),
        ("cap", ctypes.c_int64),
        ("k_scale", ctypes.c_void_p),
        ("v_scale", ctypes.c_void_p),
        ("ks_stride_h", ctypes.c_int64),
        ("vs_stride_h", ctypes.c_int64),
    ]


class ScoreArgs(ctypes.Structure):
    """Mirror of `tandem::ScoreArgs` in csrc/tandem_cpu.h (same field order)."""

    _fields_ = [
        ("q_pos", ctypes.c_void_p),  # the launcher passes q here; the driver splits it
        ("q_neg", ctypes.c_void_p),
        ("key_min", ctypes.c_void_p),
        ("key_max", ctypes.c_void_p),
        ("min_stride_b", ctypes.c_int64),
        ("min_stride_h", ctypes.c_int64),
        ("min_stride_blk", ctypes.c_int64),
        ("max_stride_b", ctypes.c_int64),
        ("max_stride_h", ctypes.c_int64),
        ("max_stride_blk", ctypes.c_int64),
        ("batch", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("nq", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("factor", ctypes.c_int64),
    ]


class CertifyArgs(ctypes.Structure):
    """Mirror of `tandem::CertifyArgs` in csrc/tandem_cpu.h (same field order): the certified row selection's
    inputs, row-indexed ones as pointers with element strides."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("codes", ctypes.c_void_p),
        ("codes_stride_b", ctypes.c_int64),
        ("codes_stride_h", ctypes.c_int64),
        ("codes_stride_row", ctypes.c_int64),
        ("row_scale", ctypes.c_void_p),
        ("row_scale_stride_b", ctypes.c_int64),
        ("row_scale_stride_h", ctypes.c_int64),
        ("error", ctypes.c_void_p),
        ("error_stride_b", ctypes.c_int64),
        ("error_stride_h", ctypes.c_int64),
        ("row_valid", ctypes.c_void_p),
        ("row_valid_stride_b", ctypes.c_int64),
        ("known_lse", ctypes.c_void_p),
        ("max_units", ctypes.c_void_p),
        ("max_units_stride_b", ctypes.c_int64),
        ("max_units_stride_h", ctypes.c_int64),
        ("value_norm", ctypes.c_void_p),
        ("value_norm_stride_b", ctypes.c_int64),
        ("value_norm_stride_h", ctypes.c_int64),
        ("forced", ctypes.c_void_p),
        ("forced_stride_b", ctypes.c_int64),
        ("forced_stride_h", ctypes.c_int64),
        ("batch", ctypes.c_int64),
        ("num_q_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("slack_abs", ctypes.c_float),
        ("slack_rel", ctypes.c_float),
        ("epsilon", ctypes.c_double),
        ("bucket_nats", ctypes.c_double),
        ("tail_margin", ctypes.c_double),
        ("buckets", ctypes.c_int64),
    ]


class HandoffTask(ctypes.Structure):
    """Mirror of `tandem::HandoffTask` in csrc/handoff.cpp (same field order): one hand-off's CPU part, served
    by `tandem_serve_handoffs`."""

    _fields_ = [
        ("kind", ctypes.c_int64),  # EMPTY_TASK, RANKED_TASK, QUEUE_TASK or RANKED_ROWS_TASK
        ("args", ctypes.c_void_p),
        ("isa", ctypes.c_int64),
        ("dtype", ctypes.c_int64),
        ("q_dtype", ctypes.c_int64),
        ("num_threads", ctypes.c_int64),
        ("ranked", ctypes.c_void_p),
        ("ranked_width", ctypes.c_int64),
        ("skip", ctypes.c_int64),
        ("count", ctypes.c_int64),
        ("indices", ctypes.c_void_p),
        ("lengths", ctypes.c_void_p),
        ("available", ctypes.c_void_p),
        ("stats", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("out_numel", ctypes.c_int64),
        ("lse_numel", ctypes.c_int64),
        ("result", ctypes.c_int64),
        ("nanoseconds", ctypes.c_int64),
        ("skips", ctypes.c_void_p),  # RANKED_ROWS_TASK: [B] int64 each
        ("counts", ctypes.c_void_p),
    ]


EMPTY_TASK, RANKED_TASK, QUEUE_TASK, RANKED_ROWS_TASK = 0, 1, 2, 3  # HandoffTask.kind
SERVED, TASK_FAILED, TIMED_OUT, ABORTED = 0, 1, 2, 3  # tandem_serve_handoffs' return values


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    signatures = {
        "tandem_abi_version": (ctypes.c_int, []),
        "tandem_isa_supported": (ctypes.c_int, [i32]),
        "tandem_sparse_attention": (i64, [i32, i32, p, p, p, i32]),
        "tandem_ranked_attention": (i64, [i32, i32, p, i32, p, i64, i64, i64, p, p, p, p, p, p, i32]),
        "tandem_ranked_rows_attention": (
            i64,
            [i32, i32, p, i32, p, i64, p, p, i64, p, p, p, p, i64, p, p, i32],
        ),
        "tandem_score_topk": (i64, [i32, i32, p, p, i64, p, p, i32]),
        "tandem_topk": (None, [p, i64, i64, i64, p, p, i32]),
        "tandem_threshold_select": (i64, [p, i64, i64, i64, i64, i64, i64, p, p, p, i32]),
        "tandem_read_sum": (ctypes.c_double, [i32, p, i64, i32]),
        "tandem_merge_lse": (None, [p, p, p, p, i64, i64]),
        "tandem_serve_handoffs": (i64, [p, i64, p, p, i64, p, ctypes.c_double, p]),
        "tandem_claim_probe": (i64, [p, p, i64, i32]),
        "tandem_queue_gpu_claim": (ctypes.c_int32, [p, i64, i64, p]),
        "tandem_certified_rows": (i64, [i32, p, p, p, p, p, p, i32]),
        "tandem_queue_attention": (
            i64,
            [i32, i32, p, i32, p, i64, i64, i64, p, p, p, p, p, i32, ctypes.c_double],
        ),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def _compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "g++", "c++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem"
    return Path(root) / "cpu-kernels"


def _sources() -> list[Path]:
    return sorted(p for p in _SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h"))


def _build_key(cxx: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for part in (version, " ".join(_flags()), platform.machine(), str(ABI_VERSION)):
        digest.update(part.encode())
    for src in _sources():
        digest.update(src.name.encode())
        digest.update(src.read_bytes())
    return digest.hexdigest()[:16]


def _compile(cxx: str, target: Path) -> None:
    """Compile each translation unit in parallel (the ISA files dominate), link, then rename into place.

    The rename is atomic, so processes building at the same time never load a half-written library.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        jobs = []
        for src in _sources():
            if src.suffix != ".cpp":
                continue
            obj = Path(tmp) / (src.stem + ".o")
            cmd = [cxx, *_flags(), "-c", str(src), "-o", str(obj)]
            jobs.append((cmd, obj, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)))
        for cmd, _, proc in jobs:
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
        partial = Path(tmp) / target.name
        sanitize = [f for f in _flags() if f.startswith("-fsanitize")]
        link = [cxx, "-shared", "-fopenmp", *sanitize, "-o", str(partial), *(str(obj) for _, obj, _ in jobs)]
        result = subprocess.run(link, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(link)} failed:\n{result.stderr[-2000:]}")
        os.replace(partial, target)


@functools.cache
def _load_native() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") once built and loaded, else (None, why not). Built at most once per process."""
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX or install g++)"
    try:
        target = _cache_dir() / f"tandem_cpu_{_build_key(cxx)}.so"
        if not target.exists():
            _compile(cxx, target)
        lib = ctypes.CDLL(str(target))
        _declare(lib)
        if lib.tandem_abi_version() != ABI_VERSION:
            return None, f"stale library {target} (ABI mismatch); delete it"
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        return None, f"building the CPU kernels failed: {err}"
    return lib, ""


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (see `unavailable_reason`)."""
    if os.environ.get("TANDEM_CPU_KERNELS", "").lower() in ("off", "0", "false", "no"):
        return None
    return _load_native()[0]


def unavailable_reason() -> str:
    if os.environ.get("TANDEM_CPU_KERNELS", "").lower() in ("off", "0", "false", "no"):
        return "disabled by TANDEM_CPU_KERNELS"
    return _load_native()[1]


@functools.cache
def supported_isas() -> tuple[str, ...]:
    lib = _load_native()[0]
    if lib is None:
        return ()
    return tuple(name for code, name in enumerate(ISA_NAMES) if lib.tandem_isa_supported(code))


def isa_code() -> int:
    """The SIMD path to run: TANDEM_CPU_ISA if set (and supported here), else the widest supported."""
    supported = supported_isas()
    forced = os.environ.get("TANDEM_CPU_ISA")
    if forced:
        if forced not in supported:
            raise ValueError(f"TANDEM_CPU_ISA={forced!r} is not supported on this CPU; allowed: {supported}")
        return ISA_NAMES.index(forced)
    return ISA_NAMES.index(supported[-1])


def prefetch_config() -> tuple[int, int, int]:
    """(rows prefetched ahead, locality hint 0..3 or -1 = none, bytes between prefetched lines).

    TANDEM_CPU_PREFETCH="rows,hint,step" overrides the default (a tuning knob for the benchmark).
    """
    env = os.environ.get("TANDEM_CPU_PREFETCH")
    if env:
        try:
            rows, hint, step = (int(x) for x in env.split(","))
        except ValueError as err:
            raise ValueError(
                f"TANDEM_CPU_PREFETCH={env!r}: expected 'rows,hint,step', e.g. '64,1,64'"
            ) from err
        return rows, hint, step
    return DEFAULT_PREFETCH


def default_num_threads() -> int:
    """OMP_NUM_THREADS if set, else all usable cores but one (left to launch GPU work)."""
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)
