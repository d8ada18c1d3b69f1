"""The two reference policies: attend every offloaded entry, or none."""

from __future__ import annotations

from .base import ALL, NONE, Policy, Selection


class FullPolicy(Policy):
    """Every host entry is attended: hybrid attention equals dense attention (the correctness reference)."""

    name = "full"

    def select(self, layer, q, from_device=None, skip: int = 0) -> Selection:
        return ALL

    def every_row_step(self, layer, q) -> bool:
        return not q.is_cuda and layer.host is not None and layer.host.rows > 0


class StreamingPolicy(Policy):
    """No host entry is attended: sinks + recent window only (StreamingLLM)."""

    name = "streaming"
    attends_host = False

    def select(self, layer, q, from_device=None, skip: int = 0) -> Selection:
        return NONE
