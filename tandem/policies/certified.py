"""The certified selection of one layer (`TandemConfig.certified.epsilon`), shared by quest and fluxion.

`Certifier.select` runs inside the decode step, on the compute device: it bounds every host block's mass
(`certified_mass`) and keeps, per query head, the fewest blocks that certify p <= epsilon (`certify`). A policy
may pass the blocks its own rule chose (`forced`): those are attended in any case, so they are ranked first and
their lower mass bounds count toward the attended mass; the certified blocks are added where they do not suffice.
`after_attention` computes the step's certificate with the exact attended mass and adds it to device counters
(`CERT_COUNTERS`). Both are plain torch with no host reads, so a recorded CUDA graph replays them.

The unit it keeps (`TandemConfig.certified.unit`) is a host row or a block of `block_size` rows. Rows rank by the
key sketch's per-row bounds, so a block whose mass sits in one row costs one row; `select` then returns a row
mask and `unit` is 1. The counters "units_kept" / "units_live" count the kept and live units per KV head.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import certify

# device-side counters of the certified selection, summed over steps (`Certifier.statistics`)
CERT_COUNTERS = (
    "head_steps", "p_sum", "p_max", "bound_sum", "bound_max", "met", "excess_max", "units_kept", "units_live",
)  # fmt: skip
_MAXIMA = ("p_max", "bound_max", "excess_max")
ALL_COUNTERS = ("head_steps", "met", "units_kept", "units_live")  # what an `attend_all` step adds to (p = 0)


def host_digests(host, device):
    """(key_min, key_max, block_valid) of the host blocks on `device`: the device mirror where there is one
    (capacity-wide), else the host tier's own digests of its live blocks; empty blocks as (+inf, -inf)."""
    if host.key_min_dev is not None and host.key_min_dev.device == device:
        valid = host.block_valid_dev
        kmin, kmax = host.key_min_dev, host.key_max_dev
    else:
        host.wait()
        nblk = host.rows // host.block_size
        valid = host.valid[:, : nblk * host.block_size].view(host.batch, nblk, host.block_size).any(-1)
        kmin, kmax = (t.to(device) for t in host.digest())
        valid = valid.to(device)
    empty = ~valid[:, None, :, None]
    return kmin.masked_fill(empty, float("inf")), kmax.masked_fill(empty, float("-inf")), valid


def span_blocks(host, device) -> int:
    """The host blocks a certified selection on `device` spans: the device mirror's capacity where there is one
    (so that a recorded step follows the host tier's growth; the blocks past the live ones have no rows), else
    the live blocks."""
    mirrored = host.key_min_dev is not None and host.key_min_dev.device == device
    return (host.capacity if mirrored else host.rows) // host.block_size


def certifies_rows(config) -> bool:
    """True when `config`'s certified selection keeps single rows (`TandemConfig.certified.unit`)."""
    unit = config.certified.unit
    return unit == "row" or (unit is None and config.certified.bound == "sketch")


def certified_row_mass(host, q: torch.Tensor, scale: float):
    """(upper, lower [B, Hq, n], row_valid [B, n]): per row, the scaled logit bounds of the key sketch, which are
    also the log of each row's mass bounds; n covers the device mirror's capacity where there is one (rows past
    the live ones: -inf and invalid)."""
    n = span_blocks(host, q.device) * host.block_size
    valid = host.row_valid_dev[:, :n]
    upper, lower = certify.sketch_logit_bounds(
        q, host.key_codes_dev[:, :, :n], host.key_code_scale_dev[:, :, :n], host.key_code_error_dev[:, :, :n],
        valid, scale,
    )  # fmt: skip
    return upper, lower, valid


def certified_mass(host, q: torch.Tensor, scale: float, bound: str):
    """(mass, lower [B, Hq, nb], rows [B, nb]): the log of an upper and of a lower bound of each host block's
    mass per query head, and its rows, from the key sketch (`bound` "sketch") or the block digests ("digest");
    see `certify`. nb covers the device mirror's capacity where there is one (so that a recorded step follows
    the host tier's growth; the blocks past the live ones have no rows), else the live blocks."""
    nb = span_blocks(host, q.device)
    rows = host.block_rows_dev[:, :nb]
    if bound == "sketch":
        n = nb * host.block_size
        upper, lower = certify.sketch_logit_bounds(
            q, host.key_codes_dev[:, :, :n], host.key_code_scale_dev[:, :, :n], host.key_code_error_dev[:, :, :n],
            host.row_valid_dev[:, :n], scale,
        )  # fmt: skip
        return (*(certify.sketch_mass_bounds(b, host.block_size) for b in (upper, lower)), rows)
    key_min, key_max, _ = host_digests(host, q.device)
    centre, radius = host.key_centre_dev[:, :, :nb], host.key_radius_dev[:, :, :nb]
    upper = certify.mass_bounds(certify.logit_bounds(q, key_min, key_max, centre, radius, rows, scale), rows)
    return upper, certify.ball_lower_mass(q, centre, radius, rows, scale), rows


