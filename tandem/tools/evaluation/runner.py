"""Runs policies x tasks x lengths x samples on one model and gathers per-run records and per-cell summaries.

Generation tasks: greedy decoding of each prompt through a fresh Tandem cache per policy variant; with
`check_hf`, also through transformers' `DynamicCache` so `full` can be checked token for token.
Document tasks (`ppl`, `error`): one teacher-forced pass per document and variant: prefill all but the last
`ppl_tokens` tokens, then feed those one at a time through the cache, so the sparse path predicts each token;
on `error_steps` evenly spaced steps the probe compares every layer's output with exact attention.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ...config import FEATURES, MOVED, POLICIES, HostConfig, TandemConfig, moved_message, uses_engine
from ...config.settings import WORDS, parse_setting
from ...integrations.hf import TandemCache, generate_cache_kwargs
from ...models import attention_shape, end_of_sequence_ids
from ...policies.fluxion import resolve_profile
from .haystack import Haystack
from .metrics import AttentionProbe, perplexity
from .names import CORE_SETTABLE, DOCUMENT_TASKS, GENERATION_TASKS, SETTABLE, TASKS
from .tasks import TaskBuilder, score_answer


@dataclass
class Variant:
    """One policy with its settings; `label` names it in results ("quest" or "quest[budget=0.02]")."""

    label: str
    config: TandemConfig
    overrides: dict = field(default_factory=dict)

    @property
    def policy(self) -> str:
        return self.config.policy


@dataclass
class EvalPlan:
    """What to run. Build it with `make_plan`, which validates every field and names the offending argument."""

    variants: list[Variant]
    tasks: list[str]
    lengths: list[int]
    samples: int = 3
    seed: int = 0
    ppl_tokens: int = 128
    error_steps: int = 8
    check_hf: bool = False

    @property
    def baseline(self) -> str | None:
        """Label of the variant that Δ is measured against: the first `full` one."""
        return next((v.label for v in self.variants if v.policy == "full"), None)


# ---- parsing and validation ---------------------------------------------------------------------------------
def parse_names(spec: str | Sequence[str], allowed: Sequence[str], argument: str) -> list[str]:
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(
            f"{argument}: unknown {', '.join(map(repr, bad)) or 'empty list'}; allowed: {', '.join(allowed)}"
        )
    return list(dict.fromkeys(names))


def parse_lengths(
    spec: str | Sequence[str | int],
    argument: str = "--lengths",
    minimum: int = 256,
    what: str = "context length",
    example: str = "1000 or 1k, 2k, 4k",
) -> list[int]:
    """'1k,2k,4096' -> [1024, 2048, 4096] (k = 1024), sorted, each a whole number >= `minimum`.

    `argument`, `what` and `example` name the command-line option in the error (also used by `tandem bench`).
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    unit = "token counts" if "length" in what else "whole numbers"
    lengths = []
    for item in items:
        text = str(item).strip().lower()
        try:
            value = float(text[:-1]) * 1024 if text.endswith("k") else float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value != int(value) or value < minimum:
            raise ValueError(
                f"{argument}: {str(item)!r} is not a {what}: use {unit} >= {minimum} such as {example} (k = 1024)"
            )
        lengths.append(int(value))
    if not lengths:
        raise ValueError(f"{argument}: empty; use e.g. {example}")
    return sorted(set(lengths))


