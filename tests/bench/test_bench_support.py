"""Support modules of `tandem bench`: shapes and random models, HF baselines, bandwidth probes, report."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from tandem import generate_cache_kwargs, shapes
from tandem.tools.bench import bandwidth, baselines, report

CONTEXT, STEPS, WARMUP = 61, 4, 1  # not a multiple of any block size


def _tiny(**overrides):
    config = shapes.shape_config("tiny-llama")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


# ---- shapes -----------------------------------------------------------------------------------------------------
def test_param_count_from_config_matches_published_sizes():
    assert shapes.param_count(shapes.shape_config("llama-3.1-8b")) == pytest.approx(8.03e9, rel=2e-3)
    assert shapes.param_count(shapes.shape_config("mistral-7b")) == pytest.approx(7.25e9, rel=2e-3)
    assert shapes.param_count(shapes.shape_config("qwen2.5-7b")) == pytest.approx(7.62e9, rel=2e-3)
    config = shapes.shape_config("llama-3.1-8b", num_layers=2)
    assert config.num_hidden_layers == 2
    assert shapes.param_bytes(config, torch.bfloat16) == 2 * shapes.param_count(config)
    # an untied input table is not read by a decode step
    table = 128256 * 4096 * 2
    assert (
        shapes.weight_bytes_per_step(config, torch.bfloat16)
        == shapes.param_bytes(config, torch.bfloat16) - table
    )


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_param_count_equals_built_model(model_type):
    base = {"llama": "tiny-llama", "qwen2": "qwen2.5-7b", "mistral": "mistral-7b"}[model_type]
    config = shapes.shape_config(base, num_layers=2)
    for key, value in dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
    ).items():
        setattr(config, key, value)
    model = shapes.build_random_model(config, "cpu", torch.float32)
    assert shapes.param_count(config) == sum(p.numel() for p in model.parameters())
    if model_type == "qwen2":
        assert model.model.layers[0].self_attn.k_proj.bias is not None


def test_prefill_flops_count_the_projections_and_causal_attention():
    config = shapes.shape_config("llama-3.1-8b")
    flops = shapes.prefill_flops(config, 0, 32768)
    embeddings = 2 * 128256 * 4096  # input table and LM head, untied
    per_token = shapes.param_count(config) - embeddings - 4096 * (2 * 32 + 1)  # less the norms
    assert flops["linear"] == 2 * (32768 * per_token + 128256 * 4096)
    assert flops["attention"] == 4 * 32 * 4096 * (32768 * 32769 // 2)
    assert flops["total"] == flops["linear"] + flops["attention"]
    # a second chunk counts its queries over every key before them; chunks add up to the whole
    halves = [shapes.prefill_flops(config, a, b)["attention"] for a, b in ((0, 16384), (16384, 32768))]
    assert sum(halves) == flops["attention"]
    config.sliding_window = 1000
    assert shapes.prefill_flops(config, 0, 3000)["attention"] == 4 * 32 * 4096 * (
        1000 * 1001 // 2 + 2000 * 1000
    )
    assert shapes.prefill_flops(config, 2000, 3000)["attention"] == 4 * 32 * 4096 * 1000 * 1000


def test_unknown_shape_lists_known_names():
    with pytest.raises(ValueError, match="llama-3.1-8b.*tiny-llama"):
        shapes.shape_config("llama-9")
    with pytest.raises(ValueError, match="num_layers"):
        shapes.shape_config("tiny-llama", num_layers=0)


@pytest.mark.parametrize(
    "rope",
    [None, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}],
    ids=["default-rope", "llama3-rope"],
)  # fmt: skip
def test_random_model_matches_an_ordinarily_built_one(rope):
    config = _tiny() if rope is None else _tiny(rope_parameters=rope)
    model = shapes.build_random_model(config, "cpu", torch.float32, seed=3)
    ordinary = AutoModelForCausalLM.from_config(config).eval()
    ordinary.load_state_dict(model.state_dict())  # weights only: inv_freq is not in the state dict
    for name, buffer in ordinary.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buffer, rtol=0, atol=0)
    ids = torch.randint(0, config.vocab_size, (2, 27))
    positions = torch.arange(100_000, 100_027).expand(2, -1)  # far positions: where wrong rotary shows most
    with torch.no_grad():
        logits = model(ids, position_ids=positions).logits
        expected = ordinary(ids, position_ids=positions).logits
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_random_model_is_seeded_and_ties_embeddings():
    a = shapes.build_random_model("tiny-llama", "cpu", torch.float32, seed=0)
    b = shapes.build_random_model("tiny-llama", "cpu", torch.float32, seed=0)
    c = shapes.build_random_model("tiny-llama", "cpu", torch.float32, seed=1)
    weight = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(a.get_parameter(weight), b.get_parameter(weight))
    assert not torch.equal(a.get_parameter(weight), c.get_parameter(weight))
    assert not a.training and a.get_parameter("model.norm.weight").eq(1).all()
    tied = shapes.build_random_model(_tiny(tie_word_embeddings=True), "cpu", torch.bfloat16)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.lm_head.weight.dtype == torch.bfloat16
    assert tied.model.rotary_emb.inv_freq.dtype == torch.float32


# ---- baselines --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    return shapes.build_random_model("tiny-llama", "cpu", torch.float32)


def _plain_greedy(model, batch, seed=0):
    """Reference: default HF forward (positions from the cache length) over the same synthetic cache."""
    cache = DynamicCache(config=model.config)
    baselines.fill_synthetic(cache, model.config, batch, CONTEXT, "cpu", torch.float32, seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(seed))
    out = []
    with torch.no_grad():
        for _ in range(WARMUP + STEPS):
            logits = model(input_ids=ids, **generate_cache_kwargs(model, cache)).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
            out.append(ids)
    return torch.cat(out, dim=1).tolist()


def test_hf_baselines_on_cpu(tiny_model):
    rows = {
        kind: baselines.run_hf_baseline(tiny_model, kind, 3, CONTEXT, STEPS, WARMUP)
        for kind in baselines.KINDS
    }
    for kind, row in rows.items():
        assert row["system"] == f"hf-{kind}" and row["status"] == "ok", row["error"]
        assert len(row["tpot_ms"]) == STEPS and row["tpot_median_ms"] > 0
        assert row["tokens_per_s"] == pytest.approx(3 / (row["tpot_median_ms"] / 1e3))
        assert row["gpu_peak_bytes"] is None and row["gpu_kv_bytes"] == 0
        kv_bytes = (
            2 * 2 * 3 * 2 * (CONTEXT + WARMUP + STEPS) * 16 * 4
        )  # K+V, layers, batch, heads, tokens, dim
        assert row["host_kv_bytes"] == kv_bytes
    assert rows["offloaded"]["note"]  # on CPU it runs as DynamicCache, and says so
    assert rows["dynamic"]["tokens"] == rows["offloaded"]["tokens"] == _plain_greedy(tiny_model, 3)


def test_hf_baseline_after_a_tandem_row_runs_on_the_models_own_attention(tiny_model, monkeypatch):
    """A Tandem row switches the model to Tandem's attention; the next HF row must not time Tandem's exact
    fallback (a masked SDPA) instead of the model's own kernels."""
    from tandem import TandemCache, TandemConfig

    original = tiny_model.config._attn_implementation
    TandemCache.for_model(tiny_model, TandemConfig(policy="full"))
    assert tiny_model.config._attn_implementation == "tandem"
    seen = []
    real_decode = baselines.decode

    def spy(model, *args, **kwargs):
        seen.append(model.config._attn_implementation)
        return real_decode(model, *args, **kwargs)

    monkeypatch.setattr(baselines, "decode", spy)
    row = baselines.run_hf_baseline(tiny_model, "dynamic", 1, CONTEXT, STEPS, WARMUP)
    assert row["status"] == "ok" and seen == [original]
    assert row["tokens"] == _plain_greedy(tiny_model, 1)


