"""The names a run's parallel options take, declared once: pipeline schedules, activation checkpointing modes,
context-parallel implementations. Plain tuples (no torch), read by the config, the CLI, the planner and the
checks alike."""

from __future__ import annotations

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # one stage per rank
MULTI_STAGE_SCHEDULES = ("interleaved-1f1b", "zero-bubble")  # any number of stages per rank
PP_SCHEDULES = (*SINGLE_STAGE_SCHEDULES, *MULTI_STAGE_SCHEDULES)
DEFAULT_PP_SCHEDULE = "1f1b"

AC_MODES = ("none", "selective", "full")  # from the least recomputation to the most
CP_IMPLS = ("ring", "ulysses")


def one_of(values: tuple[str, ...]) -> str:
    """`a | b | c`, as the CLI's help lists choices."""
    return " | ".join(values)
