"""The package's layers: every import of a Tandem module (at module level or inside a function) goes down or
sideways, never up, and no two groups of modules import each other.

    0  config, manifest, models, shapes, kernels  (no Tandem imports above them)
    1  policies (fluxion's runtime math included)
    2  cache
    3  attention
    4  integrations, engine, distributed
    5  serve
    6  the tools (`tandem.tools`: bench, eval, simulate, calibrate, the bad-input catalogue), the command line,
       the package itself

The runtime (levels 0-5) is what a deployment imports; the tools sit above it and are never imported by it.
"""

import ast
import re
import threading
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parent.parent / "tandem"
LEVELS = {
    "config": 0, "manifest": 0, "models": 0, "shapes": 0, "kernels": 0,
    "policies": 1, "cache": 2, "attention": 3, "integrations": 4, "engine": 4, "distributed": 4, "serve": 5,
    "tools": 6, "cli": 6,
}  # fmt: skip


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def group(module: str) -> str:
    """The layer group of a module: its subpackage (each tool its own group)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "tandem"
    if parts[1] == "tools" and len(parts) > 2:
        return f"tools.{parts[2]}"
    return parts[1]


def level(module: str) -> int:
    name = group(module)
    if name == "tandem":
        return 6
    return LEVELS[name.split(".")[0]]


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> list[tuple[str, int]]:
    """(imported Tandem module, line) for every import in the file, function-local ones included."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [
                (alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "tandem"
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "tandem":
                continue
            for alias in node.names:  # `from tandem import manifest` imports the submodule
                sub = f"{target}.{alias.name}"
                found.append((sub if _is_module(sub) else target, node.lineno))
    return found


def _edges():
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _module_name(path)
        for target, line in imports(path):
            if group(source) != group(target):
                edges.append((source, target, f"{path.relative_to(PACKAGE.parent)}:{line}"))
    return edges


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        level(_module_name(path))  # KeyError names a subpackage missing from LEVELS


def test_no_import_goes_up_a_layer():
    upward = [
        f"{where}: {source} (level {level(source)}) imports {target} (level {level(target)})"
        for source, target, where in _edges()
        if level(target) > level(source)
    ]
    assert not upward, "\n".join(upward)


def test_the_runtime_never_imports_the_tools():
    """What a deployment imports (levels 0-5) stands without `tandem.tools` (and the command line)."""
    found = [
        f"{where}: {source} imports {target}"
        for source, target, where in _edges()
        if level(source) < 6 and (target.startswith("tandem.tools") or target.startswith("tandem.cli"))
    ]
    assert not found, "\n".join(found)


def test_no_two_groups_import_each_other():
    graph: dict[str, set[str]] = {}
    for source, target, _ in _edges():
        graph.setdefault(group(source), set()).add(group(target))
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle between groups: " + " -> ".join(stack[stack.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_checker_sees_a_function_local_upward_import(tmp_path):
    fake = PACKAGE / "attention" / "_layering_probe.py"
    assert not fake.exists()
    fake.write_text("def f():\n    from ..engine import runner\n", encoding="utf-8")
    try:
        assert ("tandem.attention._layering_probe", "tandem.engine.runner") in [
            (s, t) for s, t, _ in _edges()
        ]
        with pytest.raises(AssertionError, match="imports tandem.engine.runner"):
            test_no_import_goes_up_a_layer()
    finally:
        fake.unlink()


def test_only_the_cpu_kernels_package_binds_the_compiled_library():
    """`kernels/cpu/_library.py` (ctypes bindings) stays behind `tandem.kernels.cpu`'s own API."""
    outside = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if not _module_name(path).startswith("tandem.kernels.cpu")
        for target, line in imports(path)
        if target == "tandem.kernels.cpu._library"
    ]
    assert not outside, outside


# ---- the engine's state stays the engine's -------------------------------------------------------------------
ENGINE_FREE = (
    "attention",
    "cache",
    "policies",
    "integrations",
)  # they serve every caller, the engine among them