def test_fill_synthetic_shapes(tiny_model):
    cache = baselines.make_hf_cache("dynamic", tiny_model)
    baselines.fill_synthetic(cache, tiny_model.config, 2, CONTEXT, "cpu", torch.bfloat16, seed=5)
    assert cache.get_seq_length() == CONTEXT
    keys = cache.layers[1].keys
    assert keys.shape == (2, 2, CONTEXT, 16) and keys.dtype == torch.bfloat16
    assert 0.05 < keys.float().std() < 0.2
    with pytest.raises(ValueError, match="unknown HF cache kind"):
        baselines.make_hf_cache("static", tiny_model)


@pytest.mark.parametrize(
    "err, status",
    [
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
        (MemoryError(), "oom"),
        (
            RuntimeError(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB (out of memory)"
            ),
            "oom",
        ),
        (RuntimeError("shapes do not match"), "error"),
    ],
)
def test_failures_become_rows(tiny_model, monkeypatch, err, status):
    def fail(*args, **kwargs):
        raise err

    monkeypatch.setattr(baselines, "decode", fail)
    row = baselines.run_hf_baseline(tiny_model, "dynamic", 8, CONTEXT, STEPS, WARMUP)
    assert row["status"] == status and row["tpot_median_ms"] is None
    assert row["error"].startswith(type(err).__name__)


def test_summarize():
    assert baselines.summarize([0.005, 0.001, 0.003, 0.002, 0.004]) == pytest.approx((3.0, 4.6, 4.96, 5.0))
    assert baselines.summarize([]) == (None, None, None, None)
    # one stalled step in 100: the median and p90 hide it, p99 and max show it
    times = [0.010] * 99 + [0.030]
    assert baselines.summarize(times) == pytest.approx((10.0, 10.0, 10.2, 30.0))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("32768K", 32 << 20), ("300M", 300 << 20), ("1G\n", 1 << 30), ("512", 512), ("x", None)],
)
def test_parse_cache_size(text, expected):
    assert bandwidth.parse_cache_size(text) == expected


