"""Names the command line validates against, importable without torch (so `tandem --help` stays fast)."""

from ...config import setting_names

GENERATION_TASKS = ("niah", "multikey", "multivalue", "vt", "cwe")
DOCUMENT_TASKS = ("ppl", "error")
TASKS = GENERATION_TASKS + DOCUMENT_TASKS
# TandemConfig settings a `--set key=v1,v2` sweep may change (the rest are fixed by the harness or machine, the
# threads by --cpu-threads): core fields, which apply to every policy (or to one: `quest.window_tokens`), and the
# sub-configs' dotted fields, which apply to the policies that read them (`quest.budget` to quest,
# `certified.epsilon` to certified, quest, fluxion; `host.dtype` to every policy, or to one: `quest.host.dtype`)
CORE_SETTABLE = ("sink_tokens", "window_tokens", "block_size")
SETTABLE = CORE_SETTABLE + tuple(name for name in setting_names() if "." in name and name != "host.threads")
