"""Attention orchestration: hybrid GPU/CPU attention for one layer and CPU task planning."""

from .hybrid import attend, host_attention
from .tasks import TaskPool, plan_head_tasks

__all__ = ["TaskPool", "attend", "host_attention", "plan_head_tasks"]
