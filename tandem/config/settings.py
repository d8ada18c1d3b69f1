"""Command-line text of a setting (`--set quest.budget=0.1`) as the value `TandemConfig.with_settings` takes."""

from __future__ import annotations

from .core import parse_number

# the word for None (the shipped profile, Eq. 3 per group, the model's dtype, the unit by the bound)
WORDS = {
    "fluxion.profile": "default",
    "fluxion.granularity": "none",
    "host.dtype": "none",
    "certified.unit": "none",
}
NAMES = (
    "fluxion.profile",
    "fluxion.mode",
    "host.dtype",
    "distributed.host_split",
    "certified.bound",
    "certified.unit",
)
SWITCHES = ("host.huge_pages", "fluxion.skip_streaming")


def parse_setting(key: str, text: str):
    """One `--set` value of setting `key` (a core field or a dotted sub-config field): a path for
    `fluxion.profile` ('default': the shipped one), a name for `fluxion.mode`, `certified.bound`, `certified.unit`
    ('none': by the bound), `distributed.host_split` and `host.dtype` ('none': the model's dtype), 0 or 1 for a
    switch, 'none' or a number for `fluxion.granularity`, a number otherwise.

    Range checks are TandemConfig's; this raises ValueError only for text that cannot be such a value.
    """
    if not text:
        raise ValueError("empty value")
    if text.lower() == WORDS.get(key):
        return None
    if key in NAMES or key == "policy":
        return text
    if key in SWITCHES:
        if text not in ("0", "1"):
            raise ValueError(f"{text!r} is not 0 or 1")
        return int(text)
    try:
        return parse_number(text)
    except ValueError:
        word = f" or {WORDS[key]!r}" if key in WORDS else ""
        raise ValueError(f"{text!r} is not a number{word}") from None
