"""A rank's shard of a checkpoint, read slice by slice: no rank ever holds the whole model.

For a Hugging Face directory of safetensors files (or a .gguf file's converted copy in the model cache), the
shard is built empty on the rank's GPU from `shard_config`, and each of its tensors is filled from the
rank's slice of the checkpoint's tensor (`safe_open(...).get_slice`, memory-mapped): 70B in bf16 costs each of 2
ranks ~71 GB of reads, not 141. Anything else (a .gguf file not yet converted, .bin weights) is loaded whole on the
CPU once per rank and cut there (`shard_model_`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models import DTYPES, auto_dtype, load_model, locate_model
from .tensor_parallel import (
    COLUMNS,
    ROWS,
    Rank,
    attach_collectives,
    rank_slice,
    shard_config,
    shard_model_,
    splits_vocab,
)


def load_shard(path, rank: Rank, dtype: str = "auto", cache: bool | None = None):
    """(`rank`'s shard of the model at `path` on the rank's device, its tokenizer). dtype as in `load_model`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported: allowed {', '.join(DTYPES)}")
    _, location, extra, _ = locate_model(path, cache)
    files = sorted(Path(location).glob("*.safetensors")) if not extra else []
    if not files:
        model, tokenizer = load_model(path, device="cpu", dtype=dtype, cache=cache)
        return shard_model_(model, rank).to(rank.device), tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..shapes import rebuild_rotary

    config = AutoConfig.from_pretrained(location, local_files_only=True)
    chosen = DTYPES[dtype] if dtype != "auto" else auto_dtype(rank.device)
    chosen = chosen or _checkpoint_dtype(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shard_config(config, rank.world))
    model.to(dtype=chosen)
    model.to_empty(device=rank.device)
    _fill_from(model, files, rank, config)
    rebuild_rotary(model, rank.device)
    attach_collectives(model, rank)
    tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.eval(), tokenizer


def _checkpoint_dtype(config) -> torch.dtype:
    name = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or "float32"
    return name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."))


@torch.no_grad()
def _fill_from(model, files: list[Path], rank: Rank, config) -> None:
    """Copy each of the shard's parameters from its slice of the checkpoint's tensor of the same name."""
    from safetensors import safe_open

    where = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update({name: file for name in f.keys()})
    params = dict(model.named_parameters())
    vocab_split = splits_vocab(model, rank)
    if vocab_split:
        # the head's own rows (a head tied to the embeddings is untied: the table stays whole)
        head = model.lm_head
        vocab, hidden = head.weight.shape
        head.weight = torch.nn.Parameter(head.weight.new_empty(vocab // rank.world, hidden))
        params["lm_head.weight"] = head.weight
    seen = set()
    for name, param in params.items():
        if param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        source = name if name in where else _tied_source(name, where)
        with safe_open(str(where[source]), framework="pt") as f:
            tensor = _slice_of(f.get_slice(source), name, param, rank, vocab_split)
        param.copy_(tensor.to(param.dtype))


def _tied_source(name: str, where: dict) -> str:
    if name == "lm_head.weight" and "model.embed_tokens.weight" in where:
        return "model.embed_tokens.weight"  # tied embeddings: the checkpoint stores the table once
    raise ValueError(f"the checkpoint has no tensor {name!r} that this model's shard needs")


def _slice_of(stored, name: str, param: torch.Tensor, rank: Rank, vocab_split: bool) -> torch.Tensor:
    """The rank's part of checkpoint tensor `stored` (a safetensors slice) for shard parameter `name`: the rule
    of `shard_model_`, read from the file."""
    module, _, kind = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    whole = stored.get_shape()
    if leaf in ROWS or (name.startswith("lm_head.") and vocab_split):
        return stored[rank_slice(rank, whole[0])]
    if leaf in COLUMNS:
        if kind == "bias":
            return stored[:] if rank.rank == 0 else torch.zeros(param.shape)
        return stored[:, rank_slice(rank, whole[1])]
    return stored[:]
