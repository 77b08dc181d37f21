"""Imports go one way: no import circle between files of src/, and packages only import those below them
(cli -> bench/doctor/launchers/verify/convert -> calibrate -> plan -> train -> parallel -> models), as docs/architecture.md
says; and no module reaches a leading-underscore name of another paratrain module. Walks the source with ast
(nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "paratrain"
# lower index = lower layer; a package may import its own layer and anything below it
LAYERS = [{"errors", "gpu_catalog"}, {"models"}, {"interop"}, {"parallel"}, {"config"}, {"train"}, {"plan"}, {"calibrate"},
          {"bench", "doctor", "launchers", "verify", "convert"}, {"cli", "env_report", "api", "__init__"}]


def module_files() -> dict[str, Path]:
    names = {}
    for path in SRC.rglob("*.py"):
        parts = ("paratrain", *path.relative_to(SRC).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def module_graph() -> dict[str, set[str]]:
    names = module_files()
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("paratrain"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in names else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("paratrain"))
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, group in enumerate(LAYERS) if top in group)


def test_no_import_circle_between_files():
    assert find_cycle(module_graph()) is None, " -> ".join(find_cycle(module_graph()) or [])


def test_packages_import_only_downwards():
    wrong = [f"{a} -> {b}" for a, deps in module_graph().items() for b in deps if layer_of(b) > layer_of(a)]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_circle_and_an_upward_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert layer_of("paratrain.models.llama") < layer_of("paratrain.parallel.layout") < layer_of("paratrain.plan.costing.time")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def foreign_uses(source: str, module: str, modules: set[str]) -> list[str]:
    """Where `source` (the file of `module`) reaches into another paratrain module: a private name (`from
    paratrain.x import _name`, `x._name`, getattr(x, "_name")) or an assignment to any of its attributes
    (`x.name = ...`, setattr(x, ...): a patch of its globals), x being an imported paratrain module."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the paratrain module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "paratrain":
            for alias in node.names:
                if is_private(alias.name) and node.module != module:
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                if f"{node.module}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "paratrain":
                    bound[alias.asname or "paratrain"] = alias.name if alias.asname else "paratrain"

    def module_of(expr) -> str | None:
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute) and (outer := module_of(expr.value)):
            return f"{outer}.{expr.attr}" if f"{outer}.{expr.attr}" in modules else None
        return None

    for node in ast.walk(tree):
        target, name, assigns = None, None, False
        if isinstance(node, ast.Attribute):
            target, name = module_of(node.value), node.attr
            assigns = isinstance(node.ctx, (ast.Store, ast.Del))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            target, name = module_of(node.args[0]), node.args[1].value
            assigns = node.func.id in ("setattr", "delattr")
        if target and target != module and (assigns or is_private(name)):
            found.append(f"{node.lineno}: {'assigns ' if assigns else ''}{target}.{name}")
    return found


def test_no_module_reaches_into_another_ones_privates_or_patches_it():
    names = module_files()
    wrong = [f"{path.relative_to(SRC.parent)}:{where}" for name, path in sorted(names.items())
             for where in foreign_uses(path.read_text(), name, set(names))]
    assert not wrong, "\n".join(wrong)


PLANTED = """
import paratrain.plan.tracing.trace
import paratrain.parallel.ring_attention as ring
from paratrain.plan.costing import memory
from paratrain.plan.tracing.trace import _quiet, quiet_logs
from paratrain.plan.tracing.local_model import _nbytes as nbytes


def f(x):
    paratrain.plan.tracing.trace._recorder
    ring._row_tiles = None
    memory._from_chunks([], [], 1, False)
    getattr(ring, "_KV_TAG", 0)
    memory.GIB = 1
    setattr(ring, "ring_attention", f)
    x.y, x._z = ring.ring_attention, memory.GIB
    return x._private, paratrain.__name__, _own
"""


def test_the_checker_sees_private_names_and_patches():
    modules = set(module_files())
    assert set(foreign_uses(PLANTED, "paratrain.plan.tracing.units", modules)) == {
        "5: from paratrain.plan.tracing.trace import _quiet", "6: from paratrain.plan.tracing.local_model import _nbytes",
        "10: paratrain.plan.tracing.trace._recorder", "11: assigns paratrain.parallel.ring_attention._row_tiles",
        "12: paratrain.plan.costing.memory._from_chunks", "13: paratrain.parallel.ring_attention._KV_TAG",
        "14: assigns paratrain.plan.costing.memory.GIB",
        "15: assigns paratrain.parallel.ring_attention.ring_attention"}
    # a module's own private names and globals are its own business
    own = "from paratrain.plan.tracing.trace import _quiet\nimport paratrain.plan.tracing.trace as t\nt._quiet\nt.X = 1"
    assert foreign_uses(own, "paratrain.plan.tracing.trace", modules) == []
