"""CPU task planning: HGCA's adjacent-head merging (HGCA 3.3).

The CPU side has batch * num_kv_heads independent (request, KV head) units. One task per unit would
oversubscribe the cores at large batch; one task for everything leaves cores idle. Adjacent heads of the
same request are merged into at most `num_threads` tasks of near-equal size.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def plan_head_tasks(batch: int, num_kv_heads: int, num_threads: int) -> list[list[tuple[int, int, int]]]:
    """Split the batch * num_kv_heads units into <= num_threads tasks of adjacent units.

    Returns a list of tasks; each task is a list of pieces (request, first_head, end_head) that never cross
    a request boundary.
    """
    units = batch * num_kv_heads
    num_tasks = max(1, min(num_threads, units))
    base, extra = divmod(units, num_tasks)
    tasks, start = [], 0
    for t in range(num_tasks):
        end = start + base + (1 if t < extra else 0)
        pieces, u = [], start
        while u < end:
            b, h = divmod(u, num_kv_heads)
            h_end = min(num_kv_heads, h + (end - u))
            pieces.append((b, h, h_end))
            u += h_end - h
        tasks.append(pieces)
        start = end
    return tasks


class TaskPool:
    """A persistent pool running planned CPU attention tasks (torch ops release the GIL)."""

    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._pool = (
            ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="tandem-cpu")
            if num_threads > 1
            else None
        )

    def run(self, batch: int, num_kv_heads: int, piece_fn) -> None:
        """Call piece_fn(b, h0, h1) for every piece of the plan, tasks in parallel."""
        tasks = plan_head_tasks(batch, num_kv_heads, self.num_threads)
        if self._pool is None or len(tasks) == 1:
            for task in tasks:
                for piece in task:
                    piece_fn(*piece)
            return
        # autograd and inference modes are thread-local: give the workers the caller's
        modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        futures = [self._pool.submit(_run_task, task, piece_fn, modes) for task in tasks]
        for f in futures:
            f.result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _run_task(task, piece_fn, modes) -> None:
    inference, grad = modes
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        for piece in task:
            piece_fn(*piece)
