"""CUDA host functions from Python: `cuLaunchHostFunc` through ctypes on the driver library.

Launched on a stream that is being captured, a host function becomes a host node of the CUDA graph: every
replay runs the Python callable when the graph reaches that point, on a CUDA driver thread. The callable
must not call CUDA (no events, no device tensors, no pinned allocations) and must not raise (wrap it).
"""

from __future__ import annotations

import ctypes

import torch

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_driver = None


def _library():
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise RuntimeError(
                f"CUDA host functions need the CUDA driver library libcuda.so.1: {err}"
            ) from err
        lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
        lib.cuLaunchHostFunc.restype = ctypes.c_int
        _driver = lib
    return _driver


def launch_host_func(stream: torch.cuda.Stream, fn):
    """Queue `fn()` on `stream`. Returns the ctypes callback, which must stay alive as long as a graph that
    captured it may replay."""
    callback = _HOST_FN(lambda _user_data: fn())
    status = _library().cuLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), callback, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {status}")
    return callback
