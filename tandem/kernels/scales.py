"""The scales of a compressed host KV store (`TandemConfig.host.dtype`), checked once for every launcher.

A store of 8-bit codes (int8 / float8_e4m3fn) [B, Hkv, T, D] comes with float32 scales [B, Hkv, T // G] for K and
for V: row r decodes as codes * scale[..., r // G]. The CPU, GPU and reference launchers all take them as
`k_scale` / `v_scale` (the recall copy as `src_k_scale` / `src_v_scale`) and call `scale_rows` for the checks that
do not depend on where the tensors live; each then checks what its device needs.
"""

from __future__ import annotations

import torch

from .reference import QUANT_DTYPES

CODE_DTYPES = tuple(QUANT_DTYPES.values())  # the stores' element types: int8, float8_e4m3fn
LAYOUT = "[B, Hkv, T // G]"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def scale_rows(store: torch.Tensor, k_scale, v_scale, names: tuple[str, str] = ("k_scale", "v_scale")) -> int:
    """G, the rows per scale of `store`'s codes, after checking its scales; 0 for a float store, which takes none.

    Raises ValueError naming the argument: scales given for a float store or missing for an 8-bit one, not a
    float32 tensor of shape [B, Hkv, S] (v's equal to k's), S not dividing T, or the last dim not contiguous.
    """
    k_name, v_name = names
    dtype = _dtype_name(store.dtype)
    if store.dtype not in CODE_DTYPES:
        for name, t in ((k_name, k_scale), (v_name, v_scale)):
            if t is not None:
                raise ValueError(
                    f"{name} must be None for a {dtype} store (scales go with int8 / float8_e4m3fn codes), "
                    f"got a {type(t).__name__}"
                )
        return 0
    batch, num_kv_heads, num_rows = store.shape[:3]
    for name, t in ((k_name, k_scale), (v_name, v_scale)):
        if t is None:
            raise ValueError(f"{name} is required for a store of {dtype} codes: {LAYOUT} float32")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t, shape, layout in (
        (k_name, k_scale, (batch, num_kv_heads, None), LAYOUT),
        (v_name, v_scale, tuple(k_scale.shape), f"{LAYOUT} ({k_name}'s shape)"),
    ):
        if t.dim() != 3 or any(want is not None and got != want for got, want in zip(t.shape, shape)):
            expected = ", ".join("?" if want is None else str(want) for want in shape)
            raise ValueError(f"{name} must have shape {layout} = [{expected}], got {list(t.shape)}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name}.dtype must be float32, got {_dtype_name(t.dtype)}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    num_scales = k_scale.shape[2]
    if not ((num_scales > 0 and num_rows % num_scales == 0) or num_rows == num_scales == 0):
        raise ValueError(
            f"{k_name}.shape[2] must divide the store's T = {num_rows} rows (G = T // {k_name}.shape[2] rows "
            f"per scale), got {num_scales}"
        )
    return max(1, num_rows // max(num_scales, 1))
