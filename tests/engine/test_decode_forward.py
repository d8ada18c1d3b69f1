"""Tandem's own decode forward (tandem.engine.forward) against transformers' layer code: logits per step on tiny
models of each architecture of the family, greedy tokens through the engine against DynamicCache, the weights
shared with the model, and the fallback for models outside the family."""

import pytest
import torch
from transformers import DynamicCache

from tandem import TandemCache, TandemConfig, generate_cache_kwargs
from tandem.config import QuestConfig
from tandem.engine import TandemRunner
from tandem.engine.forward import DecodeForward, unsupported_reason
from tandem.kernels import gpu as gpu_kernels
from tests.tiny import tiny_model
from tests.tolerances import assert_close

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
    ),
]
FAMILY = [
    ("Llama", {}),
    ("Llama", {"attention_bias": True, "mlp_bias": True}),
    ("Qwen2", {}),  # q / k / v bias
    ("Mistral", {"sliding_window": None}),
    ("Llama", {"num_key_value_heads": 4}),
    ("Llama", {"num_key_value_heads": 1, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
]  # fmt: skip


def _model(arch, overrides, device="cpu", dtype=torch.float32):
    model = tiny_model(arch, **overrides).to(device, dtype)
    model.generation_config.eos_token_id = None
    return model


def _prompt(device, batch=2, tokens=45):
    return torch.randint(0, 128, (batch, tokens), generator=torch.Generator().manual_seed(1)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,overrides", FAMILY)
def test_logits_match_transformers_step_by_step(device, dtype, arch, overrides):
    """Two caches filled by the same prefill; one decodes through the model's forward, one through
    DecodeForward, each fed the same tokens: the logits agree at every step within the dtype's tolerance."""
    model = _model(arch, overrides, device, dtype)
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=12, block_size=4)
    ids = _prompt(device)
    caches = [TandemCache.for_model(model, config) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(ids, use_cache=True, logits_to_keep=1, **generate_cache_kwargs(model, cache))
        forward = DecodeForward(model, caches[1])
        token = torch.randint(0, 128, (2, 1), generator=torch.Generator().manual_seed(2)).to(device)
        position = torch.full((2, 1), ids.shape[1], device=device)
        for _ in range(20):  # past the window: blocks move to the host tier on the way
            expected = model(
                token,
                position_ids=position,
                use_cache=True,
                logits_to_keep=1,
                **generate_cache_kwargs(model, caches[0]),
            ).logits[:, -1]
            actual = forward(token, position)
            assert actual.dtype == expected.dtype == dtype
            assert_close(actual.float(), expected.float(), dtype)
            token = expected.argmax(-1, keepdim=True)
            position = position + 1
    assert caches[1].tandem_layers()[0].host.rows > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch,overrides", FAMILY[:4])
def test_engine_greedy_tokens_equal_dynamic_cache(device, arch, overrides):
    model = _model(arch, overrides, device)
    ids = _prompt(device)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # ragged batch: the second request is left-padded
    base = model.generate(
        ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
        **generate_cache_kwargs(model, DynamicCache()),
    )[:, ids.shape[1]:].cpu()  # fmt: skip
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=12, block_size=4)
    runner = TandemRunner(model, TandemCache.for_model(model, config), forward="own")
    assert runner.forward == "own"
    first = runner.prefill(ids, mask, chunk_tokens=16, max_new_tokens=30).argmax(-1)
    tokens, _ = runner.decode(first, 29)
    assert torch.equal(torch.cat([first.cpu()[:, None], tokens], dim=1), base)


@pytest.mark.skipif(not gpu_kernels.triton_available("cpu"), reason="no Triton interpreter")
def test_fused_kernels_give_the_reference_tokens_on_cpu():
    """With fused=True on CPU the forward runs the Triton kernels under the interpreter; the greedy tokens equal
    those of the torch references (fp32)."""
    ids = _prompt("cpu")
    runs = []
    for fused in (False, True):
        model = _model("Qwen2", {})
        runner = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="full")), fused=fused)
        assert runner.decoder.kernels == ("triton" if fused else "torch")
        first = runner.prefill(ids, max_new_tokens=8).argmax(-1)
        runs.append(runner.decode(first, 8)[0])
    assert torch.equal(*runs)


def test_concatenated_weights_are_shared_with_the_model():
    model = _model("Qwen2", {})
    ids = _prompt("cpu")
    with torch.no_grad():
        before = model(ids).logits
        attn = model.model.layers[0].self_attn
        original = [p.clone() for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.bias)]
        params_before = sum(p.numel() for p in model.parameters())
        forward = DecodeForward(model, TandemCache.for_model(model, TandemConfig(policy="full")))
        layer = forward.layers[0]
        # the model's q / k / v are views into the one concatenated weight: nothing is held twice
        assert attn.q_proj.weight.data_ptr() == layer.qkv_weight.data_ptr()
        assert (
            attn.k_proj.weight.untyped_storage().data_ptr() == layer.qkv_weight.untyped_storage().data_ptr()
        )
        assert torch.equal(attn.q_proj.weight, original[0]) and torch.equal(attn.k_proj.weight, original[1])
        assert torch.equal(attn.v_proj.bias, original[2])
        assert sum(p.numel() for p in model.parameters()) == params_before
        assert torch.equal(model(ids).logits, before)  # the model's own forward computes what it did


