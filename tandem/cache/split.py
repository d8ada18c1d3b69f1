"""Host attention split by requests across tensor-parallel ranks: PnG-KV's DP mapping (§3.2).

Under tensor parallelism each rank computes the KV and the queries of its heads for every request. By default
(`TandemConfig.distributed.host_split="heads"`) its host tier holds those heads and its CPU attends them: the host work is
split by heads, as the GPU work is. With `host_split="requests"` the host work is split by requests instead:
rank r's host tier holds every head of its own requests (a contiguous range of the batch), and its CPU attends
them. Two all-to-alls per layer and step join the two layouts, on the GPUs (NVLink with NCCL):

- before the CPU part, each rank sends every other rank its heads' queries (and the device's block ranking)
  for that rank's requests (`to_requests`);
- after it, each rank sends back the partial outputs and LSEs of the other ranks' heads (`to_heads`),
  which are merged by log-sum-exp with the hot tier's as on one GPU.

KV entering the host tier travels the same way (`to_requests`), so only queries, outputs and new KV rows move
between ranks, never the host tier itself. A rank's request range is `counts[r]` requests, as even as the batch
allows; a batch smaller than the ranks leaves some ranks' host tiers empty.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def request_counts(batch: int, world: int) -> list[int]:
    """Requests per rank: the batch in contiguous ranges, the first `batch % world` ranks one longer."""
    return [batch // world + (1 if r < batch % world else 0) for r in range(world)]


class RequestSplit:
    """One rank's place in the request split of a batch of `batch` requests over `rank.world` ranks. `rank`: a
    `distributed.tensor_parallel.Rank` (its rank, world and process group).

    counts:  requests per rank; `size` = counts[rank], `requests` = this rank's slice of the batch
    """

    def __init__(self, rank, batch: int) -> None:
        self.rank, self.world, self.group = rank.rank, rank.world, rank.group
        self.batch = batch
        self.counts = request_counts(batch, rank.world)
        start = sum(self.counts[: rank.rank])
        self.size = self.counts[rank.rank]
        self.requests = slice(start, start + self.size)
        # gloo (CPU ranks) aborts the process on an empty send buffer, which a rank without requests has when it
        # sends results back: there, while any rank has none, every piece travels with one more row
        self._pad = dist.get_backend(rank.group) == "gloo" and 0 in self.counts

    def to_requests(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, ...] (this rank's H heads of every request) -> [size, world * H, ...] (every rank's heads, in
        rank order, of this rank's requests)."""
        if x.shape[0] != self.batch:
            raise ValueError(f"to_requests: expected a batch of {self.batch}, got shape {tuple(x.shape)}")
        heads, rest = x.shape[1], x.shape[2:]
        received = x.new_empty((self.world * self.size, heads, *rest))
        _all_to_all(received, x.contiguous(), [self.size] * self.world, self.counts, self.group, self._pad)
        # received: the senders' [size, H, ...] pieces in rank order
        received = received.view(self.world, self.size, heads, *rest).movedim(0, 1)
        return received.reshape(self.size, self.world * heads, *rest)

    def to_heads(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_requests`: [size, world * H, ...] -> [B, H, ...]."""
        if y.shape[0] != self.size or y.shape[1] % self.world:
            raise ValueError(
                f"to_heads: expected [{self.size}, a multiple of {self.world}, ...], got shape {tuple(y.shape)}"
            )
        heads, rest = y.shape[1] // self.world, y.shape[2:]
        send = y.reshape(self.size, self.world, heads, *rest).movedim(1, 0).contiguous()
        received = y.new_empty((self.batch, heads, *rest))
        send = send.view(self.world * self.size, heads, *rest)
        _all_to_all(received, send, self.counts, [self.size] * self.world, self.group, self._pad)
        return received

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's requests of a per-request tensor every rank holds whole ([B, ...])."""
        return x[self.requests]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's [size, ...] per-request tensor joined into [B, ...] (an all-gather of the ranges)."""
        spread = x.unsqueeze(1).expand(self.size, self.world, *x.shape[1:])
        as_int = x.dtype == torch.bool  # collectives move bytes; bool travels as uint8
        joined = self.to_heads(spread.to(torch.uint8) if as_int else spread)[:, 0]
        return joined.bool() if as_int else joined


def _all_to_all(received, send, output_splits, input_splits, group, pad: bool) -> None:
    """all_to_all_single of dim-0 pieces; with `pad` (every rank alike) each piece travels with one more row,
    dropped on arrival, so that no rank's buffer is empty."""
    if not pad:
        dist.all_to_all_single(
            received, send, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group
        )
        return
    padded = [
        torch.cat([piece, piece.new_zeros((1, *piece.shape[1:]))]) for piece in send.split(input_splits)
    ]
    landed = received.new_empty((received.shape[0] + len(output_splits), *received.shape[1:]))
    dist.all_to_all_single(
        landed,
        torch.cat(padded),
        output_split_sizes=[n + 1 for n in output_splits],
        input_split_sizes=[n + 1 for n in input_splits],
        group=group,
    )
    pieces = landed.split([n + 1 for n in output_splits])
    received.copy_(torch.cat([piece[:-1] for piece in pieces]))
