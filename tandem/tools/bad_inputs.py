"""A catalogue of bad inputs, each run for real: command-line flags, `TandemConfig` fields, kernel launchers and
cache calls. Every case must end in a clear refusal (a ValueError / MemoryError / FileNotFoundError /
NotImplementedError, an AttributeError for a misspelt field, or the command line's one-line error) or be accepted as valid. A traceback reaching the
user, or another exception type, is a defect.

    python -m tandem.tools.bad_inputs --out docs/bad-inputs.md

`tests/cli/test_bad_inputs.py` runs the whole catalogue, so the table in `docs/bad-inputs.md` stays true.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# AttributeError: a misspelt TandemConfig field, named with the list of fields
REFUSALS = (ValueError, MemoryError, FileNotFoundError, NotImplementedError, AttributeError)


@dataclass
class Case:
    area: str
    what: str
    run: Callable[[], object]
    expect: str = "refused"  # or "accepted"


@dataclass
class Outcome:
    case: Case
    result: str  # "refused", "accepted", "argparse" (argparse's usage error) or "defect"
    message: str

    @property
    def ok(self) -> bool:
        if self.result == "defect":
            return False
        if self.case.expect == "accepted":
            return self.result == "accepted"
        return self.result in ("refused", "argparse")


def run_case(case: Case) -> Outcome:
    err_stream = io.StringIO()
    try:
        with contextlib.redirect_stderr(err_stream), contextlib.redirect_stdout(io.StringIO()):
            value = case.run()
    except SystemExit as exit_:  # argparse refused the line (usage + error on stderr)
        lines = [line for line in err_stream.getvalue().splitlines() if "error:" in line]
        return Outcome(
            case, "argparse" if exit_.code == 2 else "defect", lines[-1] if lines else f"exit {exit_.code}"
        )
    except REFUSALS as err:
        return Outcome(case, "refused", f"{type(err).__name__}: {str(err).splitlines()[0]}")
    except Exception as err:  # noqa: BLE001 - the point is to catch what should not happen
        return Outcome(case, "defect", f"{type(err).__name__}: {err}")
    if isinstance(value, int) and value is not True and value is not False and case.area == "command line":
        # tandem.cli.main's exit code: 2 = one-line error, 0 = ran, 1 = an unexpected error (a defect)
        lines = [line for line in err_stream.getvalue().splitlines() if line.startswith("tandem")]
        message = lines[-1] if lines else ""
        if value == 2:
            return Outcome(case, "refused", message)
        return Outcome(case, "accepted" if value == 0 else "defect", message or f"exit {value}")
    return Outcome(case, "accepted", "")


# ---- the catalogue ---------------------------------------------------------------------------------------------
def _cli(*argv):
    from tandem.cli import main

    return lambda: main(list(argv))


def _scratch(name: str) -> str:
    """A path in the temporary directory (no case gets as far as writing it)."""
    return os.path.join(tempfile.gettempdir(), f"tandem-bad-input-{name}")


def _not_a_model(generate_argv):
    def run():
        path = os.path.join(tempfile.gettempdir(), "tandem-not-a-model.txt")
        with open(path, "w") as f:
            f.write("not a model")
        return _cli(*generate_argv, "--model", path)()

    return run


def command_line_cases() -> list[Case]:
    g = ("generate", "--prompt", "hi", "--device", "cpu")
    cases = [
        Case(
            "command line", "generate --device tpu7", _cli("generate", "--prompt", "hi", "--device", "tpu7")
        ),
        Case("command line", "generate --device gpu", _cli("generate", "--prompt", "hi", "--device", "gpu")),
        Case(
            "command line",
            "generate --device cuda:x",
            _cli("generate", "--prompt", "hi", "--device", "cuda:x"),
        ),
        Case("command line", "eval --device tpu7", _cli("eval", "--device", "tpu7")),
        Case(
            "command line",
            "calibrate --device tpu7",
            _cli("calibrate", "--device", "tpu7", "--out", _scratch("calibrate.pt")),
        ),
        Case(
            "command line", "bench --device tpu7", _cli("bench", "--device", "tpu7", "--model", "tiny-llama")
        ),
        Case("command line", "generate --model /nonexistent", _cli(*g, "--model", "/nonexistent/model.gguf")),
        Case("command line", "generate --model (a file that is not .gguf)", _not_a_model(g)),
        Case("command line", "generate without a prompt", _cli("generate", "--device", "cpu")),
        Case("command line", "generate --prompt ''", _cli("generate", "--prompt", " ", "--device", "cpu")),
        Case(
            "command line",
            "generate --prompt-file /nonexistent",
            _cli("generate", "--prompt-file", "/nonexistent"),
        ),
    ]
    flag_values = {
        "--max-new-tokens": ["-5", "0", "x", "1e3"],
        "--window-tokens": ["0", "-1", "100000000", "1.5", "abc"],
        "--sink-tokens": ["-1", "9999999999"],
        "--block-size": ["0", "5000", "-16"],
        "--budget": ["0", "-0.1", "1.5", "nan", "inf"],
        "--beta": ["0", "-1", "inf", "nan"],
        "--gpu-share": ["-0.1", "1.5", "nan"],
        "--gpu-cache": ["-1", "100", "nan"],
        "--tau": ["-0.1", "1", "inf", "nan"],
        "--epsilon": ["0", "1", "-0.5", "nan"],
        "--max-budget": ["0", "2"],
        "--cpu-threads": ["0", "-2", "100000"],
        "--policy": ["dense", ""],
        "--fluxion-mode": ["magic"],
        "--host-dtype": ["int4", "none"],
        "--granularity": ["8", "17"],
        "--dtype": ["int8", "float64"],
        "--engine": ["maybe"],
    }
    for flag, values in flag_values.items():
        for value in values:
            cases.append(Case("command line", f"generate {flag} {value}", _cli(*g, f"{flag}={value}")))
    for flag, value in (("--top-p", "2"), ("--top-p", "0"), ("--top-p", "nan"), ("--temperature", "0"),
                        ("--temperature", "-1"), ("--temperature", "inf")):  # fmt: skip
        cases.append(
            Case(
                "command line",
                f"generate --do-sample {flag} {value}",
                _cli(*g, "--do-sample", f"{flag}={value}"),
            )
        )
    bench = ("bench", "--model", "tiny-llama", "--device", "cpu")
    for flag, value in (("--contexts", "-1k"), ("--contexts", "0"), ("--contexts", "abc"), ("--batches", "0"),
                        ("--batches", "-4"), ("--steps", "0"), ("--warmup", "1"), ("--hf", "hf-magic"),
                        ("--policies", "dense"), ("--handoff", "smoke"), ("--forward", "fast"), ("--layers", "0"),
                        ("--cpu-threads", "0"), ("--set", "quest.budget=2"), ("--set", "nonsense"),
                        ("--model", "llama-9b"), ("--dtype", "int4"), ("--fill", "magic"),
                        ("--chunk-tokens", "0"), ("--gpus", "0"), ("--gpus", "3")):  # fmt: skip
        cases.append(Case("command line", f"bench {flag} {value}", _cli(*bench, f"{flag}={value}")))
    cases.append(Case("command line", "generate --gpus 0", _cli(*g, "--gpus", "0")))
    cases.append(
        Case("command line", "generate --gpus 2 --do-sample", _cli(*g, "--gpus", "2", "--do-sample"))
    )
    ev = ("eval", "--device", "cpu")
    for flag, value in (("--policies", "dense"), ("--tasks", "sudoku"), ("--lengths", "-1k"), ("--lengths", "0"),
                        ("--samples", "0"), ("--samples", "-3"), ("--set", "quest.budget=0"),
                        ("--set", "hgca.beta=inf"), ("--haystack", "/nonexistent"), ("--ppl-tokens", "0"),
                        ("--error-steps", "-1"), ("--cpu-threads", "0")):  # fmt: skip
        cases.append(Case("command line", f"eval {flag} {value}", _cli(*ev, f"{flag}={value}")))
    sim = ("simulate",)
    for flags in (("--model", "gpt-5"), ("--context", "-1k"), ("--context", "zero"), ("--gpus", "0"), ("--pnm", "-1"),
                  ("--scheme", "magic"), ("--gpu", "tpu"), ("--mapping", "xx"), ("--budget", "2"),
                  ("--page-size", "0"), ("--batch", "0"), ("--host", "--host-bandwidth-gbs", "-3"),
                  ("--host", "--host-cores", "0"), ("--host", "--pcie-gbs", "0"), ("--host", "--hbm-gbs", "nan"),
                  ("--host", "--sparsity", "1.5"), ("--host", "--sparsity", "0"), ("--host", "--hot-tokens", "-1"),
                  ("--host", "--from-bench", "/nonexistent.json")):  # fmt: skip
        cases.append(Case("command line", "simulate " + " ".join(flags), _cli(*sim, *flags)))
    cases.append(Case("command line", "simulate (defaults)", _cli("simulate"), expect="accepted"))
    cases.append(
        Case(
            "command line",
            "simulate --host --sparsity 0.1",
            _cli("simulate", "--host", "--sparsity", "0.1"),
            "accepted",
        )
    )
    cal = ("calibrate", "--device", "cpu", "--out", _scratch("calibrate.pt"))
    for flag, value in (("--lengths", "0"), ("--documents", "0"), ("--steps", "0"), ("--taus", "2"),
                        ("--model", "/nonexistent")):  # fmt: skip
        cases.append(Case("command line", f"calibrate {flag} {value}", _cli(*cal, f"{flag}={value}")))
    return cases


def config_cases() -> list[Case]:
    from tandem import TandemConfig
    from tandem.config import FEATURES, MOVED, moved_message

    def make(**settings):
        """TandemConfig of `settings` (core fields, dotted sub-config fields) as one call with sub-configs."""
        nested: dict = {}
        for name, value in settings.items():
            key, dot, sub = name.partition(".")
            if dot:
                nested.setdefault(key, {})[sub] = value
            else:
                nested[key] = value
        return lambda: TandemConfig.from_dict(nested)

    def shown(**settings) -> str:
        """`settings` as the Python call that makes them: TandemConfig(policy='quest', quest=QuestConfig(...))."""
        core = [f"{name}={value!r}" for name, value in settings.items() if "." not in name]
        nested: dict = {}
        for name, value in settings.items():
            if "." in name:
                key, _, sub = name.partition(".")
                nested.setdefault(key, []).append(f"{sub}={value!r}")
        features = [f"{key}={FEATURES[key].__name__}({', '.join(subs)})" for key, subs in nested.items()]
        return f"TandemConfig({', '.join(core + features)})"

    def assign(field, value):
        def run():
            config = TandemConfig(policy="quest")
            setattr(config, field, value)

        return run

    bad = {
        "policy": ["dense", None, 3],
        "sink_tokens": [-1, 1 << 21, 2.0, "4", None],
        "window_tokens": [0, -5, 1 << 23, 1.0, 0.0, math.nan, "256", None, True],
        "block_size": [0, 5000, 16.0, None],
        "quest.budget": [0.0, -0.1, 1.5, math.nan, math.inf, "0.1", None],
        "hgca.beta": [0.0, -1.0, math.inf, math.nan],
        "hgca.maw_alpha": [0.0, 1.5, math.nan],
        "hgca.span": [0, 1 << 13, 1.5],
        "hgca.observation_tokens": [0, -1],
        "prefill_chunk": [0, 1 << 25],
        "host.threads": [0, -1, 5000, 1.5],
        "quest.gpu_share": [-0.1, 1.5, math.nan],
        "quest.gpu_cache": [-1.0, 100.0, math.nan],
        "quest.scheduler": ["lanes", "heads"],  # "heads": a baseline of benchmarks/bench_scheduler.py
        "device": ["tpu", "cuda:x", 0],
        "host.huge_pages": [2, "yes"],
        "host.dtype": ["int4", "bf16", 8],
        "distributed.host_split": ["tensor", None],
        "fluxion.tau": [-0.1, 1.0, math.inf],
        "fluxion.profile": [3],
        "fluxion.mode": ["magic"],
        "fluxion.granularity": [8, 17, True],
        "fluxion.skip_streaming": [2, "no"],
        "certified.epsilon": [0.0, 1.0, -0.1, math.nan, "0.05"],
        "certified.max_budget": [0.0, 1.5, math.nan],
        "certified.bound": ["box", None],
        "certified.unit": ["rows", 16],
    }
    cases = []
    for field, values in bad.items():
        for value in values:
            policy = {"policy": "quest"} if field.startswith(("quest.", "certified.")) else {}
            policy = {"policy": "hgca"} if field.startswith("hgca.") else policy
            policy = {"policy": "fluxion"} if field.startswith("fluxion.") else policy
            settings = {**policy, field: value}
            cases.append(Case("TandemConfig", shown(**settings), make(**settings)))
    for field, value in (("window_tokens", 0), ("policy", "dense")):
        cases.append(
            Case("TandemConfig", f"config.{field} = {value!r} after construction", assign(field, value))
        )
    cases.append(
        Case(
            "TandemConfig",
            "config.quest = {'budget': -1} after construction",
            assign("quest", {"budget": -1}),
        )
    )
    cases.append(Case("TandemConfig", "config.bugdet = 0.1 (a misspelt field)", assign("bugdet", 0.1)))
    for name in MOVED:  # every flat spelling of earlier versions: refused, naming the new one
        cases.append(
            Case(
                "TandemConfig",
                f"TandemConfig({name}=...) ({moved_message(name).split(':')[0]})",
                make(**{name: 1}),
            )
        )
    settings = {"policy": "hgca", "quest.gpu_share": 0.5}  # a sub-config of another policy
    cases.append(Case("TandemConfig", shown(**settings), make(**settings)))
    cases.append(
        Case(
            "TandemConfig",
            "TandemConfig(policy='fluxion', block_size=32)",
            make(policy="fluxion", block_size=32),
        )
    )
    for fields in ({"policy": "hgca", "certified.epsilon": 0.05},
                   {"policy": "quest", "certified.epsilon": 0.05, "quest.gpu_share": 0.4},
                   {"policy": "quest", "certified.epsilon": 0.05, "host.dtype": "int8"},
                   {"policy": "quest", "certified.epsilon": 0.05, "certified.bound": "digest", "certified.unit": "row"},
                   {"policy": "hgca", "distributed.host_split": "requests"},
                   {"policy": "quest", "distributed.host_split": "requests", "quest.gpu_share": 0.4}):  # fmt: skip
        cases.append(Case("TandemConfig", shown(**fields), make(**fields)))
    for field, value in (("quest.budget", np.float32(0.25)), ("hgca.span", np.int64(4)),
                         ("window_tokens", np.int32(128)), ("window_tokens", 0.25)):  # fmt: skip
        settings = {"policy": field.partition(".")[0], field: value} if "." in field else {field: value}
        cases.append(Case("TandemConfig", shown(**settings), make(**settings), "accepted"))
    return cases


def kernel_cases() -> list[Case]:
    from tandem.kernels import ops

    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 16, 8)
    ids, lengths = torch.zeros(1, 2, 1, dtype=torch.long), torch.ones(1, 2, dtype=torch.long)

    def sparse(**over):
        args = dict(q=q, k_store=k, v_store=k, indices=ids, lengths=lengths, scale=0.35, block_size=None)
        args.update(over)
        return lambda: ops.sparse_attention_lse(**args)

    cases = [
        Case("kernels", "sparse_attention_lse, valid", sparse(), "accepted"),
        Case("kernels", "sparse_attention_lse, scale=nan", sparse(scale=math.nan)),
        Case("kernels", "sparse_attention_lse, scale=inf", sparse(scale=math.inf)),
        Case("kernels", "sparse_attention_lse, scale='0.3'", sparse(scale="0.3")),
        Case("kernels", "sparse_attention_lse, 3-D q", sparse(q=q[:, :, 0])),
        Case("kernels", "sparse_attention_lse, q heads not a multiple", sparse(q=torch.randn(1, 3, 1, 8))),
        Case("kernels", "sparse_attention_lse, head_dim mismatch", sparse(q=torch.randn(1, 2, 1, 4))),
        Case("kernels", "sparse_attention_lse, int32 indices", sparse(indices=ids.int())),
        Case("kernels", "sparse_attention_lse, lengths past the width", sparse(lengths=lengths * 5)),
        Case("kernels", "sparse_attention_lse, negative lengths", sparse(lengths=-lengths)),
        Case("kernels", "sparse_attention_lse, indices of another batch", sparse(indices=torch.zeros(2, 2, 1, dtype=torch.long))),
        Case("kernels", "sparse_attention_lse, block_size=0", sparse(block_size=0)),
        Case("kernels", "sparse_attention_lse, key_mask of wrong shape", sparse(key_mask=torch.ones(1, 3, dtype=torch.bool))),
        Case("kernels", "sparse_attention_lse, float key_mask", sparse(key_mask=torch.ones(1, 16))),
        Case("kernels", "sparse_attention_lse, int8 store", sparse(k_store=k.to(torch.int8), v_store=k.to(torch.int8))),
    ]  # fmt: skip
    for extreme in (16, -1, 2**31, 2**60, 2**62 + 1, 2**63 - 1, -(2**63)):
        cases.append(Case("kernels", f"sparse_attention_lse, row id {extreme}",
                          sparse(indices=torch.full((1, 2, 1), extreme, dtype=torch.long))))  # fmt: skip
        cases.append(Case("kernels", f"sparse_attention_lse, block id {extreme} (block_size 4)",
                          sparse(indices=torch.full((1, 2, 1), extreme, dtype=torch.long), block_size=4)))  # fmt: skip
    cases += [
        Case("kernels", "attention_lse, scale=nan", lambda: ops.attention_lse(q, k, k, math.nan)),
        Case("kernels", "attention_lse, k on another batch", lambda: ops.attention_lse(q, k.repeat(2, 1, 1, 1), k, 0.3)),
        Case("kernels", "merge_lse_, shapes differ", lambda: ops.merge_lse_(torch.zeros(1, 2, 8), torch.zeros(1, 2),
                                                                          torch.zeros(1, 2, 4), torch.zeros(1, 2))),
        Case("kernels", "hot_attention, scale=inf", lambda: ops.hot_attention(q[:, :, 0], k, k, torch.ones(1, 16, dtype=torch.bool), math.inf)),
        Case("kernels", "top_blocks, float64 scores", lambda: ops.top_blocks(torch.zeros(1, 4, dtype=torch.float64), torch.ones(1, dtype=torch.long), 2)),
    ]  # fmt: skip
    return cases


def cache_cases() -> list[Case]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem import TandemCache, TandemConfig, generate_cache_kwargs
    from tandem.engine import TandemRunner
    from tandem.models import load_model, resolve_device

    torch.manual_seed(0)
    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()

    def used_cache():
        cache = TandemCache.for_model(model, TandemConfig(policy="full"))
        model(torch.randint(0, 128, (2, 10)), use_cache=True, **generate_cache_kwargs(model, cache))
        return cache

    def other_batch():
        cache = used_cache()
        model(torch.randint(0, 128, (3, 10)), use_cache=True, **generate_cache_kwargs(model, cache))

    def runner(**kwargs):
        return lambda: TandemRunner(
            model, TandemCache.for_model(model, TandemConfig(policy="full")), **kwargs
        )

    def decode_without_prefill():
        r = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="full")))
        r.decode(torch.zeros(1, dtype=torch.long), 2)

    def decode_wrong_first_tokens():
        r = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="full")))
        r.prefill(torch.randint(0, 128, (2, 12)))
        r.decode(torch.zeros(3, dtype=torch.long), 2)

    def decode_past_context():
        r = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="full")))
        r.prefill(torch.randint(0, 128, (1, 12)))
        r.decode(torch.zeros(1, dtype=torch.long), 5000)

    def prompt_past_context():
        cache = TandemCache.for_model(model, TandemConfig(policy="full"))
        model(torch.randint(0, 128, (1, 1100)), use_cache=True, **generate_cache_kwargs(model, cache))

    return [
        Case("caches", "TandemCache.for_model('gpt2')", lambda: TandemCache.for_model("gpt2")),
        Case("caches", "TandemCache.for_model(model, {'policy': 'full'})", lambda: TandemCache.for_model(model, {"policy": "full"})),
        Case("caches", "window_tokens past the model's context", lambda: TandemCache.for_model(model, TandemConfig(window_tokens=4096))),
        Case("caches", "a used cache given another batch size", other_batch),
        Case("caches", "a prompt past max_position_embeddings", prompt_past_context),
        Case("caches", "TandemRunner(..., forward='fast')", runner(forward="fast")),
        Case("caches", "TandemRunner(..., handoff='smoke')", runner(handoff="smoke")),
        Case("caches", "TandemRunner(..., use_graphs=True) on CPU", runner(use_graphs=True)),
        Case("caches", "TandemRunner(model, DynamicCache())", lambda: TandemRunner(model, __import__("transformers").DynamicCache())),
        Case("caches", "decode before prefill", decode_without_prefill),
        Case("caches", "decode with first_tokens of another batch", decode_wrong_first_tokens),
        Case("caches", "decode past the model's context", decode_past_context),
        Case("caches", "prefill chunk_tokens=0", lambda: TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="full"))).prefill(torch.zeros(1, 4, dtype=torch.long), chunk_tokens=0)),
        Case("caches", "prefill of an empty prompt", lambda: TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="full"))).prefill(torch.zeros(1, 0, dtype=torch.long))),
        Case("caches", "warm_up(prompt_tokens=0)", lambda: TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="full"))).warm_up(0)),
        Case("models", "load_model('/nonexistent')", lambda: load_model("/nonexistent")),
        Case("models", "load_model(dtype='int8')", lambda: load_model(dtype="int8")),
        Case("models", "load_model(device='tpu7')", lambda: load_model(device="tpu7")),
        Case("models", "resolve_device('gpu')", lambda: resolve_device("gpu")),
        Case("models", "resolve_device('cpu')", lambda: resolve_device("cpu"), "accepted"),
    ]  # fmt: skip


def catalogue() -> list[Case]:
    return command_line_cases() + config_cases() + kernel_cases() + cache_cases()


def markdown(outcomes: list[Outcome]) -> str:
    defects = [o for o in outcomes if not o.ok]
    refused = sum(o.result in ("refused", "argparse") for o in outcomes)
    lines = [
        "# Bad inputs tried, and what each got",
        "",
        "Generated by `python -m tandem.tools.bad_inputs --out docs/bad-inputs.md`. Every case was run. "
        "`tests/cli/test_bad_inputs.py` runs the same catalogue and fails on any defect. The fault tests (memory "
        "exhausted on the host and on the GPU, a CPU worker raising, Ctrl-C in prefill and decode) and the "
        "property-based tests are listed in `docs/hardening.md`.",
        "",
        f"**{len(outcomes)} cases: {refused} refused with a named error, "
        f"{sum(o.result == 'accepted' for o in outcomes)} accepted as valid, {len(defects)} defects.**",
        "",
        "| # | area | input | outcome |",
        "|---|---|---|---|",
    ]
    for i, o in enumerate(outcomes, 1):
        label = {"refused": "refused", "argparse": "refused (argparse)", "accepted": "accepted",
                 "defect": "**DEFECT**"}[o.result]  # fmt: skip
        message = o.message.replace("|", "\\|").replace("\n", " ")
        if len(message) > 160:
            message = message[:157] + "..."
        lines.append(f"| {i} | {o.case.area} | `{o.case.what}` | {label}: {message} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the markdown table here")
    args = parser.parse_args()
    outcomes = [run_case(case) for case in catalogue()]
    text = markdown(outcomes)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    bad = [o for o in outcomes if not o.ok]
    print(f"{len(outcomes)} cases, {len(bad)} defects")
    for o in bad:
        print(f"DEFECT: {o.case.area}: {o.case.what}: {o.result}: {o.message}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
