"""Names the command line validates against, importable without torch (so `tandem --help` stays fast)."""

GENERATION_TASKS = ("niah", "multikey", "multivalue", "vt", "cwe")
DOCUMENT_TASKS = ("ppl", "error")
TASKS = GENERATION_TASKS + DOCUMENT_TASKS
# TandemConfig knobs a `--set policy.key=v1,v2` sweep may change (the rest are fixed by the harness or machine)
SETTABLE = (
    "sink_tokens",
    "window_tokens",
    "block_size",
    "budget",
    "beta",
    "maw_alpha",
    "span",
    "observation_tokens",
    "gpu_share",
    "gpu_cache",
    "huge_pages",
    "host_dtype",
    "host_split",
    "tau",
    "profile",
    "fluxion_mode",
    "granularity",
    "skip_streaming",
    "epsilon",
    "max_budget",
    "certify_bound",
    "certify_unit",
)
# of those, the knobs only `fluxion` reads: without 'POLICY.' a sweep of one changes the fluxion variants alone
FLUXION_SETTABLE = ("tau", "profile", "fluxion_mode", "granularity", "skip_streaming")
# the certified selection's knobs, read by `quest` and `fluxion`: without 'POLICY.' a sweep changes those two alone
CERTIFIED_SETTABLE = ("epsilon", "max_budget", "certify_bound", "certify_unit")
CERTIFIED_POLICIES = ("certified", "quest", "fluxion")
