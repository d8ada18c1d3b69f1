"""The package's layers: every import of a Tandem module (at module level or inside a function) goes down or
sideways, never up, and no two groups of modules import each other.

    0  config, manifest, models, shapes, kernels  (no Tandem imports above them)
    1  calibration's model-free math              (features, predictor, profile, search, replay)
    2  policies
    3  cache
    4  attention
    5  integrations, engine, distributed
    6  bench, evaluation, calibration's collection and command, simulator, serve, cli, the package itself
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tandem"
CALIBRATION_MATH = ("features", "predictor", "profile", "search", "replay")
LEVELS = {
    "config": 0, "manifest": 0, "models": 0, "shapes": 0, "kernels": 0,
    "policies": 2, "cache": 3, "attention": 4, "integrations": 5, "engine": 5, "distributed": 5,
    "bench": 6, "evaluation": 6, "simulator": 6, "cli": 6, "calibration": 6, "serve": 6,
}  # fmt: skip


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def group(module: str) -> str:
    """The layer group of a module: its subpackage, with calibration's math apart from its collection."""
    parts = module.split(".")
    if len(parts) == 1:
        return "tandem"
    if parts[1] == "calibration" and len(parts) > 2 and parts[2] in CALIBRATION_MATH:
        return "calibration-math"
    return parts[1]


def level(module: str) -> int:
    name = group(module)
    if name == "tandem":
        return 6
    if name == "calibration-math":
        return 1
    return LEVELS[name]


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
