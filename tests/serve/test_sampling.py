"""Token choice (greedy, temperature, nucleus, seeded) and `TextStream`, the text a request may show so far: stop
strings split across tokens are held back and cut, partial UTF-8 characters wait for their last byte."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.serve.sampling import TextStream, choose_token


class PieceTokenizer:
    """Token i decodes to the bytes `pieces[i]`; a multi-byte character split over two tokens decodes to U+FFFD
    until its last byte comes, as byte-level BPE tokenizers do."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, tokens, skip_special_tokens=True) -> str:
        return b"".join(self.pieces[t] for t in tokens).decode("utf-8", errors="replace")


PIECES = [b"Hel", b"lo", b" wor", b"ld", b"\xe2\x82", b"\xac", b"!"]  # the euro sign, e2 82 ac, over 2 tokens
PIECES += [b"ST", b"OP", b" S", b"T", b"xSTOPy", b"a", b"b"]
TOK = PieceTokenizer(PIECES)
T = {p.decode("utf-8", errors="replace"): i for i, p in enumerate(PIECES)}
EURO_HEAD, EURO_TAIL = 4, 5


def _pushes(stream: TextStream, tokens: list[int]) -> list[str]:
    return [stream.push(t) for t in tokens]


def test_text_is_released_token_by_token_without_stops():
    stream = TextStream(TOK, [])
    assert _pushes(stream, [T["Hel"], T["lo"], T[" wor"], T["ld"]]) == ["Hel", "lo", " wor", "ld"]
    assert stream.finish() == "" and not stream.stopped


def test_a_partial_utf8_character_waits_for_its_last_byte():
    stream = TextStream(TOK, [])
    assert _pushes(stream, [T["Hel"], EURO_HEAD, EURO_TAIL, T["!"]]) == ["Hel", "", "€", "!"]


def test_a_partial_character_at_the_end_is_released_by_finish():
    stream = TextStream(TOK, [])
    assert _pushes(stream, [T["a"], EURO_HEAD]) == ["a", ""]
    assert stream.finish() == "\ufffd"  # what decoding the tokens gives: nothing is lost


def test_a_stop_string_split_across_tokens_is_held_back_and_cut():
    stream = TextStream(TOK, ["STOP"])
    assert _pushes(stream, [T["Hel"], T[" S"], T["T"]]) == ["Hel", " ", ""]  # "ST" may begin "STOP"
    assert not stream.stopped
    assert stream.push(T["OP"]) == "" and stream.stopped
    assert stream.finish() == "" and stream.text == "Hel "


def test_a_held_back_prefix_that_does_not_become_the_stop_is_released():
    stream = TextStream(TOK, ["STOP"])
    assert _pushes(stream, [T["ST"], T["!"]]) == ["", "ST!"]
    assert stream.push(T["ST"]) == "" and stream.finish() == "ST"  # the end of generation releases it


def test_a_stop_string_inside_one_token():
    stream = TextStream(TOK, ["STOP"])
    assert _pushes(stream, [T["a"], T["xSTOPy"]]) == ["a", "x"]
    assert stream.stopped


def test_the_earliest_of_several_stop_strings_wins():
    stream = TextStream(TOK, ["ld", "lo w"])
    assert "".join(_pushes(stream, [T["Hel"], T["lo"], T[" wor"]])) == "Hel"
    assert stream.stopped


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=12),
    stops=st.lists(st.text(alphabet="STOPab !x", min_size=0, max_size=4), max_size=3),
)
def test_released_text_is_the_decoded_text_cut_at_the_first_stop(tokens, stops):
    """Whatever the tokens and stops: the pieces, pushed until the stream stops and then finished, add up to the
    decoded text cut before its first stop string; a stop is noticed on the token that completes it."""
    stream = TextStream(TOK, stops)
    released, n = "", 0
    while n < len(tokens) and not stream.stopped:  # once stopped, the scheduler pushes no more
        released += stream.push(tokens[n])
        n += 1
    stopped = stream.stopped
    released += stream.finish()
    text = TOK.decode(tokens[:n])
    hits = [text.find(s) for s in stops if s and s in text]
    assert released == (text[: min(hits)] if hits else text)
    assert stopped == bool(hits)
    if stopped and n > 1:
        assert not any(s and s in TOK.decode(tokens[: n - 1]) for s in stops)


# ---- choose_token -------------------------------------------------------------------------------------------------
def _draws(logits, temperature: float, top_p: float, seed: int, n: int, first: int = 0) -> list[int]:
    """A request's tokens at steps first .. first + n - 1 (the logits held fixed)."""
    return [choose_token(logits, temperature, top_p, seed, step) for step in range(first, first + n)]


def test_temperature_zero_is_the_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert choose_token(logits, 0.0, 1.0, 0, 0) == 1
    assert choose_token(logits, 0.0, 0.01, 0, 5) == 1


def test_a_small_top_p_keeps_only_the_top_token():
    logits = torch.tensor([1.0, 1.2, 0.9, 1.1])  # nearly flat: without the nucleus every token comes up
    assert set(_draws(logits, 1.0, 0.05, 3, 50)) == {1}
    assert len(set(_draws(logits, 1.0, 1.0, 3, 200))) == 4


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert set(_draws(logits, 1.0, 0.5, 5, 200)) == {0, 1}  # 0.4 < 0.5 <= 0.4 + 0.3
    assert set(_draws(logits, 1.0, 0.75, 5, 300)) == {0, 1, 2}


def test_draws_follow_the_tempered_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 4000

    def frequencies(temperature: float) -> torch.Tensor:
        return torch.bincount(torch.tensor(_draws(probs.log(), temperature, 1.0, 11, n)), minlength=3) / n

    assert torch.allclose(frequencies(1.0), probs, atol=0.03)
    sharpened = torch.softmax(probs.log() / 0.5, 0)  # temperature 0.5: p^2, renormalized
    assert torch.allclose(frequencies(0.5), sharpened, atol=0.03)
    assert math.isclose(float(sharpened[0]), 0.36 / 0.46, rel_tol=1e-5)


def test_the_same_seed_gives_the_same_draws():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert _draws(logits, 0.9, 0.95, 7, 20) == _draws(logits, 0.9, 0.95, 7, 20)
    assert _draws(logits, 0.9, 0.95, 7, 20) != _draws(logits, 0.9, 0.95, 8, 20)
    # a step's draw does not depend on the steps before it (a request resumed at step 10 draws the same)
    assert _draws(logits, 0.9, 0.95, 7, 10, first=10) == _draws(logits, 0.9, 0.95, 7, 20)[10:]