def test_host_read_bandwidth_small_buffer():
    assert bandwidth.host_read_bandwidth(threads=1, nbytes=16 << 20, reps=2) > 0
    info = bandwidth.machine_info(threads=1)
    assert {"cpu_model", "cores", "gpu", "transformers", "llc_mb"} <= info.keys() and info["llc_mb"] > 0
    assert bandwidth.machine_slug(info).endswith(f"-{info['cores']}c")


# ---- report -----------------------------------------------------------------------------------------------------
def _row(system, batch, context, tpot=None, status="ok", **extra):
    row = baselines.empty_row(system, batch, context, STEPS, WARMUP)
    row.update(status=status, **extra)
    if tpot is not None:
        row.update(
            tpot_ms=[tpot] * STEPS,
            tpot_median_ms=tpot,
            tpot_p90_ms=tpot * 1.1,
            tokens_per_s=batch / tpot * 1e3,
        )
        row.update(gpu_peak_bytes=int(20e9), host_kv_bytes=int(16e9) if system != "hf-dynamic" else 0)
    return row


def _result():
    tandem = dict(cpu_bytes_per_step=8e8, attended_fraction=0.05, bound_ms=10.0, tpot_over_bound=2.0)
    rows = [
        _row("hf-dynamic", 1, 32768, 20.0),
        _row("hf-offloaded", 1, 32768, 80.0),
        _row("tandem-quest", 1, 32768, 10.0, **tandem),
        _row("hf-dynamic", 1, 131072, 40.0),
        _row("hf-offloaded", 1, 131072, 300.0),
        _row("tandem-quest", 1, 131072, 20.0, **tandem),
        _row("hf-dynamic", 8, 131072, status="oom", error="OutOfMemoryError: CUDA out of memory"),
        _row("hf-offloaded", 8, 131072, 2000.0),
        _row("tandem-quest", 8, 131072, 100.0, **tandem),
    ]
    machine = {
        "hostname": "h",
        "cpu_model": "Xeon",
        "cores": 16,
        "threads": 15,
        "gpu": "NVIDIA H100 80GB HBM3",
    }
    return {
        "machine": machine,
        "bandwidth": {"hbm_gbps": 3000.0, "host_read_gbps": 160.0, "pcie_h2d_gbps": None},
        "model": {"name": "llama-3.1-8b", "layers": 32, "dtype": "bfloat16"},
        "rows": rows,
    }


def test_report_files(tmp_path):
    result = _result()
    paths = report.write_report(result, tmp_path)
    assert (tmp_path / "bench.json").is_file() and (tmp_path / "bench.md").is_file()
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][6]["status"] == "oom"
    md = (tmp_path / "bench.md").read_text()
    assert "NVIDIA H100" in md and "3000.0 GB/s" in md and "PCIe H2D (pinned) not measured" in md
    lines = [line for line in md.splitlines() if line.startswith("| hf-dynamic | 8 | 128K")]
    assert lines and "OOM" in lines[0]  # the configuration that did not fit stays in the table
    quest_8 = next(line for line in md.splitlines() if line.startswith("| tandem-quest | 8 |"))
    assert quest_8.rstrip(" |").endswith("OOM | 0.05x")  # vs dynamic: OOM; vs offloaded: 100 / 2000
    quest_1 = next(line for line in md.splitlines() if line.startswith("| tandem-quest | 1 | 32K"))
    assert (
        "| 0.50x | 0.12x |" in quest_1 and "| 20.0 | 16.0 | 800.0 |  |  | 5.0% | 10.00 | 2.00x |" in quest_1
    )
    table = report.format_table(result["rows"])
    assert len(table.splitlines()) == len(result["rows"]) + 2
    assert len({line.count("|") for line in table.splitlines()}) == 1  # every row as many cells as the header
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert {p.name for p in paths} >= {"tpot_vs_context.png", "throughput_vs_batch.png"}
    assert all(p.stat().st_size > 0 for p in paths)


# ---- CUDA (skipped without) -------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_baselines_and_probes():
    model = shapes.build_random_model("llama-3.1-8b", "cuda", torch.bfloat16, num_layers=2)
    rows = {kind: baselines.run_hf_baseline(model, kind, 2, 4093, STEPS, WARMUP) for kind in baselines.KINDS}
    for row in rows.values():
        assert row["status"] == "ok", row["error"]
        assert row["gpu_peak_bytes"] > shapes.param_bytes(model.config, torch.bfloat16)
    assert rows["dynamic"]["host_kv_bytes"] == 0 and rows["offloaded"]["host_kv_bytes"] > 0
    assert rows["offloaded"]["note"] is None
    assert rows["dynamic"]["tokens"] == rows["offloaded"]["tokens"]
    assert bandwidth.hbm_bandwidth("cuda", nbytes=256 << 20, reps=3) > 0
    assert bandwidth.pcie_h2d_bandwidth("cuda", nbytes=64 << 20, reps=3) > 0
    assert bandwidth.matmul_rate("cuda", size=1024, reps=3) > 0
