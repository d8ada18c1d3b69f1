"""`tandem eval`: measured quality of every selection policy against full attention on a real model."""

from .names import TASKS

_LAZY = {  # torch and transformers load only when used, so `tandem --help` stays fast
    "Haystack": "haystack",
    "load_haystack": "haystack",
    "EvalPlan": "runner",
    "Runner": "runner",
    "Variant": "runner",
    "evaluate": "runner",
    "make_plan": "runner",
    "Sample": "tasks",
    "TaskBuilder": "tasks",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tandem.evaluation' has no attribute {name!r}")


__all__ = ["TASKS", *_LAZY]
