"""Bad input gets a clear error naming the argument and the allowed values, and nothing is silently accepted:
devices, model files, sizes, TandemConfig ranges and assignment, sampling settings, prompt files, negative numbers
on the command line, kernel scales and ids, and a cache reused for another batch or continued with a longer
conversation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import tandem.cache.memory
import tandem.cli as cli
from tandem import TandemCache, TandemConfig, generate_cache_kwargs
from tandem.config import HgcaConfig, QuestConfig
from tandem.kernels import ops
from tandem.models import default_model_path, load_model, resolve_device
from tests.tiny import tiny_model


def _main(capsys, *argv):
    code = cli.main(list(argv))
    return code, capsys.readouterr().err.strip()


# ---- devices and model files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tpu7", "cuda:x", "", "gpu"])
def test_unknown_devices_are_refused_with_the_allowed_names(name):
    with pytest.raises(ValueError, match="allowed cpu, cuda or cuda:N"):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(ValueError, match="CUDA is not available on this machine; use cpu"):
        resolve_device("cuda")


def test_cuda_index_past_the_devices_is_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with pytest.raises(ValueError, match="allowed cuda:0 to"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_bad_device_fails_before_the_model_loads(capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the device was checked")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_load)
    for command in (["generate", "--prompt", "hi"], ["eval"]):
        code, err = _main(capsys, *command, "--device", "tpu7")
        assert (
            code == 2
            and err == "tandem: error: device='tpu7' is not a device name: allowed cpu, cuda or cuda:N"
        )
    code, err = _main(capsys, "bench", "--device", "tpu7", "--model", "tiny-llama", "--contexts", "512")
    assert code == 2 and "device='tpu7'" in err


def test_truncated_gguf_is_named_as_incomplete(tmp_path):
    truncated = tmp_path / "model.gguf"
    with open(default_model_path(), "rb") as f:
        truncated.write_bytes(f.read(64 << 10))
    with pytest.raises(ValueError, match=r"cannot load model from .*model.gguf' \(is the file complete\?\)"):
        load_model(truncated, device="cpu")


# ---- the command line's last line of defence -----------------------------------------------------------------
def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    def broken(args):
        raise RuntimeError("something deep\nwith a second line")

    monkeypatch.setattr(cli.generate, "run", broken)
    code, err = _main(capsys, "generate", "--prompt", "hi")
    assert code == 1
    assert err == "tandem: error: RuntimeError: something deep (run with --debug for the traceback)"
    code, err = _main(capsys, "generate", "--prompt", "hi", "--debug")
    assert code == 1 and "Traceback (most recent call last)" in err and "something deep" in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["generate", "--prompt", "hi", "--max-new-tokens", "-5"],
            "--max-new-tokens=-5 is out of range: allowed >= 1",
        ),
        (
            ["bench", "--contexts", "-1k", "--model", "tiny-llama", "--device", "cpu"],
            "'-1k' is not a context length",
        ),
        (
            ["generate", "--prompt", "hi", "--do-sample", "--top-p", "2"],
            "--top-p=2.0 is out of range: allowed (0, 1]",
        ),
        (
            ["generate", "--prompt", "hi", "--do-sample", "--temperature", "0"],
            "--temperature=0.0 is out of range",
        ),
        (["generate", "--prompt", "hi", "--do-sample", "--top-p", "nan"], "--top-p=nan is out of range"),
        (["simulate", "--host", "--host-bandwidth-gbs", "-3"], "--host-bandwidth-gbs: must be positive"),
    ],
)
def test_out_of_range_numbers_name_the_flag(capsys, argv, message):
    code, err = _main(capsys, *argv)
    assert code == 2 and message in err, err


def test_a_prompt_file_that_is_not_utf8_is_named(capsys, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_bytes(b"\xff\xfe caf\xe9")
    code, err = _main(capsys, "generate", "--prompt-file", str(path))
    assert code == 2 and f"--prompt-file '{path}' is not UTF-8 text (byte 0xff at offset 0)" in err


# ---- TandemConfig --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("hgca.beta", math.inf),
        ("quest.budget", math.nan),
        ("hgca.maw_alpha", -math.inf),
        ("quest.gpu_share", math.nan),
        ("fluxion.tau", math.inf),
    ],
)
def test_config_refuses_non_finite_numbers(field, value):
    key, _, name = field.partition(".")
    with pytest.raises(ValueError, match=rf"TandemConfig\.{key}\.{name}=.* is out of range"):
        TandemConfig(policy=key).with_settings({field: value})


def test_config_takes_numpy_numbers_and_names_wrong_types():
    config = TandemConfig(
        policy="quest", quest=QuestConfig(budget=np.float32(0.25)), window_tokens=np.int32(128)
    )
    assert type(config.quest.budget) is float and type(config.window_tokens) is int
    assert type(HgcaConfig(span=np.int64(4)).span) is int
    for field, value in (
        ("quest.budget", "0.1"),
        ("hgca.span", 2.0),
        ("window_tokens", "all"),
        ("hgca.beta", None),
    ):
        with pytest.raises(ValueError, match=rf"TandemConfig\.{field}=.* has the wrong type"):
            TandemConfig(policy=field.partition(".")[0] if "." in field else "quest").with_settings(
                {field: value}
            )


def test_config_assignment_is_checked_and_a_bad_value_is_refused():
    config = TandemConfig(policy="quest")
    with pytest.raises(ValueError, match="TandemConfig.window_tokens=0 is out of range"):
        config.window_tokens = 0
    assert config.window_tokens == 256  # the old value stays
    with pytest.raises(ValueError, match=r"TandemConfig\.quest\.budget=-1 is out of range"):
        config.quest = {"budget": -1}
    assert config.quest.budget == 0.05
    config.quest = QuestConfig(budget=0.2, gpu_share=0.5)
    assert config.quest.budget == 0.2
    with pytest.raises(
        ValueError,
        match=r"TandemConfig\.quest\.budget=0\.2 is out of range: allowed its default .*policy='hgca'",
    ):
        config.policy = "hgca"  # the fields are checked together: quest's settings need quest
    assert config.policy == "quest"
    with pytest.raises(AttributeError, match="no field 'bugdet'"):
        config.bugdet = 0.1


def test_window_tokens_past_the_model_context_or_memory_is_refused(monkeypatch):
    model = tiny_model("Llama")  # max_position_embeddings 1024
    with pytest.raises(ValueError, match="window_tokens=4096 exceeds the model's maximum context of 1024"):
        TandemCache.for_model(model, TandemConfig(policy="full", window_tokens=4096))
    with pytest.raises(
        ValueError, match=r"window_tokens=100000000 is out of range: allowed an int in \[1, 4194304\]"
    ):
        TandemConfig(window_tokens=100_000_000)
    cache = TandemCache.for_model(model, TandemConfig(policy="full", window_tokens=1000))
    monkeypatch.setattr(tandem.cache.memory, "available_host_bytes", lambda: 1 << 16)
    with pytest.raises(MemoryError, match="hot tier needs .* GB on cpu for TandemConfig.window_tokens=1000"):
        model(torch.randint(0, 128, (1, 8)), use_cache=True, **generate_cache_kwargs(model, cache))


# ---- kernels -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [math.nan, math.inf, "0.1", None])
def test_kernel_launchers_refuse_a_scale_that_is_not_a_finite_number(scale):
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 16, 8)
    ids, lengths = torch.zeros(1, 2, 1, dtype=torch.long), torch.ones(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        ops.sparse_attention_lse(q, k, k, ids, lengths, scale)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        ops.attention_lse(q, k, k, scale)


@pytest.mark.parametrize("block_id", [2**60, 2**62 + 1, 2**63 - 1, -(2**63)])
def test_block_ids_at_the_int64_extremes_are_refused_not_wrapped(block_id):
    """`id * block_size` would overflow int64 for such ids: they are range-checked before being scaled."""
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 16, 8)
    ids = torch.tensor([[[0, block_id]], [[1, 2]]]).view(1, 2, 2)
    lengths = torch.full((1, 2), 2, dtype=torch.long)
    with pytest.raises(ValueError, match="indices"):
        ops.sparse_attention_lse(q, k, k, ids, lengths, 0.3, block_size=4)


# ---- caches --------------------------------------------------------------------------------------------------
def test_for_model_refuses_what_is_not_a_model():
    with pytest.raises(ValueError, match="model must be a loaded transformers causal LM .* got str"):
        TandemCache.for_model("gpt2")
    with pytest.raises(ValueError, match="config must be a TandemConfig or None, got dict"):
        TandemCache.for_model(tiny_model("Llama"), {"policy": "full"})


def test_a_cache_refuses_another_batch():
    model = tiny_model("Llama")
    cache = TandemCache.for_model(model, TandemConfig(policy="full"))
    model(torch.randint(0, 128, (2, 10)), use_cache=True, **generate_cache_kwargs(model, cache))
    with pytest.raises(ValueError, match="holds a batch of 2 .* come as a batch of 3 .* build a new cache"):
        model(torch.randint(0, 128, (3, 10)), use_cache=True, **generate_cache_kwargs(model, cache))


def test_a_reused_cache_continues_the_conversation_as_transformers_caches_do():
    """Passing a used TandemCache to generate() again continues it: input_ids hold the conversation so far (the
    cached tokens) and the new turn, as with transformers' own caches. The result equals generating the whole
    conversation at once with a DynamicCache."""
    model = tiny_model("Llama")
    model.generation_config.eos_token_id = None
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=8, block_size=4)
    first = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    cache = TandemCache.for_model(model, config)
    kwargs = dict(do_sample=False, pad_token_id=0)
    turn1 = model.generate(first, max_new_tokens=6, **kwargs, **generate_cache_kwargs(model, cache))
    second = torch.cat([turn1, torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))], 1)
    turn2 = model.generate(second, max_new_tokens=6, **kwargs, **generate_cache_kwargs(model, cache))
    fresh = model.generate(second, max_new_tokens=6, **kwargs, **generate_cache_kwargs(model, DynamicCache()))
    assert torch.equal(turn2, fresh)
    assert cache.get_seq_length() == second.shape[1] + 5


# ---- faults --------------------------------------------------------------------------------------------------
def test_host_memory_exhausted_mid_run_is_a_clear_error_and_the_cache_refuses_further_use(monkeypatch):
    import tandem.cache.host as host_module

    model = tiny_model("Llama")
    model.generation_config.eos_token_id = None
    config = TandemConfig(policy="quest", sink_tokens=4, window_tokens=8, block_size=4)
    cache = TandemCache.for_model(model, config)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    model.generate(
        ids, max_new_tokens=2, do_sample=False, pad_token_id=0, **generate_cache_kwargs(model, cache)
    )
    capacity = cache.tandem_layers()[0].host.capacity

    def exhausted(shape, dtype, *, pin, huge=True):
        raise MemoryError("simulated: the host has no memory left")

    monkeypatch.setattr(host_module, "host_zeros", exhausted)
    longer = torch.randint(0, 128, (1, capacity + 64), generator=torch.Generator().manual_seed(1))
    follow = torch.cat([ids, longer], dim=1)  # a continuation that makes the host tier grow
    with pytest.raises(
        MemoryError, match="cannot allocate .* host memory for the Tandem host tier .*simulated"
    ):
        model.generate(
            follow, max_new_tokens=2, do_sample=False, pad_token_id=0, **generate_cache_kwargs(model, cache)
        )
    with pytest.raises(
        RuntimeError, match="this TandemCache is unusable: .*HostMemoryError.*build a new cache"
    ):
        model(follow[:, -1:], use_cache=True, **generate_cache_kwargs(model, cache))
    monkeypatch.undo()
    fresh = TandemCache.for_model(model, config)  # the model itself is untouched
    out = model.generate(
        ids, max_new_tokens=3, do_sample=False, pad_token_id=0, **generate_cache_kwargs(model, fresh)
    )
    assert out.shape == (1, 43)


def _out_of_memory_at(monkeypatch, module, name: str, call: int):
    """Make `module.name` raise torch.OutOfMemoryError (the CUDA allocator's error) at its `call`-th call."""
    original, calls = getattr(module, name), {"n": 0}

    def fails(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, fails)


def test_device_memory_exhausted_in_prefill_is_a_memory_error_naming_the_chunk(monkeypatch):
    from tandem.engine import TandemRunner

    model = tiny_model("Llama")
    cache = TandemCache.for_model(
        model, TandemConfig(policy="quest", sink_tokens=4, window_tokens=8, block_size=4)
    )
    runner = TandemRunner(model, cache)
    mlp = type(model.model.layers[1].mlp)
    _out_of_memory_at(monkeypatch, mlp, "forward", 3)  # layer 1 of the second chunk: layer 0 holds it already
    with pytest.raises(
        MemoryError,
        match=r"ran out of memory during prefill of 1 x 40 tokens in chunks of 16: .*chunk_tokens",
    ):
        runner.prefill(torch.randint(0, 128, (1, 40)), chunk_tokens=16)
    with pytest.raises(RuntimeError, match="unusable: .*OutOfMemoryError"):
        model(torch.zeros(1, 1, dtype=torch.long), use_cache=True, **generate_cache_kwargs(model, cache))


def test_device_memory_exhausted_mid_decode_is_a_memory_error_and_the_step_is_closed(monkeypatch):
    import threading

    from tandem.engine import TandemRunner

    model = tiny_model("Llama")
    config = TandemConfig(policy="quest", sink_tokens=4, window_tokens=64, block_size=4)
    cache = TandemCache.for_model(model, config)
    runner = TandemRunner(model, cache)
    first = runner.prefill(torch.randint(0, 128, (1, 6))).argmax(-1)  # a ring sized for the prompt
    hot = cache.tandem_layers()[0].hot
    assert hot.allocated_blocks < hot.ring_blocks  # the ring grows during the decode below
    threads = {t.name for t in threading.enumerate()}
    _out_of_memory_at(monkeypatch, torch.Tensor, "new_zeros", 1)  # the ring's first growth
    with pytest.raises(MemoryError, match=r"ring could not grow .*window_tokens"):
        runner.decode(first, 40)
    assert cache.step_context is None and {t.name for t in threading.enumerate()} <= threads
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="unusable: a step failed .*ring could not grow"):
        runner.decode(first, 1)


