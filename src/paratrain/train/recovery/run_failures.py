"""A failed run in one line: collective timeouts and lost peers named by operation and step, and RunFailed.

Killing or stalling a rank on purpose is no part of paratrain: tests do it through the trainer's hooks
(tests/support/kill_stall.py, docs/reliability.md).
"""

from __future__ import annotations

import traceback

from paratrain.errors import CheckFailed

_TIMEOUT_WORDS = ("timed out", "timeout", "deadline exceeded")
_PEER_LOST_WORDS = ("connection closed by peer", "connection reset", "broken pipe", "connection refused")
# where a collective hides in our own code when torch gives no Python frame for it (DDP's backward hooks)
_CONTEXT = {
    "forward_backward": "forward/backward (gradient all-reduce or parameter all-gather)",
    "global_loss": "the loss all-reduce",
    "clip_grad_norm": "the gradient-norm all-reduce",
    "optimizer_step": "the optimizer step",
    "save": "a checkpoint save",
    "load": "a checkpoint load",
    "init_runtime": "process-group setup",
    "parallelize": "model setup",
}


class CollectiveFailure(CheckFailed, RuntimeError):
    """A collective timed out or lost a peer: the message names the operation and the step. As a CheckFailed
    it is one line and exit 1 in-process too (a lone process runs the worker inline)."""


class RunFailed(CheckFailed):
    """The run itself failed, not its input: the loss diverged, the data loader stalled. Exit 1, one line."""


def _operation(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    collective = next(
        (
            f.name
            for f in reversed(frames)
            if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")
        ),
        None,
    )
    ours = next((f.name for f in reversed(frames) if "paratrain" in f.filename and f.name in _CONTEXT), None)
    if collective and ours:
        return f"{collective} during {_CONTEXT[ours]}"
    if collective:
        return collective
    return _CONTEXT[ours] if ours else "a collective"


def describe_collective_failure(exc: BaseException, rank: int, step: int, timeout_s: float) -> str | None:
    """One line naming what failed, or None when `exc` is not a timeout or a lost peer."""
    text = str(exc).lower()
    where = f"in {_operation(exc)} at step {step}"
    if any(word in text for word in _TIMEOUT_WORDS):
        return (
            f"rank {rank} timed out after {timeout_s:g} s {where}: another rank stalled or died "
            f"(--timeout-s sets the limit)"
        )
    if any(word in text for word in _PEER_LOST_WORDS):
        return f"rank {rank} lost a peer {where}: another rank died or its network failed"
    return None
