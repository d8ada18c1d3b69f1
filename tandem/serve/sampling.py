"""Per-request token choice (greedy, temperature, nucleus) and the text a request may show so far (stop strings)."""

from __future__ import annotations

import torch

from ..engine.sampling import sample


def choose_token(logits: torch.Tensor, temperature: float, top_p: float, seed: int, step: int) -> int:
    """One token from float logits [V]: the argmax at temperature 0, else a draw from softmax(logits / T)
    restricted to the smallest set of most likely tokens whose mass reaches `top_p`: the engine's draw
    (`tandem.engine.sampling.sample`) for the request's `seed` (an int64) at its `step`-th token."""
    if temperature == 0:
        return int(logits.argmax())
    row = dict(device=logits.device)
    return int(
        sample(
            logits[None], torch.tensor([float(temperature)], **row), torch.tensor([float(top_p)], **row),
            torch.tensor([seed], dtype=torch.int64, **row), torch.tensor([step], dtype=torch.int64, **row),
            nucleus=top_p < 1,
        )[0]
    )  # fmt: skip


class TextStream:
    """The decoded text of a request's generated tokens, released piece by piece.

    Text is released only when it can no longer change: not ending in a partial UTF-8 character, and not a
    possible beginning of a stop string (which is then held back until it either completes or cannot). `push`
    returns the newly releasable text; once a stop string appears, the text before it is final."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.sent = 0  # characters released
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return self._release(final=False)

    def finish(self) -> str:
        """Whatever is still held back, at the end of generation (a stop string found is cut off)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self.text
        hit = min(
            (i for i in (text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stop) if i >= 0),
            default=-1,
        )
        if hit >= 0:
            self.stopped = True
            self.text = text = text[:hit]
            end = hit
        elif final:
            end = len(text)
        else:
            end = len(text)
            if text.endswith("\ufffd"):  # a character still being completed by the next token
                end = len(text.rstrip("\ufffd"))
            for s in self.stop:  # hold back a suffix that may become a stop string
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if text[end - k : end] == s[:k]:
                        end -= k
                        break
        end = max(end, self.sent)
        piece = text[self.sent : end]
        self.sent = end
        return piece
