"""The compressed host tier (`TandemConfig.host.dtype`): 8-bit codes with per-block scales in host memory.

The kernels' own tests (against `reference.dequantize`d stores) are in tests/kernels/test_quantized_cpu.py and
tests/kernels/test_quantized_gpu.py; these check the tier, the layer and the engine built on them:
- a row decodes to within half a quantization step of what was written, and the digests stay exact;
- with every entry kept, attention equals dense attention over the decoded rows (the rows the kernels read),
  and stays within the format's error of exact dense attention;
- the engine's fixed-address step gives the tokens the model's own generate() gives with the same cache.
"""

from __future__ import annotations

import pytest
import torch

from tandem import QuestConfig, TandemCache, TandemConfig, generate_cache_kwargs
from tandem.attention import TaskPool, attend
from tandem.cache.host import HostTier
from tandem.cache.layer import LayerKV
from tandem.config import HostConfig, parse_setting
from tandem.engine import TandemRunner
from tandem.kernels import reference
from tandem.tools.evaluation.metrics import layer_full_attention
from tests.tiny import tiny_model
from tests.tolerances import assert_close

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
# largest |decoded - x| / (block's max |x|): half a step of int8's 127 levels; e4m3 keeps 3 mantissa bits
# (relative step 2^-3, half of it 2^-4) and flushes below its smallest subnormal (2^-9 of the scale's 448)
RELATIVE_ERROR = {"int8": 0.5 / 127, "fp8": 2**-4}


