"""Tensor-parallel decode: the sharding rules, and ranks over gloo (CPU) or NCCL (2 GPUs) against one device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tandem import shapes
from tandem.distributed import launch
from tandem.distributed.tensor_parallel import Rank, check_shardable, random_shard, shard_config


def _torchrun(*args: str, ranks: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def _reports(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_a_split_that_does_not_divide_names_the_allowed_gpus():
    config = shapes.shape_config("smollm2-135m")  # 9 query heads, 3 KV heads
    with pytest.raises(ValueError, match=r"gpus=2: the model's num_key_value_heads=3 .* allowed gpus: 1, 3"):
        check_shardable(config, 2)
    with pytest.raises(ValueError, match="gpus: expected a positive integer"):
        check_shardable(config, 0)


def test_a_model_outside_the_family_is_refused():
    config = shapes.shape_config("tiny-llama")
    config.model_type = "gpt2"
    with pytest.raises(ValueError, match="supports model types llama, qwen2, mistral"):
        check_shardable(config, 2)


def test_the_shard_config_divides_heads_and_mlp_and_keeps_head_dim():
    config = shapes.shape_config("llama-3.1-70b")
    shard = shard_config(config, 4)
    assert (shard.num_attention_heads, shard.num_key_value_heads) == (16, 2)
    assert shard.intermediate_size == 28672 // 4 and shard.head_dim == 128
    assert shard.hidden_size == config.hidden_size and shard.vocab_size == config.vocab_size
    assert config.num_attention_heads == 64  # the model's own config is left alone


def test_a_shard_holds_its_slices_and_the_whole_embeddings():
    world = 2
    shard = random_shard("tiny-llama", Rank(1, world, torch.device("cpu")), torch.float32)
    whole = shapes.build_random_model("tiny-llama", "cpu", torch.float32)
    layer, full = shard.model.layers[0], whole.model.layers[0]
    assert layer.self_attn.q_proj.weight.shape[0] * world == full.self_attn.q_proj.weight.shape[0]
    assert layer.self_attn.o_proj.weight.shape[1] * world == full.self_attn.o_proj.weight.shape[1]
    assert layer.mlp.down_proj.weight.shape[1] * world == full.mlp.down_proj.weight.shape[1]
    assert shard.lm_head.weight.shape[0] * world == whole.lm_head.weight.shape[0]
    assert shard.model.embed_tokens.weight.shape == whole.model.embed_tokens.weight.shape
    # per GPU: the layers' and the LM head's shares, the norms whole (the input table is a lookup)
    layers = sum(p.numel() for p in whole.model.layers.parameters() if p.dim() == 2) // world
    norms = sum(p.numel() for p in whole.parameters() if p.dim() == 1)
    expected = 4 * (layers + norms + whole.lm_head.weight.numel() // world)
    assert shapes.model_weight_bytes_per_step(shard) == expected
    assert shapes.model_weight_bytes_per_step(whole) == shapes.weight_bytes_per_step(
        whole.config, torch.float32
    )


def test_rank_cores_are_disjoint_shares():
    first = launch.rank_cores(0, 2, torch.device("cpu"))
    second = launch.rank_cores(1, 2, torch.device("cpu"))
    if not first:
        pytest.skip("fewer than 2 usable cores")
    assert not set(first) & set(second) and len(first) == len(second)


def test_two_ranks_on_the_cpu_reproduce_one_device():
    """gloo ranks, biases on every projection: tokens equal, logits within the fp32 tolerance."""
    result = _torchrun(
        "-m", "tandem.distributed.check", "--device", "cpu", "--model", "tiny-llama", "--bias", "--steps", "6"
    )
    reports = _reports(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert [r["policy"] for r in reports] == ["full", "quest"]
    assert all(r["tokens_equal"] and r["logits_close"] and r["ranks"] == 2 for r in reports)
    assert all(r["decode_logits_rel_diff"] is not None for r in reports)


@pytest.mark.parametrize(
    "batch", [pytest.param(3, marks=pytest.mark.slow), 1], ids=["uneven", "a-rank-without-requests"]
)
def test_host_attention_split_by_requests_reproduces_one_device(batch):
    """PnG-KV's DP mapping on gloo ranks: rank 0's host tier holds every head of its requests (2 of 3, or the
    only one), and tokens and logits match one device as with the split by heads."""
    result = _torchrun(
        "-m", "tandem.distributed.check", "--device", "cpu", "--model", "tiny-llama", "--bias", "--steps", "6",
        "--host-splits", "requests", "--batch", str(batch), "--no-graphs", "--policies", "full,quest,streaming",
    )  # fmt: skip
    reports = _reports(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert [r["policy"] for r in reports] == ["full", "quest", "streaming"]
    assert all(r["host_split"] == "requests" for r in reports)
    kv_heads = shapes.shape_config("tiny-llama").num_key_value_heads
    assert all(r["host_tier"] == [(batch + 1) // 2, kv_heads] for r in reports)
    assert all(r["tokens_equal"] and r["logits_close"] for r in reports)


_SPLIT_SCRIPT = """
import sys, torch, torch.distributed as dist
from tandem.cache.split import RequestSplit, request_counts
from tandem.distributed.tensor_parallel import Rank
dist.init_process_group("gloo")
r, n = dist.get_rank(), dist.get_world_size()
rank = Rank(r, n, torch.device("cpu"))
for batch in (5, 2):
    split = RequestSplit(rank, batch)
    assert split.counts == request_counts(batch, n) and sum(split.counts) == batch
    # rank s's heads are 10 * s + h: after the exchange a rank's requests hold every head in rank order
    mine = torch.arange(batch)[:, None, None] * 1000 + 10 * r + torch.arange(2)[None, :, None] + torch.zeros(1, 1, 3)
    theirs = split.to_requests(mine)
    heads = torch.tensor([10 * s + h for s in range(n) for h in range(2)])
    requests = torch.arange(batch)[split.requests]
    assert torch.equal(theirs, requests[:, None, None] * 1000 + heads[None, :, None] + torch.zeros(1, 1, 3))
    assert torch.equal(split.to_heads(theirs), mine)
    assert torch.equal(split.gather(split.own(torch.arange(batch) % 2 == 0)), torch.arange(batch) % 2 == 0)