def _own_attributes(paths) -> set[str]:
    """Names the code in `paths` gives its objects: what it assigns on `self`, and every function it defines
    (methods, and module functions reached as `module.name`)."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
    return names


ENGINE_STATE = (
    "runner.py",
    "step.py",
    "handoff.py",
    "sampling.py",
)  # the run's state: runner, step, hand-offs


def engine_only_state() -> set[str]:
    """Attributes only the engine's run-time objects hold (its runner, step, hand-off flags and sampler): what
    their classes assign on `self` and the functions they define, less the step context's contract (`attention.context.StepContext`, which
    the engine's step implements) and less whatever the engine-free packages' own classes also hold. (The
    engine's model code, `forward.py` and `fused.py`, holds model attributes, which everyone reads.)"""
    engine = _own_attributes(PACKAGE / "engine" / name for name in ENGINE_STATE)
    # reads of torch's, threading's and transformers' objects (`.forward`, `.start`, a Cache's `.layers`)
    engine -= set(dir(torch.nn.Module)) | set(dir(torch.Tensor)) | set(dir(threading.Thread)) | {"layers"}
    free = _own_attributes(path for name in ENGINE_FREE for path in sorted((PACKAGE / name).rglob("*.py")))
    return engine - free


def engine_reads(paths) -> list[str]:
    """`file:line attribute` for every read in `paths` of an attribute only the engine holds."""
    private = engine_only_state()
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{path}:{node.lineno} .{node.attr}")
    return found


DECODE_BRANCHES = ("one_cache", "pooled_rows")  # `attention.rows.decode_attention`'s two branches


def _decode_branch_calls(tree, names=DECODE_BRANCHES) -> list[tuple[str, int]]:
    """(name, line) of each call of a function of `names` (a decode branch), by name or as an attribute."""
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in names:
                calls.append((name, node.lineno))
    return calls


def test_every_decode_enters_through_one_function():
    """A layer's decode attention has one function, `attention.rows.decode_attention`: every caller (the HF
    drop-in, the engine's steps, the server's multi-request steps) enters there, and nothing else calls its two
    branches, over one cache (`decode.one_cache`) and over a multi-request step's pooled rows
    (`rows.pooled_rows`)."""
    entry = PACKAGE / "attention" / "rows.py"
    outside = [
        f"{path.relative_to(PACKAGE.parent)}:{line} calls {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != entry
        for name, line in _decode_branch_calls(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not outside, "decode attention entered past `decode_attention`:\n" + "\n".join(outside)
    callers = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path != entry
        and _decode_branch_calls(ast.parse(path.read_text(encoding="utf-8")), ("decode_attention",))
    }
    assert callers == {
        "attention/hybrid.py",
        "engine/forward.py",
    }  # the drop-in's layers; Tandem's own forward


def test_the_decode_entry_checker_sees_a_direct_call(tmp_path):
    tree = ast.parse(
        "from tandem.attention.decode import one_cache\nout = one_cache(layer, q, k, v, ok, 1.0, None)\n"
    )
    assert _decode_branch_calls(tree) == [("one_cache", 2)]


def test_attention_cache_policies_and_integrations_import_nothing_of_the_engine():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
        for name in ENGINE_FREE
        for path in sorted((PACKAGE / name).rglob("*.py"))
        for target, line in imports(path)
        if target.startswith("tandem.engine")
    ]
    assert not found, "\n".join(found)


def test_attention_cache_policies_and_integrations_read_no_engine_state():
    """They reach a fixed-address step only through its `StepContext`: no attribute the engine alone holds (its
    recorded graphs, hand-off flags, launcher, sampler, ...) is read there."""
    engine = engine_only_state()
    assert {
        "segments",
        "launcher",
        "warmup_steps",
        "capture",
        "replay",
        "warm_up",
    } <= engine  # it sees the engine
    paths = [path for name in ENGINE_FREE for path in sorted((PACKAGE / name).rglob("*.py"))]
    found = engine_reads(paths)
    assert not found, "\n".join(found)


def test_the_state_checker_sees_a_read_of_the_engines_graphs(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(cache, q):\n    cache.step_context.replay()\n    return cache.step_context.segments\n",
        encoding="utf-8",
    )
    assert sorted(line.split(" ")[-1] for line in engine_reads([probe])) == [".replay", ".segments"]


# ---- the sub-configs -------------------------------------------------------------------------------------------
def test_each_sub_config_is_read_by_the_module_it_names_and_the_config_layer_imports_none_of_them():
    """The sub-configs sit in the config layer (level 0, torch-free, so `import tandem` stays light); each names
    the module that reads it (`Feature.READER`, a level above), which must exist and read `config.<key>.`, while
    nothing in `tandem.config` imports a layer above it (`test_no_import_goes_up_a_layer` covers the package)."""
    from tandem.config import FEATURES

    for key, cls in FEATURES.items():
        assert level(cls.READER) > 0 and _is_module(cls.READER), cls.READER
        source = (
            PACKAGE.parent.joinpath(*cls.READER.split(".")).with_suffix(".py").read_text(encoding="utf-8")
        )
        assert re.search(rf"\b(config|cfg)\.{key}\.", source), f"{cls.READER} does not read config.{key}"
    config_imports = [
        target
        for path in (PACKAGE / "config").rglob("*.py")
        for target, _ in imports(path)
        if level(target) > 0
    ]
    assert not config_imports, config_imports
