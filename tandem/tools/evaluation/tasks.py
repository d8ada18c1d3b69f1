"""Task generators: every prompt and expected answer is built locally from a seed and the haystack prose.

Needle in a haystack (`niah`) plants one fact at depths 0..100%. The RULER-style tasks follow the task
descriptions of RULER (Hsieh et al., 2024): `multikey` (the asked key among distractor keys), `multivalue` (all
values of one key), `vt` (variable tracking: find every name in a chain `VAR A = 12345, VAR B = VAR A, ...`) and
`cwe` (the 10 most common words of a numbered list). `ppl` and `error` read a plain document instead (see
`runner.py`). Each prompt ends with the start of the answer, which small chat models need to answer at all.

Example:
    >>> builder = TaskBuilder(tokenizer, load_haystack(), seed=0)
    >>> sample = builder.samples("niah", 2048, count=3)[1]   # the needle at 50% depth
    >>> sample.input_ids.shape[1] <= 2048 - sample.max_new_tokens
    True
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .haystack import Haystack
from .names import GENERATION_TASKS

MAX_NEW_TOKENS = {"niah": 12, "multikey": 12, "multivalue": 40, "vt": 30, "cwe": 40}
NUM_KEYS = 4  # multikey: the asked key and 3 distractors
NUM_VALUES = 4  # multivalue
NUM_HOPS = 4  # vt: a chain of NUM_HOPS + 1 variables
NUM_COMMON = 10  # cwe

_READ = "Read the text and answer the question.\n\n"


@dataclass
class Sample:
    """One prompt of a generation task. Score = fraction of `answers` found in the output (RULER's
    string_match_all; for one answer that is an exact match of the answer string)."""

    task: str
    length: int  # context budget: prompt + generated tokens <= length
    index: int
    input_ids: torch.Tensor  # [1, T] int64, T <= length - max_new_tokens
    answers: tuple[str, ...]
    max_new_tokens: int
    info: dict = field(default_factory=dict)


def score_answer(output: str, answers: tuple[str, ...]) -> float:
    """Fraction of expected answers that appear in the output, case-insensitively, in [0, 1]."""
    text = output.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


class TaskBuilder:
    """Builds samples of every task for one tokenizer and haystack. `chat=None` uses the tokenizer's chat
    template when it has one (instruct models) and a plain completion prompt otherwise (base models)."""

    def __init__(self, tokenizer, haystack: Haystack, seed: int = 0, chat: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.seed = seed
        self.chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
        self.hay_ids: list[int] = tokenizer(haystack.text, add_special_tokens=False).input_ids
        self.words = haystack.words()
        if len(self.words) < 200:
            raise ValueError(f"the haystack has only {len(self.words)} distinct words; 200 are needed")

    # ---- public ---------------------------------------------------------------------------------------------
    def samples(self, task: str, length: int, count: int) -> list[Sample]:
        """`count` samples of a generation task whose prompt + answer fit in `length` tokens."""
        if task not in GENERATION_TASKS:
            raise ValueError(f"task {task!r} is not a generation task: allowed {', '.join(GENERATION_TASKS)}")
        make = getattr(self, f"_{task}")
        return [make(length, i, count, self._rng(task, length, i)) for i in range(count)]

    def document(self, length: int, index: int) -> torch.Tensor:
        """[1, length] int64: a stretch of the haystack for teacher-forced decoding (perplexity, error)."""
        rng = self._rng("document", length, index)
        return torch.tensor([self._hay_slice(rng.randrange(len(self.hay_ids)), length)], dtype=torch.long)

    # ---- tasks ----------------------------------------------------------------------------------------------
    def _niah(self, length, index, count, rng) -> Sample:
        depth = index / (count - 1) if count > 1 else 0.5
        number = str(rng.randint(1_000_000, 9_999_999))
        return self._haystack_sample(
            "niah",
            length,
            index,
            rng,
            needles=[(depth, f"The special magic number is {number}.")],
            question="Question: What is the special magic number mentioned in the text?",
            answer_prefix="The special magic number is",
            answers=(number,),
            info={"depth": depth},
        )

    def _multikey(self, length, index, count, rng) -> Sample:
        keys = self._keys(rng, NUM_KEYS)
        values = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
        depths = sorted(rng.random() for _ in keys)
        target = rng.randrange(NUM_KEYS)
        key = keys[target]
        return self._haystack_sample(
            "multikey",
            length,
            index,
            rng,
            needles=[
                (d, f"One of the special magic numbers for {k} is: {v}.")
                for d, k, v in zip(depths, keys, values)
            ],
            question=f"Question: What is the special magic number for {key} mentioned in the provided text?",
            answer_prefix=f"The special magic number for {key} mentioned in the provided text is",
            answers=(values[target],),
            info={"depth": depths[target], "distractors": NUM_KEYS - 1},
        )

    def _multivalue(self, length, index, count, rng) -> Sample:
        key = self._keys(rng, 1)[0]
        values = [str(rng.randint(1_000_000, 9_999_999)) for _ in range(NUM_VALUES)]
        depths = sorted(rng.random() for _ in values)
        return self._haystack_sample(
            "multivalue",
            length,
            index,
            rng,
            needles=[
                (d, f"One of the special magic numbers for {key} is: {v}.") for d, v in zip(depths, values)
            ],
            question=f"Question: What are all the special magic numbers for {key} mentioned in the provided text?",
            answer_prefix=f"The special magic numbers for {key} mentioned in the provided text are",
            answers=tuple(values),
            info={"depths": depths},
        )

    def _vt(self, length, index, count, rng) -> Sample:
        names: list[str] = []
        while len(names) < NUM_HOPS + 1:
            name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if name not in names:
                names.append(name)
        value = str(rng.randint(10_000, 99_999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        depths = sorted(rng.random() for _ in chain)
        return self._haystack_sample(
            "vt",
            length,
            index,
            rng,
            needles=list(zip(depths, chain)),
            question=f"Question: Find all variables that are assigned the value {value} in the text above.",
            answer_prefix=(
                "Answer: According to the chain(s) of variable assignment in the text above, "
                f"{len(names)} variables are assigned the value {value}, they are:"
            ),
            answers=tuple(names),
            info={"depths": depths},
            intro="Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n",
        )

    def _cwe(self, length, index, count, rng) -> Sample:
        pool = rng.sample(self.words, len(self.words))
        common, rare = pool[:NUM_COMMON], pool[NUM_COMMON:]
        order_seed = rng.random()

        def build(items: int) -> str:
            # RULER repeats 10 common words 30 times and the others 3 times; short contexts scale that down
            freq_common = min(30, max(3, round(0.04 * items)))
            freq_rare = max(1, min(3, freq_common // 4))
            rare_count = min(len(rare), max(0, items - NUM_COMMON * freq_common) // freq_rare)
            words = common * freq_common + rare[:rare_count] * freq_rare
            random.Random(order_seed).shuffle(words)
            listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
            body = (
                "Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n" + listing
            )
            return self._prompt(
                body,
                f"Question: What are the {NUM_COMMON} most common words in the above list?",
                f"Answer: The top {NUM_COMMON} words that appear most often in the list are:",
            )

        max_new = MAX_NEW_TOKENS["cwe"]
        ids, items = self._fit(build, length - max_new, start=50)
        return Sample("cwe", length, index, ids, tuple(common), max_new, {"list_items": items})

    # ---- helpers --------------------------------------------------------------------------------------------
    def _haystack_sample(
        self, task, length, index, rng, needles, question, answer_prefix, answers, info, intro=_READ
    ) -> Sample:
        offset = rng.randrange(len(self.hay_ids))

        def build(hay_tokens: int) -> str:
            hay = self.tokenizer.decode(self._hay_slice(offset, hay_tokens))
            return self._prompt(intro + _insert(hay, needles), question, answer_prefix)

        max_new = MAX_NEW_TOKENS[task]
        ids, hay_tokens = self._fit(build, length - max_new, start=0)
        return Sample(task, length, index, ids, answers, max_new, dict(info, haystack_tokens=hay_tokens))

    def _prompt(self, body: str, question: str, answer_prefix: str) -> str:
        if self.chat:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{body}\n\n{question}"}],
                add_generation_prompt=True,
                tokenize=False,
            )
            return text + answer_prefix
        return f"{body}\n\n{question}\n\n{answer_prefix}"

    def _fit(self, build: Callable[[int], str], target: int, start: int) -> tuple[torch.Tensor, int]:
        """Largest size n (within a few tokens) with len(tokens(build(n))) <= target; sizes grow ~linearly."""
        base = len(self._encode(build(start)))
        if base > target:
            raise ValueError(
                f"--lengths: {target} prompt tokens cannot hold this task's question and answer ({base} tokens)"
            )
        probe = start + max(16, (target - base) // 4)
        slope = max(1e-3, (len(self._encode(build(probe))) - base) / (probe - start))
        n = start + int((target - base) / slope)
        best = (start, None)
        for _ in range(8):
            ids = self._encode(build(n))
            if len(ids) <= target:
                best = max(best, (n, ids), key=lambda b: b[0])
                if target - len(ids) < 8:
                    break
            n = max(start, n + int((target - len(ids)) / slope) - (1 if len(ids) > target else 0))
        n, ids = best
        if ids is None:
            ids = self._encode(build(n))
        return torch.tensor([ids], dtype=torch.long), n

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def _hay_slice(self, offset: int, count: int) -> list[int]:
        ids = self.hay_ids
        reps = (offset + count) // len(ids) + 1
        return (ids * reps)[offset : offset + count] if reps > 1 else ids[offset : offset + count]

    def _keys(self, rng: random.Random, count: int) -> list[str]:
        keys: list[str] = []
        while len(keys) < count:
            key = f"{rng.choice(self.words)}-{rng.choice(self.words)}"
            if key not in keys:
                keys.append(key)
        return keys

    def _rng(self, task: str, length: int, index: int) -> random.Random:
        return random.Random(f"{self.seed}/{task}/{length}/{index}")


def _insert(hay: str, needles: list[tuple[float, str]]) -> str:
    """Place each (depth, sentence) at the sentence boundary just before depth * len(hay)."""
    cuts = []
    for depth, sentence in needles:
        pos = int(len(hay) * depth)
        if depth >= 1.0:
            cut = len(hay)
        else:
            found = hay.rfind(". ", 0, pos)
            cut = found + 2 if found >= 0 else 0
        cuts.append((cut, sentence))
    cuts.sort(key=lambda c: c[0])
    parts, last = [], 0
    for cut, sentence in cuts:
        parts.append(hay[last:cut])
        parts.append(f" {sentence} ")
        last = cut
    parts.append(hay[last:])
    return "".join(parts)
