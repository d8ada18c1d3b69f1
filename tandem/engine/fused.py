"""The model's RMSNorm and rotary embedding replaced by Tandem's fused kernels, during Tandem's own passes.

A batch-1 decode step of a Llama-3.1-8B shape runs ~63 GPU kernels per layer, ~20 of them the seven small ops of
each RMSNorm and the ten of RoPE on q and k. `FusedLayers(model)` finds, once:

- modules whose class is an RMSNorm with a 1-D `weight` and a `variance_epsilon` (Llama, Qwen2, Mistral, ...);
- the `apply_rotary_pos_emb` function of each attention module's modeling file, which the attention's forward
  calls by name;

and keeps only those that the fused kernels reproduce on a random input (within the rounding of the fp32
reductions, `tolerance`): a model whose norm adds one to its weight, or whose rotation interleaves, keeps its
own code. `with fused:` swaps them in (instance `forward`s, the module-level function) and restores them on
exit, so Hugging Face's own passes over the same model (the baselines of `tandem bench`) stay untouched; entered
by several threads at once (a server's decode steps and its prefill thread), they stay swapped in until the last
one leaves. Calls that the kernels do not cover (other shapes, extra arguments) go to the original function. The
swap of the module-level function is process-wide while it lasts: another thread running a model of the same
architecture at that moment would get the fused RoPE too (it computes the same thing).
"""

from __future__ import annotations

import sys
import threading
import warnings

import torch

from ..kernels.gpu import layers

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}  # relative to the largest value


class FusedLayers:
    """The model's layers that the fused kernels replace, found and checked once; a context manager."""

    def __init__(self, model, device: torch.device) -> None:
        self.device = device
        self.norms: list = []
        self.rope_modules: list = []  # (modeling module, its apply_rotary_pos_emb)
        self.skipped: list[str] = []
        self._inside = 0  # passes inside `with self:` now, over every thread
        self._lock = threading.Lock()
        checked: dict[type, bool] = {}
        rope_seen = set()
        for module in model.modules():
            cls = type(module)
            if _looks_like_rms_norm(module):
                if cls not in checked:
                    checked[cls] = self._norm_matches(module)
                if checked[cls]:
                    self.norms.append(module)
            modeling = sys.modules.get(cls.__module__)
            original = getattr(modeling, "apply_rotary_pos_emb", None)
            if callable(original) and modeling.__name__ not in rope_seen and hasattr(module, "q_proj"):
                rope_seen.add(modeling.__name__)
                if self._rope_matches(original):
                    self.rope_modules.append((modeling, original))
        if self.skipped:
            warnings.warn(
                "tandem: kept the model's own " + ", ".join(self.skipped) + " (the fused kernels do not "
                "reproduce them)",
                stacklevel=2,
            )

    def _norm_matches(self, module) -> bool:
        weight = module.weight
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, weight.shape[0], generator=gen).to(weight.device, weight.dtype)
        with torch.no_grad():
            ok = _close(_fused_norm(module, x, None), type(module).forward(module, x))
        if not ok:
            self.skipped.append(type(module).__name__)
        return ok

    def _rope_matches(self, original) -> bool:
        gen = torch.Generator().manual_seed(0)
        dtype = torch.get_default_dtype() if self.device.type == "cpu" else torch.bfloat16

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(self.device, dtype)

        q, k, cos, sin = rand(2, 4, 3, 8), rand(2, 2, 3, 8), rand(2, 3, 8), rand(2, 3, 8)
        try:
            ours = layers.rotary(q, k, cos, sin)
            theirs = original(q, k, cos, sin)
            ok = all(_close(a, b) for a, b in zip(ours, theirs, strict=True))
        except Exception:  # a signature the kernels do not cover
            ok = False
        if not ok:
            self.skipped.append(f"{original.__module__}.apply_rotary_pos_emb")
        return ok

    def __enter__(self) -> FusedLayers:
        with self._lock:
            self._inside += 1
            if self._inside == 1:
                for module in self.norms:
                    module.forward = _bound_norm(module)
                for modeling, original in self.rope_modules:
                    modeling.apply_rotary_pos_emb = _rope_with_fallback(original)
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._inside -= 1
            if self._inside == 0:
                for module in self.norms:
                    module.__dict__.pop("forward", None)
                for modeling, original in self.rope_modules:
                    modeling.apply_rotary_pos_emb = original

    @property
    def active(self) -> bool:
        return bool(self.norms or self.rope_modules)


def _looks_like_rms_norm(module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        "RMSNorm" in type(module).__name__
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def _fused_norm(module, x, original):
    if x.shape[-1] != module.weight.shape[0] or x.device != module.weight.device or x.dtype not in TOLERANCE:
        return original(x)
    return layers.rms_norm(x, module.weight, module.variance_epsilon)


def _bound_norm(module):
    original = type(module).forward.__get__(module)
    return lambda hidden_states: _fused_norm(module, hidden_states, original)


def _rope_with_fallback(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        covered = (
            not args
            and kwargs.keys() <= {"unsqueeze_dim"}
            and kwargs.get("unsqueeze_dim", 1) == 1
            and q.dim() == 4
            and cos.dim() == 3
            and cos.shape == (q.shape[0], q.shape[2], q.shape[3])
            and sin.shape == cos.shape
            and k.dim() == 4
            and k.dtype == q.dtype
        )
        if not covered:
            return original(q, k, cos, sin, *args, **kwargs)
        return layers.rotary(q, k, cos, sin)

    apply_rotary_pos_emb.tandem_original = original
    return apply_rotary_pos_emb


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return False
    scale = theirs.float().abs().max().clamp(min=1e-6)
    return bool((ours.float() - theirs.float()).abs().max() <= TOLERANCE.get(theirs.dtype, 1e-2) * scale)