class Step(NamedTuple):
    """One layer's certified selection in flight, on the compute device: the units each KV head attends (union
    [B, Hkv, n] bool), per query head the units its certificate needed and those kept (≤ max_budget) [B, Hq],
    the live units [B, 1], and for the certificate the log mass bound of the skipped units (tail [B, Hq]) and
    their largest value norm (skipped_norm [B, Hkv])."""

    union: torch.Tensor
    needed: torch.Tensor
    kept: torch.Tensor
    live: torch.Tensor
    tail: torch.Tensor
    skipped_norm: torch.Tensor

    @property
    def met(self) -> torch.Tensor:
        return self.needed <= self.kept


class AllStep(NamedTuple):
    """A step that attends every host row (`Certifier.attend_all`): nothing is skipped, so every head's
    certificate holds with p = 0. units: the live units (rows, or blocks holding a live row), summed over the
    batch."""

    units: int


class Certifier:
    """One layer's certified selection and its counters.

    Example (what `QuestPolicy` does each step, on the compute device):

        certifier = Certifier(TandemConfig(policy="quest", epsilon=0.05))
        union = certifier.select(layer, q)          # [B, Hkv, nb] bool, or None without a host tier
        ...                                         # attend the hot tier and the union, merge
        certifier.after_attention(layer, out, lse)  # the step's certificate, counted
        certifier.statistics()["met"]
    """

    layout_skips = ("step", "last_certificate")  # a step's results (`engine.step.read_layout`)

    def __init__(self, config) -> None:
        self.config = config
        self.rows = certifies_rows(config)
        self.step: Step | AllStep | None = None  # the step in flight, for after_attention
        self._counters: torch.Tensor | None = None
        self._maxima: torch.Tensor | None = None  # which counters keep a maximum instead of a sum
        # (p [B, Hq], output bound [B, Hq]) of the last step's certificate, None when it had no host tier
        self.last_certificate: tuple[torch.Tensor, torch.Tensor] | None = None
        self._all_counts = dict.fromkeys(ALL_COUNTERS, 0.0)  # `attend_all` steps, counted on the host
        self._all_zeros: torch.Tensor | None = None

    def select(self, layer, q: torch.Tensor, forced: torch.Tensor | None = None) -> torch.Tensor | None:
        """[B, Hkv, n] bool: the units each KV head attends (rows, or blocks: `unit`), `forced` [B, Hkv, nb]
        bool blocks (or None) among them, for q [B, Hq, D] on the compute device; None when the layer has no
        host rows."""
        host = layer.host
        if host is None or host.rows == 0:
            self.step = None
            return None
        scale = layer.attention_scale if layer.attention_scale is not None else q.shape[-1] ** -0.5
        with torch.no_grad():
            known = certify.hot_mass(q, layer.hot.keys, layer.hot.valid, scale)
            if self.rows:
                self.step = self._select_rows(layer, q, scale, known, forced)
                return self.step.union
            mass, lower, rows = certified_mass(host, q, scale, self.config.certified.bound)
            # live blocks [B, 1] as a device tensor, so that a recorded step follows the host tier's growth
            live = (rows > 0).sum(-1, keepdim=True)
            most = torch.ceil(live * self.config.certified.max_budget).long().clamp(min=1)  # [B, 1]
            union, needed, kept = certify.certified_blocks(
                mass, known, self.config.certified.epsilon, most, layer.num_kv_heads, lower, forced
            )
            tail, skipped_norm = certify.skipped_blocks(
                mass, union, host.value_norm_dev[:, :, : rows.shape[1]], rows
            )
        self.step = Step(union, needed, kept, live, tail, skipped_norm)
        return union

    def attend_all(self, layer, q: torch.Tensor) -> None:
        """Record a step in which each KV head attends every host row, selected by no bound (a policy's choice
        where that costs less than selecting; the host tier need keep no bounds); `after_attention` counts its
        certificate, p = 0."""
        host = layer.host
        if host is None or host.rows == 0:
            self.step = None
            return
        host.wait()
        # counted as rows arrive, not at every step: this runs per request, layer and step where a CPU serves many
        self.step = AllStep(host.valid_total() if self.rows else host.valid_blocks_total())

    def _select_rows(self, layer, q, scale: float, known, forced) -> Step:
        """Every row a unit of its own (`certify.certified_rows`); a block's value norm bounds each of its rows'."""
        host = layer.host
        n = span_blocks(host, q.device) * host.block_size
        valid = host.row_valid_dev[:, :n]
        live = valid.sum(-1, keepdim=True)  # [B, 1] on the device: a recorded step follows the tier's growth
        most = torch.ceil(live * self.config.certified.max_budget).long().clamp(min=1)
        if forced is not None:
            forced = forced.repeat_interleave(host.block_size, dim=-1) & valid[:, None, :]
        union, needed, kept, tail, skipped_norm = certify.certified_rows(
            q, host.key_codes_dev[:, :, :n], host.key_code_scale_dev[:, :, :n], host.key_code_error_dev[:, :, :n],
            valid, scale, known, self.config.certified.epsilon, most, layer.num_kv_heads,
            host.value_norm_dev[:, :, : n // host.block_size], host.block_size, forced,
        )  # fmt: skip
        return Step(union, needed, kept, live, tail, skipped_norm)

    def unit(self, host) -> int | None:
        """The rows of one unit of `select`'s mask: None for single rows (a `Selection` of kind "rows"), else
        the host tier's block size."""
        return None if self.rows else host.block_size

    def after_attention(self, layer, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Count this step's certificate (`certify.certificate`) on the device, with the exact attended mass."""
        self.last_certificate = None
        if self.step is None:
            return
        s, self.step = self.step, None
        if isinstance(s, AllStep):
            self._count_all(layer, s, lse)
            return
        with torch.no_grad():
            p, bound = certify.certificate_from_tail(s.tail, s.skipped_norm, lse, out)
            self.last_certificate = (p, bound)
            excess = (p - self.config.certified.epsilon).clamp(min=0)
            step = torch.stack([
                torch.full_like(p[0, 0], p.numel()), p.sum(), p.max(), bound.sum(), bound.max(),
                s.met.float().sum(), excess.max(), s.union.sum(-1).float().sum(),
                (s.live.float() * layer.num_kv_heads).sum(),
            ])  # fmt: skip
            self.prepare(step.device)  # (made already where a step may record: `Policy.prepare_step`)
            counters = self._counters
            counters.copy_(torch.where(self._maxima, torch.maximum(counters, step), counters + step))

    def prepare(self, device: torch.device) -> None:
        """The device counters a step adds to, on `device`: made once, eagerly, and updated in place, so that a
        recorded step adds to the same tensor at every replay."""
        if self._counters is None or self._counters.device != device:
            self._counters = torch.zeros(len(CERT_COUNTERS), dtype=torch.float32, device=device)
            self._maxima = torch.tensor([n in _MAXIMA for n in CERT_COUNTERS], device=device)

    def _count_all(self, layer, s: AllStep, lse: torch.Tensor) -> None:
        """An `attend_all` step: every head met epsilon with p = 0 and kept every live unit. It runs eagerly on
        the host (`QuestPolicy.attends_all`), so it counts on the host, apart from the device counters."""
        heads = lse.numel()
        units = float(s.units * layer.num_kv_heads)
        counts = self._all_counts
        counts["head_steps"] += heads
        counts["met"] += heads
        counts["units_kept"] += units
        counts["units_live"] += units
        if self._all_zeros is None or self._all_zeros.shape != lse.shape:
            self._all_zeros = torch.zeros(lse.shape, dtype=torch.float32, device=lse.device)
        self.last_certificate = (self._all_zeros, self._all_zeros)

    def statistics(self) -> dict:
        """The counters since the last reset (one device read): see CERT_COUNTERS."""
        values = self._counters.tolist() if self._counters is not None else [0.0] * len(CERT_COUNTERS)
        counts = dict(zip(CERT_COUNTERS, values))
        for name, value in self._all_counts.items():
            counts[name] += value
        return counts

    def clear(self) -> None:
        """A new request's state (`Policy.clear`): no step in flight, no certificate, nothing counted."""
        self.step = self.last_certificate = None
        self.reset_statistics()

    def reset_statistics(self) -> None:
        self._all_counts = dict.fromkeys(ALL_COUNTERS, 0.0)
        if self._counters is not None:
            with torch.inference_mode():  # (the decode loop may have made them an inference tensor)
                self._counters.zero_()  # in place: a recorded step keeps adding to this tensor