def make_variants(
    policies: Sequence[str], sets: Sequence[str] = (), cpu_threads: int | None = None
) -> list[Variant]:
    """One variant per policy, or per combination of `--set` values where a policy is swept.

    sets: items "key=v1,v2", key in SETTABLE: a core field, or a field of a sub-config every policy reads
    ("host.dtype"), applies to every policy ("window_tokens"), or to one ("quest.window_tokens",
    "quest.host.dtype"); a policy's sub-config field ("quest.budget", "certified.epsilon") to the policies in
    --policies that read that sub-config. Values as `config.parse_setting` reads them.
    """
    sweeps: dict[str, dict[str, list]] = {p: {} for p in policies}
    for item in sets:
        name, eq, values = item.partition("=")
        name = name.strip()
        target, dot, key = name.rpartition(".")
        head, _, rest = name.partition(".")
        if not eq or not key or not values.strip():
            raise ValueError(f"--set {item!r}: expected key=v1,v2 (e.g. quest.budget=0.02,0.05)")
        if not dot and key in MOVED:
            raise ValueError(f"--set {item!r}: {moved_message(key)}")
        if dot and target in FEATURES and name in SETTABLE:
            readers = FEATURES[target].POLICIES
            targets = [p for p in policies if readers is None or p in readers]
            if not targets:
                raise ValueError(
                    f"--set {item!r}: {target} settings apply only to policies {', '.join(readers)}, none of "
                    f"which is in --policies ({', '.join(policies)})"
                )
            setting = name
        elif head in POLICIES and _every_policy_reads(rest):
            targets, setting = [_listed(head, policies, item)], rest
        elif key in CORE_SETTABLE and (not dot or target in POLICIES):
            targets, setting = ([_listed(target, policies, item)] if dot else list(policies)), key
        elif dot and target in POLICIES and key in MOVED:
            new = ".".join(MOVED[key])
            if FEATURES[MOVED[key][0]].POLICIES is None:
                new = f"{target}.{new}"  # still on that one policy
            raise ValueError(f"--set {item!r}: {key!r} moved to {new}: use --set {new}={values.strip()}")
        elif name == "host.threads":
            raise ValueError(f"--set {item!r}: the CPU attention threads are --cpu-threads, not a sweep")
        else:
            raise ValueError(f"--set {item!r}: unknown key {name!r}; allowed: {', '.join(SETTABLE)}")
        try:
            parsed = [parse_setting(setting, v.strip()) for v in values.split(",")]
        except ValueError as err:
            raise ValueError(f"--set {item!r}: {err}") from None
        for policy in targets:
            sweeps[policy][setting] = parsed
    variants = []
    for policy in policies:
        keys = list(sweeps[policy])
        for combo in itertools.product(*(sweeps[policy][k] for k in keys)):
            overrides = dict(zip(keys, combo))
            try:
                config = TandemConfig(policy=policy, host=HostConfig(threads=cpu_threads)).with_settings(
                    overrides
                )
            except ValueError as err:
                raise ValueError(f"--set {_label(policy, overrides)}: {err}") from None
            label = _label(policy, overrides)
            variants.append(Variant(label, config, overrides))
    return variants


def _every_policy_reads(name: str) -> bool:
    """Whether `name` is a settable field of a sub-config every policy reads ("host.dtype")."""
    key, dot, _ = name.partition(".")
    return bool(dot) and name in SETTABLE and key in FEATURES and FEATURES[key].POLICIES is None


def _listed(policy: str, policies: Sequence[str], item: str) -> str:
    if policy not in policies:
        raise ValueError(f"--set {item!r}: policy {policy!r} is not in --policies ({', '.join(policies)})")
    return policy


# a sub-config field's name in a variant's label: its flat name of earlier versions, so that labels (and the
# results that name them, which the simulator's calibration reads) stay as they were: "quest[budget=0.02]"
_LABEL_NAMES = {".".join(path): name for name, path in MOVED.items()}


def _label(policy: str, overrides: dict) -> str:
    shown = (
        f"{_LABEL_NAMES.get(k, k)}={WORDS.get(k, 'none') if v is None else v}" for k, v in overrides.items()
    )
    return policy + (f"[{','.join(shown)}]" if overrides else "")