def test_models_outside_the_family_fall_back_with_the_reason(capsys):
    gelu = _model("Llama", {"hidden_act": "gelu"})
    assert "hidden_act 'gelu'" in unsupported_reason(gelu)
    with pytest.raises(ValueError, match="hidden_act 'gelu'.*forward='hf'"):
        TandemRunner(gelu, TandemCache.for_model(gelu, TandemConfig(policy="full")), forward="own")
    capsys.readouterr()
    runner = TandemRunner(gelu, TandemCache.for_model(gelu, TandemConfig(policy="full")))
    assert runner.forward == "hf" and runner.decoder is None
    notice = capsys.readouterr().err.strip().splitlines()
    assert len(notice) == 1 and "transformers' layer code" in notice[0] and "gelu" in notice[0]
    # the HF path still decodes such a model
    first = runner.prefill(_prompt("cpu"), max_new_tokens=4).argmax(-1)
    assert runner.decode(first, 4)[0].shape == (2, 4)
    assert "sliding" in unsupported_reason(_model("Mistral", {"sliding_window": 16}))
    other = tiny_model("Gemma")
    assert "model type 'gemma'" in unsupported_reason(other)
    with pytest.raises(ValueError, match="forward must be one of auto, own, hf"):
        TandemRunner(other, TandemCache.for_model(other, TandemConfig(policy="full")), forward="fast")


def test_forced_hf_forward_keeps_transformers_code():
    model = _model("Llama", {})
    runner = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="full")), forward="hf")
    assert runner.forward == "hf" and runner.decoder is None
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()  # not concatenated


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("shape", ["llama-3.1-8b", "qwen2.5-7b"])
def test_logits_match_transformers_at_real_layer_shapes_on_cuda(shape):
    """Two layers of a real 8B / 7B shape with random weights, through the engine's fused kernels, teacher-forced
    over the same tokens as transformers' code:
    - float32: the logits agree within float32's tolerance (relative to their scale);
    - bfloat16: the concatenated matmuls round differently from the separate ones, so the check is against the
      float32 logits: Tandem's bfloat16 forward is as close to them as transformers' bfloat16 code is."""
    from tandem.shapes import build_random_model

    model = build_random_model(shape, "cuda", torch.float32, num_layers=2)
    vocab = model.config.vocab_size
    tandem_config = TandemConfig(
        policy="quest", quest=QuestConfig(budget=0.25), sink_tokens=16, window_tokens=64
    )
    ids = torch.randint(0, vocab, (2, 700), generator=torch.Generator().manual_seed(1)).cuda()
    tokens = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(2)).cuda()

    def run(dtype, own):
        model.to(dtype)
        cache = TandemCache.for_model(model, tandem_config)
        logits = []
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1, **generate_cache_kwargs(model, cache))
            forward = DecodeForward(model, cache, kernels="triton") if own else None
            for t in range(tokens.shape[1]):
                token, position = tokens[:, t : t + 1], torch.full((2, 1), ids.shape[1] + t, device="cuda")
                if own:
                    out = forward(token, position)
                else:
                    out = model(
                        token, position_ids=position, use_cache=True, logits_to_keep=1,
                        **generate_cache_kwargs(model, cache),
                    ).logits[:, -1]  # fmt: skip
                logits.append(out.float())
        return torch.stack(logits)

    hf32, own32 = run(torch.float32, False), run(torch.float32, True)
    scale = float(hf32.abs().amax())
    torch.testing.assert_close(own32, hf32, atol=1e-4 * scale, rtol=1e-4)
    hf16, own16 = run(torch.bfloat16, False), run(torch.bfloat16, True)
    hf_error, own_error = (hf16 - hf32).abs(), (own16 - hf32).abs()
    assert float(own_error.amax()) <= 1.5 * float(hf_error.amax())
    assert float(own_error.mean()) <= 1.2 * float(hf_error.mean())


def test_a_runner_refuses_weights_replaced_after_it_was_made():
    model = _model("Llama", {})
    runner = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="full")))
    first = runner.prefill(_prompt("cpu"), max_new_tokens=4).argmax(-1)
    model.to(torch.float64).to(torch.float32)  # new parameter tensors: the concatenated copies are stale
    with pytest.raises(RuntimeError, match="weights were moved or replaced .* make a new TandemRunner"):
        runner.decode(first, 2)


def test_two_runners_of_one_model_share_the_concatenated_weights():
    model = _model("Qwen2", {})
    runners = [
        TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="full"))) for _ in range(2)
    ]
    assert runners[0].decoder.layers[0].qkv_weight is runners[1].decoder.layers[0].qkv_weight
    assert runners[0].decoder.layers[1].gate_up_bias is runners[1].decoder.layers[1].gate_up_bias
    for runner in runners:  # both decode (neither sees its weights as replaced)
        first = runner.prefill(_prompt("cpu"), max_new_tokens=3).argmax(-1)
        assert runner.decode(first, 3)[0].shape == (2, 3)
