"""Fluxion's head-property predictor (Fluxion §5.2): a small MLP with a shared backbone and three outputs per
head and step, `bgt0` and `k` of Eq. 1 and whether the head is streaming.

Training (`train_predictor`): the regression outputs are fitted so that Eq. 1's budgets at every block size
cover the measured Eq. 2 budgets (a quantile loss at `quantile`, over retrieval samples), because a budget
below the measured one misses tau while one above only costs reads; the streaming output by cross-entropy over
all samples. One predictor per threshold tau.

Held-out metrics (`evaluate`): streaming F1, R² of bgt0 / k / the budget at 16 against the per-sample Eq. 1
labels, and the share of head-steps whose predicted budget meets tau at each selectable block size (a streaming
prediction meets it only if the head was streaming).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .fluxion_features import NUM_FEATURES
from .fluxion_search import CALIBRATION_BLOCKS, SELECTION_BLOCKS, budget_at

HIDDEN = (256, 256, 128)  # 0.11M parameters, as Fluxion §5.2's 0.112M


class HeadPredictor(nn.Module):
    """features [N, 41] (raw) -> (bgt0 [N], k [N], streaming logit [N]); standardises with its own statistics."""

    def __init__(self, hidden: tuple[int, ...] = HIDDEN) -> None:
        super().__init__()
        layers, width = [], NUM_FEATURES
        for h in hidden:
            layers += [nn.Linear(width, h), nn.GELU()]
            width = h
        self.backbone = nn.Sequential(*layers)
        self.head = nn.Linear(width, 3)
        self.register_buffer("mean", torch.zeros(NUM_FEATURES))
        self.register_buffer("std", torch.ones(NUM_FEATURES))

    def forward(self, features: torch.Tensor):
        x = (features - self.mean) / self.std
        out = self.head(self.backbone(x))
        return out[..., 0], out[..., 1], out[..., 2]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _pinball(pred: torch.Tensor, target: torch.Tensor, quantile: float) -> torch.Tensor:
    diff = target - pred
    return torch.maximum(quantile * diff, (quantile - 1.0) * diff)


def train_predictor(
    features: torch.Tensor,
    budgets: torch.Tensor,
    streaming: torch.Tensor,
    quantile: float = 0.9,
    epochs: int = 60,
    seed: int = 0,
    batch_size: int = 512,
    progress=None,
) -> HeadPredictor:
    """Fit one predictor.

    features: [N, 41]; budgets: [N, len(CALIBRATION_BLOCKS)] measured Eq. 2 budgets; streaming: [N] bool.
    `progress`: optional callable(epoch, loss) called after each epoch.
    """
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = HeadPredictor()
    model.mean.copy_(features.mean(0))
    model.std.copy_(features.std(0).clamp_min(1e-6))
    log_blocks = torch.tensor([math.log2(b) for b in CALIBRATION_BLOCKS])
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs)
    retrieval = (~streaming).float()
    n = features.shape[0]
    for epoch in range(epochs):
        order = torch.randperm(n, generator=generator)
        total = 0.0
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            bgt0, k, logit = model(features[idx])
            predicted = bgt0[:, None] + k[:, None] * log_blocks  # Eq. 1 at every block size
            weight = retrieval[idx][:, None]
            regression = (
                _pinball(predicted, budgets[idx], quantile) * weight
            ).sum() / weight.sum().clamp_min(1)
            classification = nn.functional.binary_cross_entropy_with_logits(logit, streaming[idx].float())
            loss = 10.0 * regression + classification
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
        scheduler.step()
        if progress is not None:
            progress(epoch, total / n)
    return model.eval()


def streaming_logit_threshold(quantile: float) -> float:
    """A head is called streaming when the predicted probability is at least `quantile` (the calibration's
    covering quantile): skipping a retrieval head loses its whole host part, so the label must be as sure as the
    budgets are covering."""
    return math.log(quantile / (1.0 - quantile))


def _r2(pred: torch.Tensor, target: torch.Tensor) -> float:
    if target.numel() < 2:
        return float("nan")
    residual = ((pred - target) ** 2).sum()
    spread = ((target - target.mean()) ** 2).sum().clamp_min(1e-12)
    return float(1.0 - residual / spread)


@torch.no_grad()
def evaluate(
    model: HeadPredictor,
    features: torch.Tensor,
    budgets: torch.Tensor,
    streaming: torch.Tensor,
    bgt0,
    k,
    quantile: float = 0.9,
) -> dict:
    """Held-out accuracy, with streaming called as the policy calls it (`streaming_logit_threshold`).
    budgets [N, len(CALIBRATION_BLOCKS)]; bgt0 / k: the per-sample Eq. 1 labels."""
    p_bgt0, p_k, logit = model(features)
    p_stream = logit >= streaming_logit_threshold(quantile)
    tp = float((p_stream & streaming).sum())
    precision = tp / max(1.0, float(p_stream.sum()))
    recall = tp / max(1.0, float(streaming.sum()))
    f1 = 2 * precision * recall / max(1e-12, precision + recall)
    retrieval = ~streaming
    meets = {}
    for j, block in enumerate(CALIBRATION_BLOCKS):
        if block not in SELECTION_BLOCKS:
            continue
        given = torch.where(p_stream, torch.zeros_like(p_bgt0), budget_at(p_bgt0, p_k, block))
        meets[str(block)] = float((given >= budgets[:, j] - 1e-6).float().mean())
    j16 = CALIBRATION_BLOCKS.index(16)
    return {
        "samples": int(features.shape[0]),
        "streaming_share": float(streaming.float().mean()),
        "streaming_f1": f1,
        "streaming_precision": precision,
        "streaming_recall": recall,
        "bgt0_r2": _r2(p_bgt0[retrieval], bgt0[retrieval]),
        "k_r2": _r2(p_k[retrieval], k[retrieval]),
        "budget16_r2": _r2(budget_at(p_bgt0, p_k, 16)[retrieval], budgets[retrieval, j16]),
        "meets_tau": meets,
        "meets_tau_mean": sum(meets.values()) / max(1, len(meets)),
        "mean_predicted_budget16": float(
            torch.where(p_stream, torch.zeros_like(p_bgt0), budget_at(p_bgt0, p_k, 16)).mean()
        ),
        "mean_measured_budget16": float(budgets[:, j16].mean()),
    }


def predictor_state(model: HeadPredictor) -> dict:
    return {"hidden": list(HIDDEN), "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def predictor_from_state(state: dict) -> HeadPredictor:
    model = HeadPredictor(tuple(state["hidden"]))
    model.load_state_dict(state["weights"])
    return model.eval()
