"""The certified selection (quest's, and fluxion's on top of its own) through the engine: the certificate is device work only, so a decode step with
it records as a CUDA graph, and the recorded steps select and certify as eager ones do (greedy tokens and the
certificate statistics equal). On CPU the same steps run eagerly."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tandem import TandemCache, TandemConfig
from tandem.config import CertifiedConfig, FluxionConfig
from tandem.engine import TandemRunner
from tests.tiny import tiny_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _config(policy: str, tmp_path) -> TandemConfig:
    if policy == "quest":
        return TandemConfig(
            policy="quest",
            sink_tokens=4,
            window_tokens=16,
            block_size=4,
            certified=CertifiedConfig(epsilon=0.01),
        )
    from tests.policies.test_fluxion_policy import SINKS, WINDOW, make_profile

    profile = make_profile(tmp_path / "profile.pt", predictor=False, q_heads=8, kv_heads=2, head_dim=8)
    return TandemConfig(policy="fluxion", fluxion=FluxionConfig(tau=0.1, profile=profile, mode="static"), sink_tokens=SINKS, window_tokens=WINDOW, certified=CertifiedConfig(epsilon=0.01))  # fmt: skip


def _decode(device: str, use_graphs: bool, config: TandemConfig):
    model = tiny_model("Llama", num_attention_heads=8, num_key_value_heads=2).to(device)
    cache = TandemCache.for_model(model, config)
    runner = TandemRunner(model, cache, use_graphs=use_graphs)
    ids = torch.randint(0, 128, (2, 180), generator=torch.Generator().manual_seed(0)).to(device)
    first = runner.prefill(ids, max_new_tokens=40).argmax(-1)
    tokens, _ = runner.decode(first, 24)
    return tokens, cache.stats()["certified"]


@pytest.mark.parametrize("policy", ["quest", "fluxion"])
@pytest.mark.parametrize("device", DEVICES)
def test_certified_steps_report_a_certificate_every_step(device, policy, tmp_path):
    tokens, stats = _decode(device, False, _config(policy, tmp_path))
    assert tokens.shape == (2, 24)
    assert stats["head_steps"] == 2 * 8 * 2 * 24  # batch x query heads x layers x steps
    assert 0.0 <= stats["mean_p"] <= stats["max_p"] <= 1.0 and stats["mean_output_bound"] >= 0.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("policy", ["quest", "fluxion"])
def test_recorded_certified_steps_select_and_certify_as_eager_ones(policy, tmp_path):
    eager_tokens, eager = _decode("cuda", False, _config(policy, tmp_path))
    graph_tokens, graphs = _decode("cuda", True, _config(policy, tmp_path))
    assert torch.equal(eager_tokens, graph_tokens)
    assert graphs["head_steps"] == eager["head_steps"]
    for key in ("mean_p", "max_p", "mean_output_bound", "met_share", "mean_kept"):
        assert graphs[key] == pytest.approx(eager[key], rel=1e-4, abs=1e-6), key


_DEEP_DEFAULT = """
import torch
from transformers import LlamaConfig
from tandem import TandemCache, TandemConfig
from tandem.engine import TandemRunner
from tandem.shapes import build_random_model

config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=48, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=4096)
model = build_random_model(config, "cuda", torch.bfloat16)
model.generation_config.eos_token_id = None
ids = torch.randint(0, 1024, (1, 1500), generator=torch.Generator().manual_seed(0))
tokens = []
for graphs in (False, True):
    runner = TandemRunner(model, TandemCache.for_model(model, TandemConfig()), use_graphs=graphs)
    first = runner.prefill(ids, max_new_tokens=40).argmax(-1)
    tokens.append(runner.decode(first, 40)[0])
assert torch.equal(tokens[0], tokens[1]), tokens
print("ok")
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_the_default_decodes_a_deep_model_through_one_graph_per_step():
    """The default (certified) selection records many kernels per layer, so a deep model's step graph is longer than
    the driver's launch queue and its launch returns only once the GPU has passed hand-offs. The serving thread
    must then make no CUDA call until it has served them (`DecodeStep.prepare` waits for the host copies first):
    a wait there hung the step. In a subprocess with a time limit, so that a hang fails the test."""
    done = subprocess.run(
        [sys.executable, "-c", _DEEP_DEFAULT], capture_output=True, text=True, timeout=400, check=False
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


def test_the_default_on_a_cpu_attends_every_host_row_and_equals_dynamic_cache():
    """policy "certified" with the hot tier on the CPU attends every host row (the selection costs more there
    than what it leaves out): greedy tokens equal DynamicCache's, every head meets epsilon with p = 0, and quest
    with the same epsilon still selects."""
    from transformers import DynamicCache

    from tandem import generate_cache_kwargs

    model = tiny_model("Llama", num_attention_heads=8, num_key_value_heads=2)
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 128, (2, 180), generator=torch.Generator().manual_seed(1))
    small = dict(sink_tokens=4, window_tokens=16, block_size=4)

    def generate(cache):
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0,
            **generate_cache_kwargs(model, cache),
        )  # fmt: skip
        return out[:, ids.shape[1] :]

    default = TandemCache.for_model(model, TandemConfig(**small))
    assert torch.equal(generate(default), generate(DynamicCache()))
    stats = default.stats()
    assert stats["mean_fraction_attended"] == 1.0
    cert = stats["certified"]
    assert cert["head_steps"] == 2 * 8 * 2 * 11  # batch x query heads x layers x decode steps
    assert cert["met_share"] == 1.0 and cert["max_p"] == 0.0 and cert["mean_kept"] == 1.0
    quest = TandemCache.for_model(
        model, TandemConfig(policy="quest", certified=CertifiedConfig(epsilon=0.05), **small)
    )
    generate(quest)
    assert quest.stats()["mean_fraction_attended"] < 1.0
    assert quest.stats()["certified"]["mean_kept"] < 1.0
