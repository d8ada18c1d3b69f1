"""What a layer's decode attention asks of the runner of a fixed-address decode step.

A runner that decodes in fixed-address steps (`tandem.engine`, which records them as CUDA graphs) sets a
`StepContext` on the cache for the length of a decode (`TandemCache.step_context`). The layers hand it to the one
decode function (`rows.decode_attention`), which places the new token at the context's `slot` and passes each
layer's host work through the context's hooks. The attention code calls the hooks and reads the context's
fields, nothing else of the runner; a runner that records its steps runs the hooks' actions at replay instead
of at once (`defers_host_work`), a difference the attention code only sees as that one flag.
"""

from __future__ import annotations

import torch


class StepContext:
    """One decode step's fixed addresses and hand-off hooks, shared by the layers of one cache.

    slot:          [1] int64 on the model's device: the new token's hot-tier slot, reserved before the step
                   (every layer stores the same tokens with the same geometry)
    device_blocks: [1] int64 on the model's device: how many ranked host blocks per KV head the device attends
                   itself this step (a quest `gpu_share`), set before the step
    defers_host_work: True while the step's host work is collected to run later: a layer then marks its hand-offs
                   (`q_ready`, `host_work`, `after_replay`) instead of running its CPU part inline
    waits_for_copy: a deferred CPU part waits on q's copy event (False: the runner's own signal says q landed)

    The hooks below run their actions at once; a runner that defers host work overrides them.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.device_blocks = torch.zeros(1, dtype=torch.long, device=device)
        self.device_blocks_value = 0  # what `device_blocks` holds, known on the host (set by the runner)
        self.defers_host_work = False
        self.waits_for_copy = True
        self.host_seconds = 0.0  # time spent in the CPU parts of this step

    def add_host_seconds(self, seconds: float) -> None:
        self.host_seconds += seconds

    def q_ready(self, record_event) -> None:
        """A layer has queued its q (and selection) copies into host memory; `record_event` records the copy's
        event."""
        record_event()

    def host_work(self, action, wait: bool = True) -> None:
        """The layer's CPU part: `action()` fills its out / LSE host buffers, which the layer then merges.
        wait=False: the device does not wait for this one (a later hand-off's wait covers it: the host runs them
        in order)."""
        action()

    def after_replay(self, action) -> None:
        """Host bookkeeping of a layer with no CPU part (statistics), which no device work waits for."""
        action()
