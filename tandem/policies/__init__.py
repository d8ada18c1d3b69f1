"""Selection policies: which offloaded entries each head attends on the CPU."""

from __future__ import annotations

from .base import ALL, NONE, Policy, Selection
from .fluxion import FluxionPolicy
from .hgca import HGCAPolicy
from .quest import QuestPolicy
from .simple import FullPolicy, StreamingPolicy

POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (FullPolicy, StreamingPolicy, HGCAPolicy, QuestPolicy, FluxionPolicy)
}
POLICY_CLASSES["certified"] = (
    QuestPolicy  # quest's selection with an epsilon (TandemConfig resolves its default)
)


def make_policy(config) -> Policy:
    """A fresh per-layer policy object for `config.policy`."""
    return POLICY_CLASSES[config.policy](config)


__all__ = ["ALL", "NONE", "Policy", "Selection", "POLICY_CLASSES", "make_policy"]