def make_plan(
    policies=POLICIES,
    tasks="niah,multikey,multivalue,vt,cwe,ppl,error",
    lengths="1k,2k,4k",
    samples: int = 3,
    sets: Sequence[str] = (),
    seed: int = 0,
    ppl_tokens: int = 128,
    error_steps: int = 8,
    check_hf: bool = False,
    cpu_threads: int | None = None,
) -> EvalPlan:
    """Validate everything that does not need the model; raises ValueError naming the argument."""
    policy_names = parse_names(policies, POLICIES, "--policies")
    task_names = parse_names(tasks, TASKS, "--tasks")
    if isinstance(samples, bool) or not isinstance(samples, int) or not 1 <= samples <= 10_000:
        raise ValueError(f"--samples={samples!r} is out of range: allowed an integer >= 1")
    if not 2 <= ppl_tokens <= 1 << 20:
        raise ValueError(f"--ppl-tokens={ppl_tokens} is out of range: allowed an integer >= 2")
    if not 1 <= error_steps <= ppl_tokens - 1:
        raise ValueError(f"--error-steps={error_steps} is out of range: allowed 1 .. --ppl-tokens - 1")
    plan = EvalPlan(
        make_variants(policy_names, sets, cpu_threads),
        task_names,
        parse_lengths(lengths),
        samples,
        seed,
        ppl_tokens,
        error_steps,
        check_hf,
    )
    if any(t in DOCUMENT_TASKS for t in task_names) and ppl_tokens >= min(plan.lengths) // 2:
        raise ValueError(
            f"--ppl-tokens={ppl_tokens} must be less than half the shortest length ({min(plan.lengths)})"
        )
    return plan


def check_lengths(lengths: Sequence[int], max_positions: int | None) -> None:
    if max_positions is not None and max(lengths) > max_positions:
        raise ValueError(
            f"--lengths: {max(lengths)} tokens exceed the model's maximum of {max_positions} positions "
            "(config.max_position_embeddings); allowed lengths are <= that"
        )


def check_profiles(variants: Sequence[Variant], text_config) -> None:
    """Refuse, before any run, a fluxion variant whose profile is missing, of another model, or lacks its tau
    (the check `TandemCache.for_model` makes), naming the variant and the argument that set it."""
    shape = attention_shape(text_config)
    for variant in variants:
        if variant.policy != "fluxion":
            continue
        try:
            resolve_profile(variant.config, *shape)
        except (ValueError, FileNotFoundError) as err:
            where = f"--set {variant.label}" if variant.overrides else "--policies fluxion"
            raise type(err)(f"{where}: {err}") from None


FLUXION_STATISTICS = ("streaming_head_share", "mean_head_budget", "granularity_share")


def cache_statistics(cache: TandemCache) -> dict:
    """What a run records of its cache's decode statistics: the fraction of host entries attended and, for
    `fluxion`, the share of streaming head-steps, the mean per-head budget and the share of groups per block
    size (`TandemCache.stats`)."""
    stats = cache.stats()
    out = {"fraction_attended": stats["mean_fraction_attended"]}
    out.update({k: stats[k] for k in FLUXION_STATISTICS if k in stats})
    return out