def _blocks(gen, batch=2, heads=3, rows=64, dim=16, dtype=torch.float32):
    keys = torch.randn(batch, heads, rows, dim, generator=gen).to(dtype)
    values = torch.randn(batch, heads, rows, dim, generator=gen).to(dtype)
    keys[..., 3] *= 20.0  # an outlier channel, as real keys have
    valid = torch.rand(batch, rows, generator=gen) > 0.2
    valid[-1, :16] = False  # a block of padding only
    return keys, values, valid


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_decode_within_half_a_step_and_digests_stay_exact(kind, dtype):
    gen = torch.Generator().manual_seed(0)
    exact = HostTier(2, 3, 6, 16, dtype, 16, pin=False, keep_digest=True, keep_maw=False)
    tier = HostTier(2, 3, 6, 16, dtype, 16, pin=False, keep_digest=True, keep_maw=False, quant=kind)
    written = []
    for _ in range(3):
        keys, values, valid = _blocks(gen, dtype=dtype)
        exact.append(keys, values, valid)
        tier.append(keys, values, valid)
        written.append((keys, values, valid))
    assert tier.keys.dtype == reference.QUANT_DTYPES[kind] and tier.dtype == dtype
    assert tier.key_scale.shape == (2, 3, tier.capacity // 16)
    for got, want in zip(tier.digest(), exact.digest()):
        assert torch.equal(got, want)  # taken before quantizing
    keys, values, valid = (torch.cat(parts, dim=d) for parts, d in zip(zip(*written), (2, 2, 1)))
    dec_keys, dec_values, dec_valid = tier.live()
    assert dec_keys.dtype == dtype and torch.equal(dec_valid, valid)
    for decoded, original in ((dec_keys, keys), (dec_values, values)):
        blocks = original.float().masked_fill(~valid[:, None, :, None], 0).unflatten(2, (-1, 16))
        peak = blocks.abs().amax(dim=(3, 4), keepdim=True)
        err = (decoded.float().unflatten(2, (-1, 16)) - blocks).abs()
        rounding = 2**-8 if dtype == torch.bfloat16 else 1e-6  # decoded rows round to the model's dtype
        bound = peak * (RELATIVE_ERROR[kind] + rounding) + 1e-6
        live = valid[:, None, :, None].unflatten(2, (-1, 16)).expand_as(err)
        assert (err[live] <= bound.expand_as(err)[live]).all()
        assert (decoded.masked_select(~valid[:, None, :, None]) == 0).all()  # padding stores 0
    pieces = list(tier.pieces("cpu", 40))
    assert [p[0].shape[2] for p in pieces] == [40, 40, 40, 40, 32]
    assert torch.equal(torch.cat([p[1] for p in pieces], dim=2), dec_values)
    assert tier.nbytes() < exact.nbytes() * (0.6 if dtype == torch.bfloat16 else 0.35)


def test_the_tier_keeps_its_scales_when_it_grows():
    gen = torch.Generator().manual_seed(1)
    tier = HostTier(1, 2, 2, 8, torch.float32, 16, pin=False, keep_digest=False, keep_maw=False, quant="int8")
    keys, values, valid = _blocks(gen, batch=1, heads=2, rows=1024, dim=8)
    tier.append(keys, values, valid)
    before = tier.live()
    capacity = tier.capacity
    tier.append(*_blocks(gen, batch=1, heads=2, rows=512, dim=8))
    assert tier.capacity > capacity
    after = tier.live()
    for old, new in zip(before, after):
        assert torch.equal(new[..., :1024, :] if old.dim() == 4 else new[:, :1024], old)


def _layer(policy, kind, **extra):
    cfg = TandemConfig(
        policy=policy, sink_tokens=5, window_tokens=13, block_size=4, prefill_chunk=16, device="cpu",
        host=HostConfig(dtype=kind), **extra,
    )  # fmt: skip
    return LayerKV(cfg, 0, 8, 2, 32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_full_attention_over_a_quantized_tier_is_dense_over_its_decoded_rows(device, kind):
    """Every decode step equals exact attention over what the tiers hold (the host rows as decoded), and stays
    within the format's error of attention over the rows as written."""
    gen = torch.Generator().manual_seed(2)
    total, prompt = 110, 70
    q = torch.randn(2, 8, total, 32, generator=gen)
    k = torch.randn(2, 2, total, 32, generator=gen)
    v = torch.randn(2, 2, total, 32, generator=gen)
    valid = torch.ones(2, total, dtype=torch.bool)
    valid[1, :9] = False
    scale = 32**-0.5
    exact, quantized = _layer("full", None), _layer("full", kind)
    pool = TaskPool(2)
    worst = 0.0
    for start, end in [(0, prompt)] + [(t, t + 1) for t in range(prompt, total)]:
        args = [x[:, :, start:end].to(device) for x in (q, k, v)] + [
            valid[:, start:end].to(device),
            scale,
            pool,
        ]
        want = attend(exact, *args).cpu()
        got = attend(quantized, *args).cpu()
        if end - start == 1:
            decoded = layer_full_attention(quantized, q[:, :, start].to(device), scale).float()
            rows = valid[:, start]
            assert_close(got[rows, :, 0], decoded[rows], torch.float32)
            worst = max(worst, (got - want)[rows].abs().max().item())
    assert quantized.host.rows > prompt - 13 - 5 and quantized.host.keys.dtype == reference.QUANT_DTYPES[kind]
    assert 0 < worst < (0.02 if kind == "int8" else 0.15)  # quantized, and close


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quest_and_hgca_attend_the_quantized_tier(kind):
    """quest at full budget attends what full attends (the selection is the digests', which stay exact); hgca
    and quest at 25% run on the codes through the compiled calls and attend part of the tier."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 200, 32, generator=gen) for h in (8, 2, 2))
    valid = torch.ones(1, 200, dtype=torch.bool)
    scale = 32**-0.5
    layers = {
        "full": _layer("full", kind),
        "quest": _layer("quest", kind, quest=QuestConfig(budget=1.0)),
        "quest25": _layer("quest", kind, quest=QuestConfig(budget=0.25)),
        "hgca": _layer("hgca", kind),
    }
    pool = TaskPool(1)
    for start, end in [(0, 150)] + [(t, t + 1) for t in range(150, 200)]:
        outs = {
            name: attend(
                layer,
                q[:, :, start:end],
                k[:, :, start:end],
                v[:, :, start:end],
                valid[:, start:end],
                scale,
                pool,
            )  # fmt: skip
            for name, layer in layers.items()
        }
        assert_close(outs["quest"], outs["full"], torch.float32)
        assert all(torch.isfinite(out).all() for out in outs.values())
    for name in ("quest25", "hgca"):
        layer = layers[name]
        assert 0 < layer.rows_attended < layer.rows_available


def _tiny():
    model = tiny_model("Llama")
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("policy,extra", [("full", {}), ("quest", {"quest": {"budget": 0.5}}), ("hgca", {})])
def test_engine_decodes_a_quantized_tier_as_generate_does(policy, extra):
    model = _tiny()
    ids = torch.randint(0, 128, (2, 75), generator=torch.Generator().manual_seed(4))
    config = TandemConfig(
        policy=policy, sink_tokens=4, window_tokens=12, block_size=4, host=HostConfig(dtype="int8"), **extra
    )
    generated = model.generate(  # the mask given: generate() would take the prompt's 0 tokens for padding
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=0,
        **generate_cache_kwargs(model, TandemCache.for_model(model, config)),
    )[:, ids.shape[1] :]  # fmt: skip
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    first = runner.prefill(ids, max_new_tokens=20).argmax(-1)
    tokens, _ = runner.decode(first, 19)
    assert torch.equal(torch.cat([first[:, None], tokens], dim=1), generated)
    assert runner.layers[0].host.keys.dtype == torch.int8


def test_host_dtype_is_validated_and_settable_from_the_command_line():
    assert TandemConfig(policy="quest", host=HostConfig(dtype="fp8")).host.dtype == "fp8"
    with pytest.raises(ValueError, match=r"host.dtype='int4'.*None \(the model's dtype\), 'int8' or 'fp8'"):
        TandemConfig(host=HostConfig(dtype="int4"))
    # the default policy certifies the exact keys: an 8-bit tier is refused with the policy that takes one
    with pytest.raises(ValueError, match=r"host.dtype='int8'.*policy='certified'.*policy='quest'"):
        TandemConfig(host=HostConfig(dtype="int8"))
    cfg = TandemConfig(policy="quest")
    with pytest.raises(ValueError, match=r"host\.dtype"):
        cfg.host = {"dtype": torch.int8}
    assert cfg.host.dtype is None
    assert parse_setting("host.dtype", "none") is None and parse_setting("host.dtype", "int8") == "int8"
    with pytest.raises(ValueError, match=r"'host_dtype' moved to host\.dtype"):  # the flat spelling of before
        TandemConfig(policy="quest", host_dtype="int8")
    with pytest.raises(ValueError, match="quant"):
        HostTier(1, 1, 1, 8, torch.float32, 16, pin=False, keep_digest=False, keep_maw=False, quant="int4")
