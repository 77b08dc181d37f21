"""A delay that stays a share of the step it slows: the injected loader and tokenizer delays (loader_delay.py,
slow_tokenizer.py) are at least their fixed seconds and at least SHARE x the longest step compute seen so far (the
time inside `wrap_step`, which holds no data wait; the longest, since a busy host makes step times jump). On a busy machine the step slows and a fixed delay shrinks
against it, so a finding that a quiet machine shows could vanish; a share does not.

    PARATRAIN_TEST_DELAY_STEP_SHARE=2   # each delay >= 2 x the longest step compute so far (default 0: fixed seconds only)

That time is kept in shared memory made before the run forks its loader workers, so a delay there
reads it too.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import weakref

from paratrain.errors import UserError

SHARE_ENV = "PARATRAIN_TEST_DELAY_STEP_SHARE"
_longest_step_s = multiprocessing.Value("d", 0.0, lock=False)
_tracked: weakref.WeakSet = weakref.WeakSet()  # registries timed already (not ids: a freed one's id is reused)


def share_of_step() -> float:
    text = os.environ.get(SHARE_ENV, "") or "0"
    try:
        return float(text)
    except ValueError:
        raise UserError(f"{SHARE_ENV}={text!r}: give a multiple of the step, e.g. 2") from None


def track_steps(hooks) -> None:
    """Time each step's compute through `wrap_step` (once per registry)."""
    if hooks in _tracked:
        return
    _tracked.add(hooks)

    def timed(trainer, micro_batches, step):
        start = time.perf_counter()
        out = step(micro_batches)
        _longest_step_s.value = max(_longest_step_s.value, time.perf_counter() - start)
        return out

    hooks.wrap_step(timed)


def delay_s(seconds: float, share: float) -> float:
    """The delay to inject now: `seconds`, or `share` x the longest step compute where that is longer."""
    return max(seconds, share * _longest_step_s.value)
