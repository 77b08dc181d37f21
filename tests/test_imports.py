"""Imports go one way: no import circle between files of src/, and packages only import those below them
(cli -> bench/doctor/launchers -> calibrate -> plan -> train -> parallel -> models), as docs/architecture.md
says. Walks the source with ast (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "paratrain"
# lower index = lower layer; a package may import its own layer and anything below it
LAYERS = [{"errors", "gpu_catalog"}, {"models"}, {"interop"}, {"parallel"}, {"config"}, {"train"}, {"plan"}, {"calibrate"},
          {"bench", "doctor", "launchers"}, {"cli", "env_report", "api", "__init__"}]


def module_graph() -> dict[str, set[str]]:
    names = {}
    for path in SRC.rglob("*.py"):
        parts = ("paratrain", *path.relative_to(SRC).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
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
    assert layer_of("paratrain.models.llama") < layer_of("paratrain.parallel.layout") < layer_of("paratrain.plan.time")
