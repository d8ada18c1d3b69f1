"""One tolerance table, keyed by dtype, for comparing kernels with their plain-torch references.

Keyed by the lowest-precision dtype the computation reads (e.g. the KV store's dtype); kernels that
accumulate in fp32 land far inside these bounds. `assert_close` also refuses NaN and requires the
non-finite entries (-inf lse of an empty selection, say) to match exactly.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str = "") -> None:
    """torch.testing.assert_close at the table's tolerance for `dtype`, NaN-free, infinities matching."""
    assert not torch.isnan(actual).any(), f"NaN in result {msg}"
    assert torch.equal(torch.isfinite(actual), torch.isfinite(expected)), f"non-finite entries differ {msg}"
    finite = torch.isfinite(expected)
    assert torch.equal(actual[~finite], expected[~finite]), f"infinite entries differ {msg}"
    torch.testing.assert_close(
        actual[finite], expected[finite].to(actual.dtype), msg=msg, **TOLERANCES[dtype]
    )
