"""Trainer.fit reads top to bottom in one screen, as nanoGPT's loop does: at most 60 lines from `def fit` to its
last line (what it does besides the loop lives in named helpers). Parses the source; imports nothing."""

from __future__ import annotations

import ast
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[1] / "src" / "paratrain" / "train" / "trainer.py"
MAX_LINES = 60


def method_lines(source: str, cls: str, name: str) -> int:
    """Lines of `cls.name` in `source`, from its `def` to its last line (decorators aside)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item.end_lineno - item.lineno + 1
    raise AssertionError(f"{cls}.{name} not found")


def test_trainer_fit_is_at_most_60_lines():
    lines = method_lines(TRAINER.read_text(), "Trainer", "fit")
    assert lines <= MAX_LINES, f"Trainer.fit is {lines} lines (at most {MAX_LINES}): move a separate job into a helper"


def test_a_long_method_is_counted():
    body = "\n".join(f"        x{i} = {i}" for i in range(61))
    source = f"class Trainer:\n    @property\n    def fit(self):\n{body}\n\n    def other(self):\n        pass\n"
    assert method_lines(source, "Trainer", "fit") == 62
    assert method_lines(source, "Trainer", "other") == 2
