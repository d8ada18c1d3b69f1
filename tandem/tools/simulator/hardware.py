"""Hardware, model and cost tables of the PNM-KV platform (the paper's Tables 1-3 and Section 2.2).

Every number the paper states is cited by section or table. Values the paper leaves out are marked
``assumption`` and listed in ``docs/simulator.md``; they are the only knobs the model has.

Units are in the field names: ``_gib`` = 2**30 bytes, ``_gbs`` = 1e9 bytes/s, ``_tflops`` = 1e12 FLOP/s,
``_w`` = watts, ``_per_h`` = US dollars per hour.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
GB = 1e9


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as the step model sees it (PNM-KV Table 1).

    Example:
        >>> m = MODELS["llama-3.1-8b"]
        >>> m.kv_bytes_per_token  # bf16 keys + values over all layers
        131072
    """

    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    context_window: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_q_heads must be a multiple of num_kv_heads")

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head (the ``g`` of Table 1)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        """Parameters including untied embedding and LM head (RMSNorm weights included)."""
        q_dim = self.num_q_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        attn = self.hidden_size * q_dim * 2 + self.hidden_size * kv_dim * 2
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        return self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights resident on the GPUs."""
        return self.num_params * self.dtype_bytes

    @property
    def streamed_weight_bytes(self) -> int:
        """Bytes read from HBM per decode step: all weights but the embedding table (rows are gathered)."""
        return (self.num_params - self.vocab_size * self.hidden_size) * self.dtype_bytes

    @property
    def fc_flops_per_token(self) -> int:
        """FLOPs of the FC layers (QKV/O projections, MLP, LM head) for one token: 2 per weight."""
        return 2 * (self.num_params - self.vocab_size * self.hidden_size)

    @property
    def key_bytes_per_token(self) -> int:
        """Bytes of keys one token adds, over all layers."""
        return self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys + values one token adds, over all layers."""
        return 2 * self.key_bytes_per_token

    def digest_bytes_per_token(self, page_size: int) -> float:
        """Bytes of page digests (per-dim min and max key, Section 3.1) per token: two key rows per page."""
        return 2 * self.key_bytes_per_token / page_size

    @property
    def attention_flops_per_token(self) -> int:
        """FLOPs to attend one cached token for one query token: QK^T and PV, all layers and query heads."""
        return 4 * self.num_layers * self.num_q_heads * self.head_dim

    def score_flops_per_token(self, page_size: int) -> float:
        """FLOPs of query-to-digest scoring per cached token: q*min, q*max, max, sum per query head dim."""
        return 4 * self.num_layers * self.num_q_heads * self.head_dim / page_size

    @property
    def exchange_bytes_per_request(self) -> int:
        """Bytes crossing GPU<->memory tier per request per step: q, k, v out; o and lse (fp32) back."""
        q = self.num_q_heads * self.head_dim
        kv = 2 * self.num_kv_heads * self.head_dim
        out = self.num_q_heads * self.head_dim
        return self.num_layers * ((q + kv + out) * self.dtype_bytes + self.num_q_heads * 4)


# Table 1 (layers, heads, head_dim, d_in/d_out, GQA group); exact hidden/intermediate sizes and vocab from
# the public Llama-3.1 configs (Table 1 rounds them to 4K/14K, 8K/28K, 16K/53K).
MODELS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 32, 32, 8, 128, 4096, 14336, 128256, 131072),
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", 80, 64, 8, 128, 8192, 28672, 128256, 131072),
    "llama-3.1-405b": ModelSpec("llama-3.1-405b", 126, 128, 8, 128, 16384, 53248, 128256, 131072),
}


@dataclass(frozen=True)
class GpuSpec:
    """One GPU: HBM, compute, power, host link and cost."""

    name: str
    hbm_gib: float
    hbm_gbs: float
    bf16_tflops: float
    tdp_w: float
    idle_w: float
    pcie_gbs: float  # one direction, raw
    nvlink_gbs: float  # one direction per GPU, raw
    hw_cost_per_h: float
    op_cost_per_h: float


