"""A layer cache that refuses further use once a step failed half way through storing its tokens."""

from __future__ import annotations


class Failable:
    """`failed`: "Type: message" of the error that interrupted a step (the layer's state is inconsistent), or None.
    The text only: the error's traceback would keep the failed step's activations alive as long as the cache."""

    failed: str | None = None

    def mark_failed(self, err: BaseException) -> None:
        """Refuse further use, naming `err` (the first failure is kept)."""
        if self.failed is None:
            self.failed = f"{type(err).__name__}: {err}"

    def check_usable(self) -> None:
        """Refuse to go on after a step that failed half way (out of memory, an interrupt, ...)."""
        if self.failed is not None:
            raise RuntimeError(
                f"this TandemCache is unusable: a step failed while storing tokens ({self.failed}); build a new "
                "cache (TandemCache.for_model) to start again"
            )
