"""Decode-step time of the three schemes (PNM-KV Section 3, Figure 6), phase by phase.

Every phase is a roofline: ``max(bytes / bandwidth, flops / peak)`` at the efficiencies of
``PlatformSpec``. FC layers always run on the GPUs with tensor parallelism; the schemes differ in where
page selection and attention run, where KV lives (which sets the batch) and what crosses CXL.

- ``baseline`` (GPU-CXL-Mem, ArkVale-style): digests + a T_Budget page cache per request in HBM, the full
  KV in CXL memory, missing pages recalled over CXL -> host -> PCIe every step. Batch: free HBM.
- ``pnm`` (PNM-KV): selection + attention on the PNM devices, requests spread data-parallel over them
  (Section 3.2); only q/k/v and outputs cross CXL. Batch: PNM capacity.
- ``pnkv`` (PnG-KV): as ``pnm`` plus a steady share of T_Budget attended on the GPUs from a resident set
  that Algorithm 1 refreshes by recall (Section 3.3). Batch: PNM capacity.

All times are seconds per decode step (one token for each of ``batch`` requests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.tools.simulator.config import SystemConfig
from tandem.tools.simulator.hardware import CXL_MEM, GIB, MemoryDeviceSpec

PHASES = ("fc", "attention", "recall", "communication")


@dataclass
class StepResult:
    """One decode step of one scheme.

    phases: seconds on the critical path per phase (keys ``PHASES``); they sum to the step time.
    gpu_busy_s / mem_busy_s: seconds one GPU / the busiest memory device draws active power per step.
    traffic: bytes per step (``recall``, ``exchange``, ``hbm``, ``pnm``).
    info: sizes behind the result (``budget_tokens``, ``steady_tokens``, ``requests_per_device``, ...).
    """

    scheme: str
    batch: int
    batch_limit: str
    num_mem_devices: int
    phases: dict[str, float] = field(default_factory=dict)
    gpu_busy_s: float = 0.0
    mem_busy_s: float = 0.0
    traffic: dict[str, float] = field(default_factory=dict)
    info: dict[str, float | str] = field(default_factory=dict)
    feasible: bool = True
    reason: str = ""

    @property
    def step_s(self) -> float:
        """Seconds per decode step."""
        return sum(self.phases.values())


def roofline(num_bytes: float, flops: float, bytes_per_s: float, flops_per_s: float) -> float:
    """Seconds for a phase that moves ``num_bytes`` and computes ``flops``: the slower of the two."""
    memory_s = num_bytes / bytes_per_s if num_bytes else 0.0
    compute_s = flops / flops_per_s if flops else 0.0
    return max(memory_s, compute_s)


def _gpu_roofline(cfg: SystemConfig, num_bytes: float, flops: float) -> float:
    p, g = cfg.platform, cfg.gpu
    return roofline(num_bytes, flops, g.hbm_gbs * 1e9 * p.gpu_bw_eff, g.bf16_tflops * 1e12 * p.gpu_flops_eff)


def _pnm_roofline(cfg: SystemConfig, num_bytes: float, flops: float) -> float:
    p, d = cfg.platform, cfg.memory
    return roofline(num_bytes, flops, d.bandwidth_gbs * 1e9 * p.pnm_bw_eff, d.tflops * 1e12 * p.pnm_flops_eff)


def fc_time(cfg: SystemConfig, batch: int) -> float:
    """FC layers with TP over all GPUs: each GPU streams its weight shard once for the whole batch."""
    m, n = cfg.model, cfg.num_gpus
    return _gpu_roofline(cfg, m.streamed_weight_bytes / n, m.fc_flops_per_token * batch / n)


def tp_time(cfg: SystemConfig, batch: int) -> float:
    """Two ring all-reduces of the hidden state per layer (after attention-out and MLP-down)."""
    n, p = cfg.num_gpus, cfg.platform
    if n == 1:
        return 0.0
    # Hierarchical ring: NVLink inside a server, then 1/g of the data per GPU between servers.
    servers, local = cfg.num_servers, min(n, p.gpus_per_server)
    num_bytes = batch * cfg.model.hidden_size * cfg.model.dtype_bytes
    one = (
        2 * (local - 1) / local * num_bytes / (cfg.gpu.nvlink_gbs * 1e9 * p.link_eff)
        + p.allreduce_latency_us * 1e-6
    )
    if servers > 1:
        inter = 2 * (servers - 1) / servers * num_bytes / local / (p.inter_node_gbs * 1e9 * p.link_eff)
        one += inter + p.inter_node_latency_us * 1e-6
    return 2 * cfg.model.num_layers * one


def gpu_free_bytes(cfg: SystemConfig) -> float:
    """HBM left for KV after weights, over all GPUs."""
    total = cfg.num_gpus * cfg.gpu.hbm_gib * GIB * cfg.platform.hbm_usable
    return total - cfg.model.weight_bytes


def cxl_gpu_bandwidth(cfg: SystemConfig, num_devices: int, device: MemoryDeviceSpec) -> float:
    """Bytes/s between CXL devices and GPUs: device links -> switch -> host x16 -> each GPU's PCIe.

    No peer-to-peer (Section 2.2), so every byte crosses the host link of its server.
    """
    p = cfg.platform
    raw = min(
        cfg.num_gpus * cfg.gpu.pcie_gbs, cfg.num_servers * p.host_link_gbs, num_devices * device.link_gbs
    )
    return raw * 1e9 * p.link_eff


def cxl_host_bandwidth(cfg: SystemConfig) -> float:
    """Bytes/s between the host and the memory devices (device links -> switch -> host x16)."""
    p = cfg.platform
    raw = min(cfg.num_servers * p.host_link_gbs, cfg.num_pnm * cfg.memory.link_gbs)
    return raw * 1e9 * p.link_eff


def _infeasible(cfg: SystemConfig, reason: str, limit: str = "does not fit") -> StepResult:
    return StepResult(cfg.scheme, 0, limit, max(cfg.num_pnm, 0), feasible=False, reason=reason)


def baseline_step(cfg: SystemConfig) -> StepResult:
    """GPU-CXL-Mem: ArkVale-style selection and recall on the GPUs (Section 2.3, Algorithm 1 left)."""
    m, w, p = cfg.model, cfg.workload, cfg.platform
    n, layers = cfg.num_gpus, m.num_layers
    ctx, budget = w.context_tokens, w.budget_tokens
    kv, digest = m.kv_bytes_per_token, m.digest_bytes_per_token(w.page_size)
    free = gpu_free_bytes(cfg)
    if free <= 0:
        return _infeasible(cfg, f"weights ({m.weight_bytes / 1e9:.0f} GB) do not fit in {n} GPU(s)")
    per_request = budget * kv + ctx * digest
    batch, limit = int(free // per_request), "GPU memory"
    if batch < 1:
        return _infeasible(
            cfg,
            f"one request needs {per_request / 1e9:.1f} GB of HBM (T_Budget KV + digests),"
            f" {free / 1e9:.1f} GB free",
        )
    full_kv = ctx * kv
    cap = CXL_MEM.capacity_gib * GIB
    if cfg.num_pnm:
        num_mem = cfg.num_pnm
        if batch * full_kv > num_mem * cap:
            batch, limit = int(num_mem * cap // full_kv), "CXL memory capacity"
            if batch < 1:
                return _infeasible(cfg, f"one request's KV ({full_kv / 1e9:.0f} GB) exceeds the CXL memory")
    if w.max_batch is not None and w.max_batch < batch:
        batch, limit = w.max_batch, "--batch"
    num_mem = cfg.num_pnm or max(1, math.ceil(batch * full_kv / cap))

    select = _gpu_roofline(
        cfg, batch * ctx * digest / n, batch * ctx * m.score_flops_per_token(w.page_size) / n
    )
    attend = _gpu_roofline(cfg, batch * budget * kv / n, batch * budget * m.attention_flops_per_token / n)
    recall_bytes = batch * min(w.recall_rate * ctx, budget) * kv
    recall = recall_bytes / cxl_gpu_bandwidth(cfg, num_mem, CXL_MEM) + layers * p.layer_overhead_us * 1e-6
    fc, comm = fc_time(cfg, batch), tp_time(cfg, batch)
    return StepResult(
        "baseline",
        batch,
        limit,
        num_mem,
        phases={"fc": fc, "attention": select + attend, "recall": recall, "communication": comm},
        gpu_busy_s=fc + comm + select + attend,
        mem_busy_s=recall,
        traffic={"recall": recall_bytes, "exchange": 0.0, "hbm": batch * (budget * kv + ctx * digest)},
        info={"budget_tokens": budget, "recall_tokens": min(w.recall_rate * ctx, budget)},
    )


@dataclass(frozen=True)
class _PnmLayout:
    batch: int
    limit: str
    shards: int  # devices one request's KV is split over
    work_per_device: float  # request-equivalents of attention work on the busiest device


def pnm_layout(cfg: SystemConfig) -> _PnmLayout | str:
    """Place requests on PNM devices; return the layout or the reason nothing fits.

    DP (Section 3.2) keeps whole requests on one device, so the batch is ``#PNM * floor(cap / request)``.
    A request larger than one device (405B at 1M) is split by tokens over the fewest devices that hold
    it; each shard selects and attends locally and the partial (o, lse) merge exactly. TP splits every
    request by heads over all devices.
    """
    m, w = cfg.model, cfg.workload
    request = w.context_tokens * (m.kv_bytes_per_token + m.digest_bytes_per_token(w.page_size))
    cap, n = cfg.memory.capacity_gib * GIB, cfg.num_pnm
    if w.mapping == "tp":
        shards, groups = n, 1
    else:
        shards = max(1, math.ceil(request / cap))
        groups = n // shards
        if groups == 0:
            return f"one request's KV + digests ({request / 1e9:.0f} GB) need {shards} PNM devices, have {n}"
    per_group = int(shards * cap // request)
    if per_group < 1:
        return f"one request's KV + digests ({request / 1e9:.0f} GB) exceed {shards} PNM device(s)"
    batch, limit = groups * per_group, f"{cfg.memory.name} capacity"
    if w.max_batch is not None and w.max_batch < batch:
        batch, limit = w.max_batch, "--batch"
    return _PnmLayout(batch, limit, shards, math.ceil(batch / groups) / shards)


def _pnm_attention(cfg: SystemConfig, layout: _PnmLayout, pnm_tokens: int) -> tuple[float, float, float]:
    """(selection s, attention s, bytes read) on the busiest PNM device."""
    m, w = cfg.model, cfg.workload
    ctx, work = w.context_tokens, layout.work_per_device
    digest = m.digest_bytes_per_token(w.page_size)
    select = _pnm_roofline(cfg, work * ctx * digest, work * ctx * m.score_flops_per_token(w.page_size))
    read = work * pnm_tokens * m.kv_bytes_per_token
    attend = _pnm_roofline(cfg, read, work * pnm_tokens * m.attention_flops_per_token)
    return select, attend, read + work * ctx * digest


def _exchange_time(cfg: SystemConfig, layout: _PnmLayout) -> tuple[float, float]:
    """(seconds, bytes) of the GPU<->PNM activation exchange per step, independent of context for DP."""
    m, w, p = cfg.model, cfg.workload, cfg.platform
    num_bytes = layout.batch * m.exchange_bytes_per_request
    if layout.shards > 1 and w.mapping == "dp":  # partial (o, lse) of every extra token shard
        num_bytes += (layout.shards - 1) * layout.batch * m.num_layers * m.num_q_heads * (m.head_dim * 2 + 4)
    seconds = num_bytes / cxl_gpu_bandwidth(cfg, cfg.num_pnm, cfg.memory)
    messages = 2
    if w.mapping == "tp":  # Figure 7(a): partial page scores of every device reduced through the host
        pages = w.context_tokens / w.page_size
        reduction = (cfg.num_pnm - 1) * layout.batch * m.num_layers * pages * 4  # fp32 scores
        seconds += reduction / cxl_host_bandwidth(cfg)
        num_bytes += reduction
        messages += cfg.num_pnm - 1
    return seconds + m.num_layers * messages * p.layer_overhead_us * 1e-6, num_bytes


def pnm_step(cfg: SystemConfig) -> StepResult:
    """PNM-KV: all selection and attention near memory; GPUs idle meanwhile (Figure 6(b))."""
    if gpu_free_bytes(cfg) <= 0:
        return _infeasible(cfg, f"weights ({cfg.model.weight_bytes / 1e9:.0f} GB) do not fit in the GPUs")
    layout = pnm_layout(cfg)
    if isinstance(layout, str):
        return _infeasible(cfg, layout)
    budget = cfg.workload.budget_tokens
    select, attend, pnm_bytes = _pnm_attention(cfg, layout, budget)
    exchange, exchange_bytes = _exchange_time(cfg, layout)
    fc, comm = fc_time(cfg, layout.batch), tp_time(cfg, layout.batch)
    return StepResult(
        "pnm",
        layout.batch,
        layout.limit,
        cfg.num_pnm,
        phases={"fc": fc, "attention": select + attend, "recall": 0.0, "communication": comm + exchange},
        gpu_busy_s=fc + comm,
        mem_busy_s=select + attend,
        traffic={"recall": 0.0, "exchange": exchange_bytes, "pnm": pnm_bytes},
        info={
            "budget_tokens": budget,
            "requests_per_device": layout.work_per_device,
            "shards": layout.shards,
        },
    )


def _steady_costs(cfg: SystemConfig, layout: _PnmLayout) -> tuple[float, float, float]:
    """Seconds per steady token on the PNM side and the GPU side (recall + attention); fixed latency."""
    m, w, p = cfg.model, cfg.workload, cfg.platform
    kv, flops = m.kv_bytes_per_token, m.attention_flops_per_token
    work, batch, n = layout.work_per_device, layout.batch, cfg.num_gpus
    pnm = _pnm_roofline(cfg, work * kv, work * flops)
    gpu = _gpu_roofline(cfg, batch * kv / n, batch * flops / n)
    recall = batch * w.steady_churn * kv / cxl_gpu_bandwidth(cfg, cfg.num_pnm, cfg.memory)
    latency = m.num_layers * p.layer_overhead_us * 1e-6 if w.steady_churn else 0.0
    return pnm, gpu + recall, latency


def steady_tokens(cfg: SystemConfig, layout: _PnmLayout) -> tuple[int, float, str]:
    """(T_Steady per request, target ratio, what capped it).

    The target is ``ratio * T_Budget`` (ratio #GPU / (#GPU + #PNM), Section 4.1). It is capped by the HBM
    left for the whole batch (Section 3.3) and by the balance point where the GPU side (recall + attention)
    takes as long as the PNM side, past which more steady tokens only lengthen the step.
    """
    w = cfg.workload
    ratio = w.steady_ratio if w.steady_ratio is not None else cfg.num_gpus / (cfg.num_gpus + cfg.num_pnm)
    room = gpu_free_bytes(cfg) / (layout.batch * cfg.model.kv_bytes_per_token)
    if w.hot_tokens is not None:  # Tandem: a fixed hot set, refreshed by appends, never recalled
        tokens = min(w.hot_tokens, room)
        return (
            int(tokens),
            w.hot_tokens / w.budget_tokens,
            "hot set" if tokens == w.hot_tokens else "GPU memory",
        )
    pnm, gpu, latency = _steady_costs(cfg, layout)
    caps = {
        "ratio": ratio * w.budget_tokens,
        "GPU memory": room,
        "balance": max(0.0, (pnm * w.budget_tokens - latency) / (pnm + gpu)),
    }
    limit = min(caps, key=caps.get)
    return int(caps[limit] // w.page_size) * w.page_size, ratio, limit


def pnkv_step(cfg: SystemConfig) -> StepResult:
    """PnG-KV: PNM-KV plus steady tokens attended on the GPUs in parallel (Figure 6(c), Algorithm 1)."""
    if gpu_free_bytes(cfg) <= 0:
        return _infeasible(cfg, f"weights ({cfg.model.weight_bytes / 1e9:.0f} GB) do not fit in the GPUs")
    layout = pnm_layout(cfg)
    if isinstance(layout, str):
        return _infeasible(cfg, layout)
    m, w, p = cfg.model, cfg.workload, cfg.platform
    batch, n, kv = layout.batch, cfg.num_gpus, m.kv_bytes_per_token
    steady, ratio, steady_limit = steady_tokens(cfg, layout)
    selected = w.budget_tokens - steady
    hits = round(w.recall_hit * selected) if w.hot_tokens is not None else 0  # in Tandem's recall cache
    shared = (
        round(w.device_share * (selected - hits)) if w.hot_tokens is not None else 0
    )  # Tandem's gpu_share
    select, pnm_attend, pnm_bytes = _pnm_attention(cfg, layout, selected - hits - shared)
    if w.gpu_selection and w.hot_tokens is not None:  # digests mirrored on the GPU: scored from HBM
        digest_bytes = batch * w.context_tokens * m.digest_bytes_per_token(w.page_size)
        pnm_bytes -= layout.work_per_device * w.context_tokens * m.digest_bytes_per_token(w.page_size)
        select = _gpu_roofline(
            cfg, digest_bytes / n, batch * w.context_tokens * m.score_flops_per_token(w.page_size) / n
        )
    on_gpu = steady + hits  # attended from HBM
    gpu_attend = _gpu_roofline(cfg, batch * on_gpu * kv / n, batch * on_gpu * m.attention_flops_per_token / n)
    share_bytes = batch * shared * kv  # read by the GPU from the memory tier in place, over the link
    if share_bytes:
        gpu_attend += share_bytes / cxl_gpu_bandwidth(cfg, cfg.num_pnm, cfg.memory)
    churn = 0.0 if w.hot_tokens is not None else w.steady_churn
    recall_bytes = batch * churn * steady * kv
    recall = 0.0
    if recall_bytes:
        recall = (
            recall_bytes / cxl_gpu_bandwidth(cfg, cfg.num_pnm, cfg.memory)
            + m.num_layers * p.layer_overhead_us * 1e-6
        )
    # Both sides need this step's page selection; then they run in parallel and merge by LSE.
    gpu_side = recall + gpu_attend
    if gpu_side > pnm_attend:
        attention, recall_on_path = select + gpu_attend, recall
    else:
        attention, recall_on_path = select + pnm_attend, 0.0
    exchange, exchange_bytes = _exchange_time(cfg, layout)
    fc, comm = fc_time(cfg, batch), tp_time(cfg, batch)
    # GPUs that share the attention phase wait on the PNM partials to merge; counted active (see docs).
    gpu_attention_busy = select + max(gpu_side, pnm_attend) if p.gpu_active_in_hybrid else gpu_attend
    return StepResult(
        "pnkv",
        batch,
        layout.limit,
        cfg.num_pnm,
        phases={"fc": fc, "attention": attention, "recall": recall_on_path, "communication": comm + exchange},
        gpu_busy_s=fc + comm + gpu_attention_busy,
        mem_busy_s=select + pnm_attend,
        traffic={
            "recall": recall_bytes,
            "exchange": exchange_bytes,
            "pnm": pnm_bytes,
            "device_share": share_bytes,
            "recall_hits": batch * hits * kv,
        },
        info={
            "budget_tokens": w.budget_tokens,
            "steady_tokens": steady,
            "steady_ratio": ratio,
            "steady_limit": steady_limit,
            "requests_per_device": layout.work_per_device,
            "shards": layout.shards,
            "recall_hidden_s": recall - recall_on_path,
        },
    )


STEP_FUNCTIONS = {"baseline": baseline_step, "pnm": pnm_step, "pnkv": pnkv_step}


def decode_step(cfg: SystemConfig) -> StepResult:
    """Dispatch to the scheme of ``cfg``."""
    return STEP_FUNCTIONS[cfg.scheme](cfg)
