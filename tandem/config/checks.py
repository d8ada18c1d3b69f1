"""Range checks shared by `TandemConfig` and its per-feature sub-configs: each refusal names the field by its
full path (`TandemConfig.quest.budget=2.0`) and says what is allowed."""

from __future__ import annotations

import math
import numbers


def fail(name: str, value, allowed: str) -> None:
    raise ValueError(f"TandemConfig.{name}={value!r} is out of range: allowed {allowed}")


def fail_type(name: str, value, allowed: str) -> None:
    raise ValueError(
        f"TandemConfig.{name}={value!r} has the wrong type ({type(value).__name__}): allowed {allowed}"
    )


def checked_int(name: str, value, low: int, high: int) -> int:
    """`value` as a Python int (a numpy integer too) if it is an integer in [low, high]; else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail_type(name, value, f"an integer in [{low}, {high}]")
    if not low <= value <= high:
        fail(name, value, f"an integer in [{low}, {high}]")
    return int(value)


def checked_float(name: str, value, low: float, high: float, text: str, low_open: bool) -> float:
    """`value` as a float if it is a finite number in (low, high] (`low_open`) or [low, high]; else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail_type(name, value, text)
    ok = math.isfinite(value) and value <= high and (value > low if low_open else value >= low)
    if not ok:
        fail(name, value, text)
    return float(value)


def checked_switch(name: str, value) -> bool:
    if value not in (True, False):  # 1 / 0 too: `--set host.huge_pages=0,1`
        fail(name, value, "True or False (1 or 0)")
    return bool(value)