def test_a_cpu_worker_raising_inside_a_step_fails_the_step_and_leaves_no_thread_behind(monkeypatch):
    import threading

    from tandem.engine import TandemRunner
    from tandem.policies import quest

    model = tiny_model("Llama")
    cache = TandemCache.for_model(
        model, TandemConfig(policy="quest", sink_tokens=4, window_tokens=8, block_size=4)
    )
    runner = TandemRunner(model, cache)
    first = runner.prefill(torch.randint(0, 128, (2, 60)), max_new_tokens=10).argmax(-1)
    runner.decode(first, 2)
    threads = {t.name for t in threading.enumerate()}
    calls = {"n": 0}
    original = quest.QuestPolicy.select

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated CPU worker failure")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(quest.QuestPolicy, "select", failing)
    with pytest.raises(RuntimeError, match="simulated CPU worker failure"):
        runner.decode(first, 4)
    assert {t.name for t in threading.enumerate()} <= threads  # no new thread left running or waiting
    assert cache.step_context is None  # the step was closed
    with pytest.raises(RuntimeError, match="unusable: a step failed .*simulated CPU worker failure"):
        runner.decode(first, 1)


@pytest.mark.model
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_ctrl_c_ends_the_cli_promptly(tmp_path, phase):
    """SIGINT during a long prefill or a long decode: `tandem generate` exits with 130 within seconds."""
    import signal
    import subprocess
    import sys
    import time

    prompt = tmp_path / "prompt.txt"
    words = " ".join(f"word{i % 500}" for i in range(2500))
    counting = ", ".join(str(i) for i in range(1, 13)) + ","  # the model keeps counting: a long decode
    prompt.write_text(words if phase == "prefill" else counting)
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    # a test run started in the background (`cmd &`) inherits SIGINT ignored, and so would the CLI: give it the
    # default disposition, as a terminal's foreground job has
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "tandem.cli", "generate", "--device", "cpu", "--prompt-file", str(prompt),
         "--max-new-tokens", "2000", "--engine", "on", "--policy", "streaming"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    # wait until the model is loaded and the phase has begun: the progress bar (prefill) or the first text (decode)
    stream = proc.stderr if phase == "prefill" else proc.stdout
    began = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        began += stream.read1(256) if hasattr(stream, "read1") else stream.read(1)
        if (b"prefill" in began.lower() or b"%" in began) if phase == "prefill" else len(began.strip()) > 0:
            break
    assert proc.poll() is None, f"the run ended before the {phase} began"
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=20)
    finally:
        proc.kill()
    assert code == 130 and time.monotonic() - start < 20
