"""Tensor parallelism for decode: a Llama-family model sharded over the GPUs of one host, Megatron style.

Each rank holds, per layer:

- `num_q_heads / N` query heads and `num_kv_heads / N` KV heads (q / k / v rows, o_proj columns): a GQA group
  never spans ranks, so a rank's attention, its `TandemCache` (hot tier on its GPU, host tier in its pinned
  memory) and its CPU attention are those of a one-GPU model with fewer heads;
- `intermediate_size / N` of the MLP (gate / up rows, down_proj columns);
- the LM head's `vocab_size / N` rows (all of them when the vocabulary does not divide);
- the embeddings and norms whole.

Two collectives per layer join the ranks: o_proj and down_proj each produce a partial sum that an all-reduce
completes, and the LM head's vocabulary slices are gathered. They run as forward hooks on those modules, so
transformers' forward (prefill, the HF baselines) and Tandem's own decode forward (`engine.forward`, inside the
step's CUDA graph) compute the same sharded model without a copy of either. A bias on o_proj or down_proj is
kept by rank 0 only, so the reduction adds it once.

The shard is a model built from `shard_config(config, N)`: the same architecture with fewer heads and a
narrower MLP, so everything that reads the config (the cache's shapes, attention's reshapes) sees the shard.

>>> rank = launch.init_ranks("cuda")          # under torchrun (or `tandem bench --gpus N`)
>>> model = shard_model_(load_model(path, device="cpu")[0], rank).to(rank.device)
>>> model = random_shard("llama-3.1-70b", rank, torch.bfloat16)   # random weights, built on the rank's GPU
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..models import attention_shape

FAMILY = ("llama", "qwen2", "mistral")
# each layer's linears, and how they split: by output rows (heads, MLP columns) or by input columns (the ones whose
# partial sums the all-reduce completes; their bias is rank 0's)
LINEARS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
COLUMNS = ("o_proj", "down_proj")


@dataclass(frozen=True)
class Rank:
    """This process's place among the tensor-parallel ranks: `rank` of `world`, its device, and the process
    group of the collectives (None: the default group)."""

    rank: int
    world: int
    device: torch.device
    group: object | None = None

    @property
    def backend(self) -> str:
        return dist.get_backend(self.group)


def check_shardable(config, world: int) -> None:
    """Raise ValueError naming what keeps `config` from splitting over `world` ranks."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"gpus: expected a positive integer, got {world!r}")
    text = config.get_text_config(decoder=True)
    kind = getattr(text, "model_type", None)
    if kind not in FAMILY:
        raise ValueError(
            f"tensor parallelism supports model types {', '.join(FAMILY)}, not {kind!r}; run it on one GPU"
        )
    _, num_q_heads, num_kv_heads, _ = attention_shape(text)
    for name, value in (
        ("num_key_value_heads", num_kv_heads),
        ("num_attention_heads", num_q_heads),
        ("intermediate_size", text.intermediate_size),
    ):
        if value % world:
            allowed = [n for n in range(1, value + 1) if value % n == 0 and num_kv_heads % n == 0]
            raise ValueError(
                f"gpus={world}: the model's {name}={value} does not split over {world} ranks; allowed gpus: "
                f"{', '.join(map(str, allowed))}"
            )


def shard_config(config, world: int):
    """A copy of `config` describing one rank's shard: heads and intermediate size divided by `world`,
    `head_dim` written out (it no longer equals hidden_size / heads)."""
    check_shardable(config, world)
    sharded = copy.deepcopy(config)
    text = sharded.get_text_config(decoder=True)
    _, num_q_heads, num_kv_heads, head_dim = attention_shape(text)
    text.head_dim = head_dim
    text.num_attention_heads = num_q_heads // world
    text.num_key_value_heads = num_kv_heads // world
    text.intermediate_size = text.intermediate_size // world
    text.tensor_parallel_world = world
    return sharded


