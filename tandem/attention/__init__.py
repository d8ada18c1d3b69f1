"""Attention orchestration: hybrid GPU/CPU attention for one layer and CPU task planning."""

from .host import host_attention
from .hybrid import attend
from .tasks import TaskPool, plan_head_tasks

__all__ = ["TaskPool", "attend", "host_attention", "plan_head_tasks"]
