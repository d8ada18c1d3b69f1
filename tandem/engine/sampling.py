"""Token choice inside a decode step: greedy, temperature and nucleus (top-p) sampling, per request.

A draw needs no generator state and no host synchronisation, so a CUDA graph can hold it. It is Gumbel-max: the
argmax over the kept tokens of logits / T + G, with G = -log(-log(u)) standard Gumbel noise, is a draw from
softmax(logits / T) restricted to the kept set. u is a counter-based hash of (seed, step, token id) (SplitMix64's
output function), so a request draws the same tokens alone or in any batch, and a seed repeats its tokens.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def seed_key(seed: int) -> int:
    """A 64-bit seed, signed or unsigned (in [-2**63, 2**64)), as the int64 with its bits: the draws' key."""
    return _int64(seed % (1 << 64))


GOLDEN = _int64(0x9E3779B97F4A7C15)  # SplitMix64's increment
MIX_1 = _int64(0xBF58476D1CE4E5B9)
MIX_2 = _int64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 tensors (products wrap modulo 2^64, as in C)."""
    x = x ^ _shift_right(x, 30)
    x = x * MIX_1
    x = x ^ _shift_right(x, 27)
    x = x * MIX_2
    return x ^ _shift_right(x, 31)


def uniform(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float64 in (0, 1): the hash of (seed [B], step [B], token id), int64 inputs on one device."""
    key = _mix(seed * GOLDEN + step)
    ids = torch.arange(1, vocab + 1, dtype=torch.int64, device=seed.device)
    bits = _mix(key[:, None] + ids[None, :] * GOLDEN)
    return (_shift_right(bits, 11).double() + 0.5) * 2.0**-53


def sample(logits, temperature, top_p, seed, step, nucleus: bool = True) -> torch.Tensor:
    """[B] int64 tokens from logits [B, V]: the argmax where temperature is 0, else a draw from softmax(logits /
    temperature) over the smallest set of most likely tokens whose mass reaches top_p (the most likely is always
    kept). temperature / top_p: [B] float; seed / step: [B] int64, all on logits' device. nucleus=False skips the
    top-p cut (and its sort over the vocabulary): right when every top_p is 1."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    hot = temperature > 0
    scaled = logits / torch.where(hot, temperature, torch.ones_like(temperature))[:, None]
    score = scaled.double() - torch.log(-torch.log(uniform(seed, step, logits.shape[-1])))
    if nucleus:
        probs = torch.softmax(scaled, dim=-1)
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(dim=-1) - ordered  # the mass ranked above each token
        drop = torch.zeros_like(before, dtype=torch.bool).scatter_(-1, order, before >= top_p[:, None])
        score = score.masked_fill(drop, -math.inf)
    return torch.where(hot, score.argmax(dim=-1), greedy)


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens. temperature 0 (the default) is greedy; seed None draws a fresh one."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits: in [-2**63, 2**64), got {self.seed}")


class Sampler:
    """Token choice for a batch of requests over one stream of decode steps: each row's parameters as tensors on
    `device` and its next step index, at fixed addresses (a CUDA graph may record a call). Calling it with logits
    [B, V] returns the rows' tokens [B] and moves every row to its next step.

    params: one SamplingParams for every row, or one per row. first_step: each row's step index of its first draw
    (the number of tokens it already drew, e.g. after a preemption), an int or [B] ints."""

    def __init__(self, params, batch: int, device, first_step=0) -> None:
        rows = [params] * batch if isinstance(params, SamplingParams) else list(params)
        if len(rows) != batch or not all(isinstance(p, SamplingParams) for p in rows):
            raise ValueError(f"params must be one SamplingParams or {batch} of them (one per row)")
        seeds = [p.seed if p.seed is not None else secrets.randbits(63) for p in rows]
        self.params = rows
        self.greedy = all(p.temperature == 0 for p in rows)
        self.nucleus = any(p.top_p < 1 for p in rows)
        self.temperature = torch.tensor([float(p.temperature) for p in rows], device=device)
        self.top_p = torch.tensor([float(p.top_p) for p in rows], device=device)
        self.seed = torch.tensor([seed_key(s) for s in seeds], dtype=torch.int64, device=device)
        self.step = torch.zeros(batch, dtype=torch.int64, device=device)
        self.step.add_(torch.as_tensor(first_step, dtype=torch.int64).to(device))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.greedy:
            return logits.argmax(dim=-1)
        tokens = sample(logits, self.temperature, self.top_p, self.seed, self.step, self.nucleus)
        self.step.add_(1)
        return tokens
