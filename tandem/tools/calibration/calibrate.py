"""Calibration end to end: samples from a model (`collect`), Eq. 1 labels and static profiles (`search`), the
predictor (`predictor`), written as one profile file (`profile`).

Documents are split by index: the last `held_out` share is never trained on, and the predictor's metrics (and
the static profile's, for comparison) are measured there.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from ...policies.fluxion_predictor import evaluate, predictor_state, train_predictor
from ...policies.fluxion_profile import Profile, tau_key
from ...policies.fluxion_search import CALIBRATION_BLOCKS, budget_at, fit_budget_law
from .collect import REQUESTS, Samples, collect_document, document_prompt, haystack_document

DEFAULT_TAUS = (0.02, 0.05, 0.1, 0.2)


@dataclass
class CalibrationPlan:
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    documents: int = 16
    new_tokens: int = 32
    steps: int = 8
    taus: tuple[float, ...] = DEFAULT_TAUS
    sink_tokens: int = 64
    window_tokens: int = 256
    quantile: float = 0.9
    held_out: float = 0.25
    train: bool = True
    epochs: int = 60
    seed: int = 0
    max_positions: int | None = None  # the model's context: longer documents are cut to fit with their answer

    def __post_init__(self) -> None:
        if self.documents < 2:
            raise ValueError(f"--documents={self.documents}: allowed an integer >= 2 (some are held out)")
        if not self.lengths or min(self.lengths) <= self.sink_tokens + self.window_tokens + 16:
            raise ValueError(
                f"--lengths={','.join(map(str, self.lengths))}: each must exceed sinks + window + one block "
                f"({self.sink_tokens + self.window_tokens + 16} tokens), or nothing reaches the host tier"
            )
        if not self.taus or any(not 0.0 < t < 1.0 for t in self.taus):
            raise ValueError(f"--taus={self.taus}: allowed thresholds in (0, 1)")
        if not 1 <= self.steps <= self.new_tokens:
            raise ValueError(f"--steps={self.steps}: allowed 1 to --new-tokens ({self.new_tokens})")
        if not 0.5 <= self.quantile < 1.0:
            raise ValueError(f"--quantile={self.quantile}: allowed [0.5, 1)")
        if not 0.0 < self.held_out < 1.0:
            raise ValueError(f"--held-out={self.held_out}: allowed (0, 1)")
        if self.epochs < 1:
            raise ValueError(f"--epochs={self.epochs}: allowed an integer >= 1")


def collect(model, tokenizer, haystack, plan: CalibrationPlan, progress=None) -> Samples:
    """Run every calibration document; `progress(i, info)` after each."""
    rng = random.Random(plan.seed)
    words = haystack.text.split()
    parts = []
    for i in range(plan.documents):
        length = plan.lengths[i % len(plan.lengths)]
        if plan.max_positions is not None:  # room for the chat template, the request and the answer
            length = min(length, plan.max_positions - plan.new_tokens - 160)
        text = haystack_document(tokenizer, words, length, rng)
        prompt = document_prompt(tokenizer, text, REQUESTS[i % len(REQUESTS)])
        part = collect_document(
            model, tokenizer, prompt, i, plan.taus, plan.sink_tokens, plan.window_tokens, plan.new_tokens,
            plan.steps, rng,
        )  # fmt: skip
        parts.append(part)
        if progress is not None:
            progress(i, part.info[0])
    return Samples.concat(parts)


def static_profile(samples: Samples, mask: torch.Tensor, num_layers: int, num_q_heads: int, tau_index: int,
                   tau: float, quantile: float) -> dict:  # fmt: skip
    """Per head: Eq. 1 fitted to the `quantile` budget at each block size over the head's samples, and streaming
    where the head was streaming in at least `quantile` of them."""
    budgets = samples.budgets[mask][..., tau_index]  # [n, blocks]
    streaming = samples.streaming_error[mask] <= tau
    flat = samples.layer[mask] * num_q_heads + samples.head[mask]
    quant = torch.zeros(num_layers * num_q_heads, len(CALIBRATION_BLOCKS))
    stream_share = torch.zeros(num_layers * num_q_heads)
    for slot in range(num_layers * num_q_heads):
        pick = flat == slot
        if pick.any():
            quant[slot] = torch.quantile(budgets[pick], quantile, dim=0)
            stream_share[slot] = streaming[pick].float().mean()
    bgt0, k = fit_budget_law(quant, CALIBRATION_BLOCKS)
    shape = (num_layers, num_q_heads)
    return {
        "bgt0": bgt0.view(shape),
        "k": k.view(shape),
        "streaming": (stream_share >= quantile).view(shape),
        "streaming_share_measured": stream_share.view(shape),
        "quantile_budgets": quant.view(*shape, len(CALIBRATION_BLOCKS)),
    }


def static_metrics(static: dict, samples: Samples, mask: torch.Tensor, tau_index: int, tau: float) -> dict:
    """How often the static profile's budget meets tau on held-out samples, per selectable block size."""
    budgets = samples.budgets[mask][..., tau_index]
    layer, head = samples.layer[mask], samples.head[mask]
    bgt0, k = static["bgt0"][layer, head], static["k"][layer, head]
    stream = static["streaming"][layer, head]
    meets = {}
    for j, block in enumerate(CALIBRATION_BLOCKS[1:], start=1):
        given = torch.where(stream, torch.zeros_like(bgt0), budget_at(bgt0, k, block))
        meets[str(block)] = float((given >= budgets[:, j] - 1e-6).float().mean())
    return {"meets_tau": meets, "meets_tau_mean": sum(meets.values()) / len(meets)}


def build_profile(samples: Samples, plan: CalibrationPlan, meta: dict, progress=None) -> Profile:
    """Labels, the static profile and (with `plan.train`) a predictor per tau."""
    num_layers, num_q_heads = meta["layers"], meta["q_heads"]
    cut = plan.documents - max(1, round(plan.documents * plan.held_out))
    train_mask = samples.document < cut
    test_mask = ~train_mask
    static, predictors, metrics = {}, {}, {}
    for t, tau in enumerate(plan.taus):
        key = tau_key(tau)
        static[key] = static_profile(samples, train_mask, num_layers, num_q_heads, t, tau, plan.quantile)
        streaming = samples.streaming_error <= tau
        budgets = samples.budgets[..., t]
        bgt0, k = fit_budget_law(budgets, CALIBRATION_BLOCKS)
        metrics[key] = {"static": static_metrics(static[key], samples, test_mask, t, tau)}
        if plan.train:
            start = time.perf_counter()
            report = None if progress is None else (lambda e, loss, tau=tau: progress(tau, e, loss))
            model = train_predictor(
                samples.features[train_mask][:, t], budgets[train_mask], streaming[train_mask],
                plan.quantile, plan.epochs, plan.seed, progress=report,
            )  # fmt: skip
            predictors[key] = predictor_state(model)
            held = evaluate(
                model, samples.features[test_mask][:, t], budgets[test_mask], streaming[test_mask],
                bgt0[test_mask], k[test_mask], plan.quantile,
            )  # fmt: skip
            held["train_seconds"] = time.perf_counter() - start
            held["parameters"] = model.num_parameters()
            metrics[key]["predictor"] = held
    meta = dict(meta, taus=list(plan.taus), quantile=plan.quantile, train_documents=cut,
                held_out_documents=plan.documents - cut, samples=int(samples.document.numel()))  # fmt: skip
    return Profile(meta, static, predictors, metrics)