GPUS: dict[str, GpuSpec] = {
    # Section 4.1: A100-80GB, 2 TB/s HBM2E, in a DGX A100; Table 3: 400 W, 0.072 + 0.761 $/h.
    # 312 TFLOPS dense bf16, PCIe Gen4 x16 and 600 GB/s bidirectional NVLink are NVIDIA's datasheet values;
    # idle power 60 W is an assumption.
    "a100": GpuSpec("A100-80GB", 80, 2039, 312, 400, 60, 32, 300, 0.761, 0.072),
    # Option, not in the paper: H100 SXM datasheet (3.35 TB/s, 989 TFLOPS bf16, 700 W, Gen5, 900 GB/s NVLink).
    # Operating cost = 0.7 kW * 0.181 $/kWh (Table 3's rate); hardware 1.14 $/h ($30k over 3 years) and
    # idle 90 W are assumptions.
    "h100": GpuSpec("H100-80GB-SXM", 80, 3350, 989, 700, 90, 64, 450, 1.14, 0.127),
}


@dataclass(frozen=True)
class MemoryDeviceSpec:
    """A CXL memory device: plain expander (baseline) or PNM (Table 2)."""

    name: str
    capacity_gib: float
    bandwidth_gbs: float
    tflops: float  # 0 for a plain expander
    active_w: float
    idle_w: float
    link_gbs: float  # device link to the CXL switch, one direction, raw
    hw_cost_per_h: float
    op_cost_per_h: float


# Table 2 and Section 2.2: 512 GB LPDDR5X at 1.1 TB/s, 8 TFLOPS FP16, ~150 W, x8 PCIe 6.0 device link
# (8 GB/s per lane per direction). Table 3: 0.027 + 0.266 $/h. Capacity is read as GiB: that reading gives
# the paper's batch of 96 for 70B at 128K on 8 devices (Section 4.2). Idle 60 W (DRAM 40 W + controller
# 20 W) is an assumption.
PNM = MemoryDeviceSpec("CXL-PNM", 512, 1100, 8.0, 150, 60, 64, 0.266, 0.027)

# Baseline CXL-Mem expander: same module without the accelerator. 60 W and a hardware cost of half a
# PNM device are assumptions (the paper gives no price for a plain expander).
CXL_MEM = MemoryDeviceSpec("CXL-Mem", 512, 1100, 0.0, 60, 60, 64, 0.133, 0.011)


@dataclass(frozen=True)
class PlatformSpec:
    """Interconnect, efficiencies and overheads shared by all schemes.

    Efficiencies are the fraction of a datasheet peak that a well-tuned kernel reaches (assumptions).
    """

    # Section 2.2: the host reaches the CXL switch over x16; the switch runs PCIe 6.0 but the 4th-gen Xeon
    # host of Section 4.1 has PCIe 5.0 root ports, so the link trains at 32 GT/s: 64 GB/s per direction.
    # With no peer-to-peer (Section 2.2) every CXL<->GPU byte of a server crosses this link.
    host_link_gbs: float = 64.0
    gpus_per_server: int = 8  # DGX A100 (Section 4.1)
    inter_node_gbs: float = 25.0  # assumption: one 200 Gb/s HDR port per GPU between DGX nodes
    gpu_bw_eff: float = 0.8
    gpu_flops_eff: float = 0.7
    pnm_bw_eff: float = 0.9
    pnm_flops_eff: float = 0.9
    link_eff: float = 0.8
    hbm_usable: float = 0.9  # the rest is CUDA context, workspace, activations, fragmentation
    allreduce_latency_us: float = 10.0  # per all-reduce inside a server
    inter_node_latency_us: float = 25.0  # per all-reduce across servers
    layer_overhead_us: float = (
        5.0  # per layer and offload hop: launch, doorbell, MSI-X interrupt (Section 4.1)
    )
    # PnG-KV GPUs stay at full power through the attention phase they share with the PNMs (they hold the
    # steady attention and the merge); PNM-KV GPUs idle then. This is what makes PnG-KV cost more energy
    # per token than PNM-KV in Section 4.2 despite its higher throughput.
    gpu_active_in_hybrid: bool = True


PLATFORM = PlatformSpec()

ELECTRICITY_PER_KWH = 0.181  # Table 3


def get_model(name: str) -> ModelSpec:
    """Look a model up by name; raise ValueError naming the allowed values."""
    key = name.lower()
    if key not in MODELS:
        raise ValueError(f"--model: unknown model {name!r}; allowed: {', '.join(MODELS)}")
    return MODELS[key]


def get_gpu(name: str) -> GpuSpec:
    """Look a GPU up by name; raise ValueError naming the allowed values."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"--gpu: unknown GPU {name!r}; allowed: {', '.join(GPUS)}")
    return GPUS[key]