@torch.no_grad()
def shard_model_(model, rank: Rank):
    """Cut a whole model down, in place, to `rank`'s shard and attach the collectives; returns the model.

    The model may sit anywhere (the CPU, typically, so that only the shard moves to the GPU afterwards). Every
    rank must pass the same weights. Raises ValueError for a model outside the family or a split that does not
    divide."""
    if getattr(model, "tandem_rank", None) is not None:
        raise ValueError("the model is already a tensor-parallel shard")
    _check_layout(model)
    sharded_text = shard_config(model.config, rank.world).get_text_config(decoder=True)
    for layer in model.model.layers:
        for part, names in LINEARS.items():
            for name in names:
                linear = getattr(getattr(layer, part), name)
                (_keep_rows if name in ROWS else _keep_columns)(linear, rank)
    text = model.config.get_text_config(decoder=True)
    for name in ("head_dim", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
        setattr(text, name, getattr(sharded_text, name))
    text.tensor_parallel_world = rank.world
    if splits_vocab(model, rank):
        _keep_rows(model.lm_head, rank)
    attach_collectives(model, rank)
    return model


def random_shard(
    name_or_config,
    rank: Rank,
    dtype: torch.dtype,
    num_layers: int | None = None,
    seed: int = 0,
    std: float = 0.02,
):
    """`rank`'s shard of a model of a named shape (or config) with random weights, built on the rank's device
    without the whole model ever existing: only the LM head is made whole first, then cut. Shards of different
    ranks hold different random weights (seed + rank); the step reads what a real shard's would."""
    from .. import shapes

    config = (
        shapes.shape_config(name_or_config, num_layers) if isinstance(name_or_config, str) else name_or_config
    )
    model = shapes.build_random_model(
        shard_config(config, rank.world),
        rank.device,
        dtype,
        num_layers=num_layers,
        seed=seed + rank.rank,
        std=std,
    )
    _check_layout(model)
    if splits_vocab(model, rank):
        _keep_rows(model.lm_head, rank)
    attach_collectives(model, rank)
    return model


def attach_collectives(model, rank: Rank) -> None:
    """The all-reduce after every o_proj and down_proj and the gather of the LM head's vocabulary slices, as
    forward hooks; `model.tandem_rank` records the rank."""
    if rank.world > 1:
        for layer in model.model.layers:
            layer.self_attn.o_proj.register_forward_hook(_sum_over_ranks(rank))
            layer.mlp.down_proj.register_forward_hook(_sum_over_ranks(rank))
        if getattr(model.lm_head, "tandem_vocab_shard", False):
            model.lm_head.register_forward_hook(_gather_vocab(rank))
    object.__setattr__(model, "tandem_rank", rank)


def _sum_over_ranks(rank: Rank):
    def hook(module, inputs, partial):  # partial: [..., hidden], this rank's share of the sum
        dist.all_reduce(partial, group=rank.group)
        return partial

    return hook


def _gather_vocab(rank: Rank):
    def hook(module, inputs, logits):  # logits: [..., vocab / world], this rank's slice
        logits = logits.contiguous()
        if rank.backend == "nccl":
            parts = logits.new_empty((rank.world, *logits.shape))
            dist.all_gather_into_tensor(parts, logits, group=rank.group)
        else:  # gloo has no all_gather_into_tensor
            parts = [torch.empty_like(logits) for _ in range(rank.world)]
            dist.all_gather(parts, logits, group=rank.group)
            parts = torch.stack(parts)
        return parts.movedim(0, -2).reshape(*logits.shape[:-1], rank.world * logits.shape[-1])

    return hook


def _check_layout(model) -> None:
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        raise ValueError(f"{type(model).__name__} lacks the Llama layout (model.layers, lm_head)")
    for layer in inner.layers:
        for part, names in LINEARS.items():
            for name in names:
                linear = getattr(getattr(layer, part, None), name, None)
                if type(linear) is not torch.nn.Linear or not linear.weight.is_floating_point():
                    raise ValueError(
                        f"tensor parallelism needs plain float nn.Linear layers; {part}.{name} is "
                        f"{type(linear).__name__} (quantized or wrapped weights)"
                    )


def rank_slice(rank: Rank, whole: int) -> slice:
    """`rank`'s part of a dimension of `whole` entries (a multiple of the world)."""
    width = whole // rank.world
    return slice(rank.rank * width, (rank.rank + 1) * width)


def _keep_rows(linear: torch.nn.Linear, rank: Rank) -> None:
    rows = rank_slice(rank, linear.weight.shape[0])
    linear.weight = torch.nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: torch.nn.Linear, rank: Rank) -> None:
    columns = rank_slice(rank, linear.weight.shape[1])
    linear.weight = torch.nn.Parameter(linear.weight[:, columns].contiguous(), requires_grad=False)
    if linear.bias is not None and rank.rank != 0:  # the all-reduce adds rank 0's bias once
        linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = linear.weight.shape[1]


def splits_vocab(model, rank: Rank) -> bool:
    """Whether `rank`'s LM head keeps only its vocabulary slice: the vocabulary divides over the ranks and the
    head has no bias (else it stays whole on every rank, and an embedding tied to it too). When it splits, the
    head is marked for the gather and the config untied: re-tying would give the head the whole table back."""
    head = model.lm_head
    vocab = model.config.get_text_config(decoder=True).vocab_size
    if rank.world == 1 or vocab % rank.world or head.bias is not None:
        return False
    head.tandem_vocab_shard = True
    model.config.get_text_config(decoder=True).tie_word_embeddings = False
    model.config.tie_word_embeddings = False
    return True