open(f"{sys.argv[1]}/ok{r}", "w").close()
dist.destroy_process_group()
"""


def test_the_request_split_exchanges_heads_and_requests_on_three_ranks(tmp_path):
    """counts [2, 2, 1] and [1, 1, 0]: to_requests puts every rank's heads of a rank's requests in rank order,
    to_heads undoes it, gather joins the ranges."""
    script = tmp_path / "split.py"
    script.write_text(_SPLIT_SCRIPT)
    result = _torchrun(str(script), str(tmp_path), ranks=3)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert all((tmp_path / f"ok{r}").exists() for r in range(3))


@pytest.mark.slow
def test_bench_gpus_runs_every_row_on_the_ranks(tmp_path):
    out = tmp_path / "bench"
    result = subprocess.run(
        [
            sys.executable, "-m", "tandem.cli", "bench", "--device", "cpu", "--gpus", "2", "--model", "tiny-llama",
            "--contexts", "256", "--steps", "2", "--warmup", "3", "--policies", "quest", "--hf", "hf-dynamic",
            "--out", str(out),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    bench = json.loads((out / "bench.json").read_text())
    assert bench["model"]["gpus"] == 2
    assert [(r["system"], r["status"], r["ranks"]) for r in bench["rows"]] == [
        ("hf-dynamic", "ok", 2),
        ("tandem-quest", "ok", 2),
    ]
    assert result.stdout.count("tandem-quest b1") == 1  # one voice: rank 0's
    assert "Tensor-parallel over 2 GPUs" in (out / "bench.md").read_text()


def test_bench_refuses_a_gpu_count_below_one(tmp_path, capsys):
    from tandem.cli import main

    assert main(["bench", "--gpus", "0", "--model", "tiny-llama", "--out", str(tmp_path)]) == 2
    assert "--gpus must be an integer >= 1, got 0" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_two_gpus_reproduce_one_gpu(graphs):
    """The issue's check: a Llama-3.1-8B shape cut to 2 layers, fp32, on 2 GPUs against 1, with the host
    attention split by heads and by requests (a batch of 3: 2 requests on rank 0, 1 on rank 1)."""
    args = ["-m", "tandem.distributed.check", "--model", "llama-3.1-8b", "--layers", "2", "--bias",
            "--batch", "3", "--host-splits", "heads,requests"]  # fmt: skip
    result = _torchrun(*args, *([] if graphs else ["--no-graphs"]), timeout=600)
    reports = _reports(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert len(reports) == 4 and all(r["tokens_equal"] and r["logits_close"] for r in reports)
    assert [r["host_tier"] for r in reports if r["host_split"] == "requests"] == [[2, 8], [2, 8]]


def test_a_row_failing_after_the_fill_ends_a_tensor_parallel_bench(tmp_path):
    """A decode step that fails on one rank leaves the others inside a collective: no later row can run."""
    from tandem.tools.bench import baselines
    from tandem.tools.bench.cli import _add

    row = baselines.empty_row("tandem-quest", 1, 1024, 4, 3)
    row.update(status="oom", error="OutOfMemoryError: CUDA out of memory", filled=True)
    with pytest.raises(RuntimeError, match="failed on rank 1 after the ranks filled .* the run ends here"):
        _add({"rows": []}, row, tmp_path, Rank(1, 2, torch.device("cpu")))


def test_a_host_memory_check_one_rank_fails_skips_the_row_on_every_rank():
    import argparse

    from tandem.tools.bench import baselines
    from tandem.tools.bench.cli import _agreed_check

    args = argparse.Namespace(steps=4, warmup=3)
    votes = []

    def agree(ok):  # this rank's check passed; another rank's did not
        votes.append(ok)
        return False

    row = _agreed_check("tandem-quest", 1, 1024, args, 1, baselines, agree)
    assert votes == [True] and row["status"] == "oom" and "another rank" in row["error"]
    assert _agreed_check("tandem-quest", 1, 1024, args, 1, baselines, lambda ok: True) is None


def _checkpoint(path, tied: bool):
    """A tiny Llama checkpoint (safetensors + a word-level tokenizer): tied embeddings, or a bias on every
    projection."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = shapes.shape_config("tiny-llama")
    config.tie_word_embeddings = tied
    if not tied:
        config.attention_bias = config.mlp_bias = True
    model = shapes.build_random_model(config, "cpu", torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    model.save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(config.vocab_size)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1").save_pretrained(path)
    return path


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "biases"])
@pytest.mark.slow
def test_a_checkpoint_read_slice_by_slice_reproduces_the_whole_model(tmp_path, tied):
    path = _checkpoint(tmp_path / "model", tied)
    result = _torchrun(
        "-m", "tandem.distributed.check", "--device", "cpu", "--model", str(path), "--steps", "5"
    )
    reports = _reports(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert len(reports) == 2 and all(r["tokens_equal"] and r["logits_close"] for r in reports)


@pytest.mark.slow
def test_generate_on_two_ranks_writes_the_one_rank_text(tmp_path):
    """quest on 1 rank, on 2 ranks, and on 2 ranks with the host attention split by requests."""
    path = _checkpoint(tmp_path / "model", tied=False)
    prompt = " ".join(f"w{3 + i % 29}" for i in range(40))  # past sinks and window: rows reach the host tier
    texts = []
    for gpus, split in (("1", "heads"), ("2", "heads"), ("2", "requests")):
        result = subprocess.run(
            [
                sys.executable, "-m", "tandem.cli", "generate", "--device", "cpu", "--gpus", gpus, "--model",
                str(path), "--prompt", prompt, "--max-new-tokens", "6", "--dtype", "float32", "--json",
                "--policy", "quest", "--sink-tokens", "4", "--window-tokens", "8", "--block-size", "4",
                "--budget", "0.5", "--host-split", split,
            ],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        stats = json.loads(result.stdout.strip().splitlines()[-1])["stats"]
        assert stats["gpus"] == int(gpus) and stats["generated_tokens"] == 6
        assert stats["host_split"] == split and stats["host_rows"] > 0  # the host tier is attended
        texts.append(json.loads(result.stdout.strip().splitlines()[-1])["text"])
    assert texts[0] == texts[1] == texts[2]


def test_generate_on_several_gpus_refuses_sampling(capsys):
    from tandem.cli import main

    assert main(["generate", "--gpus", "2", "--prompt", "hi", "--do-sample"]) == 2
    assert "--gpus N decodes greedily with the engine" in capsys.readouterr().err


def test_a_rank_attends_with_three_quarters_of_its_cores_less_one(monkeypatch):
    from tandem.config import CPU_THREADS_ENV, TandemConfig

    assert (
        launch.rank_threads(16, 1) == 15
        and launch.rank_threads(16, 4) == 11
        and launch.rank_threads(1, 2) == 1
    )
    monkeypatch.setenv(CPU_THREADS_ENV, "11")
    assert TandemConfig().host.threads == 11
    monkeypatch.setenv(CPU_THREADS_ENV, "many")  # not a count: the cores decide
    assert TandemConfig().host.threads >= 1


def test_a_split_that_does_not_divide_is_refused_before_any_rank_starts(tmp_path, capsys):
    from tandem.cli import main

    assert (
        main(["bench", "--device", "cpu", "--gpus", "3", "--model", "tiny-llama", "--out", str(tmp_path)])
        == 2
    )
    assert "gpus=3: the model's num_key_value_heads=2 does not split over 3 ranks; allowed gpus: 1, 2" in (
        capsys.readouterr().err
    )


@pytest.mark.slow
def test_a_rank_error_is_one_line_per_rank_without_the_launchers_traceback(tmp_path):
    path = _checkpoint(tmp_path / "model", tied=True)
    result = subprocess.run(
        [
            sys.executable, "-m", "tandem.cli", "generate", "--device", "cpu", "--gpus", "2", "--model", str(path),
            "--prompt-file", str(tmp_path / "missing.txt"),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    expected = [
        f"tandem: error (rank {r}): --prompt-file {str(tmp_path / 'missing.txt')!r} cannot be read: No such file or "
        "directory"
        for r in (0, 1)
    ]
    # the launcher stops the other rank once one has failed, sometimes before that one has printed its line
    assert lines and len(set(lines)) == len(lines) and set(lines) <= set(expected), lines