# ---- running ------------------------------------------------------------------------------------------------
class Runner:
    """Runs an `EvalPlan` on a loaded model. `on_sample(results)` is called after each sample (every variant
    of it run), so that a long run keeps what it has measured when stopped.

    engine: how a Tandem variant generates: "on" through Tandem's engine (`TandemRunner.generate`: chunked
    prefill, a CUDA graph per decode step on a GPU), "off" through model.generate with the cache, "auto" (the
    default) the engine on CUDA. The DynamicCache reference (`check_hf`) always runs model.generate."""

    def __init__(
        self,
        model,
        tokenizer,
        plan: EvalPlan,
        haystack: Haystack,
        progress: bool = True,
        engine: str = "auto",
    ) -> None:
        text_config = model.config.get_text_config(decoder=True)
        check_lengths(plan.lengths, getattr(text_config, "max_position_embeddings", None))
        check_profiles(plan.variants, text_config)
        self.model, self.tokenizer, self.plan, self.haystack = model, tokenizer, plan, haystack
        self.builder = TaskBuilder(tokenizer, haystack, seed=plan.seed)
        self.device = next(model.parameters()).device
        self.engine = uses_engine(engine, self.device.type)
        self.progress = progress
        self.runs: list[dict] = []

    def total_runs(self) -> int:
        plan = self.plan
        gen = sum(t in GENERATION_TASKS for t in plan.tasks) * (len(plan.variants) + plan.check_hf)
        doc = len(plan.variants) if any(t in DOCUMENT_TASKS for t in plan.tasks) else 0
        return (gen + doc) * len(plan.lengths) * plan.samples

    def run(self, on_sample: Callable[[list[dict]], None] | None = None) -> list[dict]:
        from tqdm.auto import tqdm

        plan = self.plan
        bar = tqdm(total=self.total_runs(), desc="tandem eval", unit="run", disable=not self.progress)
        with torch.inference_mode():
            for length in plan.lengths:
                for task in plan.tasks:
                    if task == "error" and "ppl" in plan.tasks:
                        continue  # measured in the same pass as ppl
                    if task in GENERATION_TASKS:
                        self._generation_cell(task, length, bar, on_sample)
                    else:
                        self._document_cell(length, bar, on_sample)
        bar.close()
        return self.runs

    # ---- generation tasks -----------------------------------------------------------------------------------
    def _generation_cell(self, task: str, length: int, bar, on_sample=None) -> None:
        for sample in self.builder.samples(task, length, self.plan.samples):
            reference = None
            if self.plan.check_hf:
                bar.set_postfix_str(f"{task} {length} #{sample.index} hf")
                reference, _, _ = self._generate(sample, DynamicCache())
                bar.update()
            for variant in self.plan.variants:
                bar.set_postfix_str(f"{task} {length} #{sample.index} {variant.label}")
                cache = TandemCache.for_model(self.model, variant.config)
                tokens, output, seconds = self._generate(sample, cache)
                record = {
                    "task": task,
                    "length": length,
                    "policy": variant.label,
                    "sample": sample.index,
                    "prompt_tokens": sample.input_ids.shape[1],
                    "score": score_answer(output, sample.answers),
                    **cache_statistics(cache),
                    "output": output,
                    "answers": list(sample.answers),
                    "info": sample.info,
                    "seconds": round(seconds, 2),
                    "engine": self.engine,  # generated through TandemRunner (else model.generate)
                }
                if reference is not None:
                    record["hf_identical"] = tokens == reference
                    record["hf_score"] = score_answer(self._decode(reference), sample.answers)
                self.runs.append(record)
                bar.update()
            if on_sample is not None:
                on_sample(self.runs)

    def _generate(self, sample, cache) -> tuple[list[int], str, float]:
        ids = sample.input_ids.to(self.device)
        start = time.perf_counter()
        if self.engine and isinstance(cache, TandemCache):
            from ...engine import TandemRunner

            runner = TandemRunner(self.model, cache)
            new = runner.generate(ids, sample.max_new_tokens, stop_ids=end_of_sequence_ids(self.model))
            tokens = new.tolist()
            return tokens, self._decode(tokens), time.perf_counter() - start
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=sample.max_new_tokens,
            do_sample=False,
            pad_token_id=self.tokenizer.pad_token_id,
            **generate_cache_kwargs(self.model, cache),
        )
        tokens = out[0, ids.shape[1] :].tolist()
        return tokens, self._decode(tokens), time.perf_counter() - start

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ---- document tasks (perplexity during decode, attention-output error) ----------------------------------
    def _document_cell(self, length: int, bar, on_sample=None) -> None:
        plan = self.plan
        for index in range(plan.samples):
            doc = self.builder.document(length, index)
            for variant in plan.variants:
                bar.set_postfix_str(f"ppl/error {length} #{index} {variant.label}")
                result = self.decode_document(doc, variant.config)
                common = {"length": length, "policy": variant.label, "sample": index}
                if "ppl" in plan.tasks:
                    self.runs.append(
                        dict(
                            common,
                            task="ppl",
                            score=perplexity(result["nll_sum"], result["tokens"]),
                            nll_sum=result["nll_sum"],
                            tokens=result["tokens"],
                            **result["statistics"],
                            seconds=result["seconds"],
                        )
                    )
                if "error" in plan.tasks:
                    errors = result["errors"]  # [steps, layers, Hq]
                    self.runs.append(
                        dict(
                            common,
                            task="error",
                            score=float(errors.mean()),
                            max_error=float(errors.max()),
                            layer_head_error=errors.mean(dim=0).tolist(),
                            steps=errors.shape[0],
                            **result["statistics"],
                        )
                    )
                    if result["certified"] is not None and result["certified"].numel():
                        # quest's certified bound of the same steps, in the error's units (>= it, head by head)
                        self.runs[-1]["certified_error"] = float(result["certified"].mean())
                        self.runs[-1]["max_certified_error"] = float(result["certified"].max())
                    # fluxion's statistics are over every step, the fraction attended over the measured ones
                    self.runs[-1]["fraction_attended"] = result["step_fraction_attended"]
                bar.update()
            if on_sample is not None:
                on_sample(self.runs)

    def decode_document(self, doc: torch.Tensor, config: TandemConfig) -> dict:
        """Teacher-forced pass over doc [1, L]: prefill L - ppl_tokens tokens, then decode the rest one token
        at a time. Returns the summed NLL of the last ppl_tokens tokens, the probe's error samples and the cache's
        statistics over every decode step (`cache_statistics`; `step_fraction_attended`: the measured steps')."""
        plan = self.plan
        n = plan.ppl_tokens
        doc = doc.to(self.device)
        cache = TandemCache.for_model(self.model, config)
        kwargs = generate_cache_kwargs(self.model, cache)
        stride = max(1, (n - 1) // plan.error_steps)
        measured = set(
            range(n - 2, -1, -stride)[: plan.error_steps]
        )  # decode steps 0 .. n-2, late ones first
        probe = AttentionProbe(cache)
        start = time.perf_counter()
        nll = 0.0
        with probe.attached(self.model):
            logits = self.model(doc[:, :-n], use_cache=True, logits_to_keep=1, **kwargs).logits[:, -1]
            for step in range(n):
                target = doc[:, doc.shape[1] - n + step]
                nll += float(torch.nn.functional.cross_entropy(logits.float(), target))
                if step == n - 1:
                    break
                probe.armed = "error" in plan.tasks and step in measured
                probe.begin_step()
                logits = self.model(target[:, None], use_cache=True, **kwargs).logits[:, -1]
                probe.end_step()
        errors = torch.stack(probe.errors) if probe.errors else torch.zeros(0)
        certified = (
            None  # quest's certified bound of the measured steps, where the policy gave one every step
        )
        if probe.certified and len(probe.certified) == len(probe.errors):
            certified = torch.stack(probe.certified)
        return {
            "nll_sum": nll,
            "tokens": n,
            "errors": errors,
            "certified": certified,
            "statistics": cache_statistics(cache),
            "step_fraction_attended": sum(probe.fractions) / len(probe.fractions)
            if probe.fractions
            else None,
            "seconds": round(time.perf_counter() - start, 2),
        }


def evaluate(model, tokenizer, plan: EvalPlan, haystack: Haystack, progress: bool = False, meta=None) -> dict:
    """Run `plan` and return the results dict (cells, verdicts, runs; see `report.build_results`).

    Example:
        >>> plan = make_plan(policies="full,streaming", tasks="niah", lengths="1k", samples=3)
        >>> results = evaluate(model, tokenizer, plan, load_haystack())
        >>> [(c["policy"], c["score"]) for c in results["cells"]]
    """
    from .report import build_results

    runs = Runner(model, tokenizer, plan, haystack, progress=progress).run()
    return build_results(runs, plan, dict(meta or {}))
