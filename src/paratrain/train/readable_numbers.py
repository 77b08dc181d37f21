"""Counts as people read them: 2.91 M parameters, 124 M, 8.03 B; one document, two documents."""

from __future__ import annotations

_SCALES = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))


def readable_count(n: float) -> str:
    """Three significant figures and a scale letter: 2912384 -> '2.91 M', 8030261248 -> '8.03 B'."""
    for scale, letter in _SCALES:
        if abs(n) >= scale:
            return f"{n / scale:.3g} {letter}"
    return f"{n:g}"


def plural(n: int, noun: str) -> str:
    """'1 document', '3,012 documents'."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"
