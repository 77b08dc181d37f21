"""Test-only: PARATRAIN_TEST_RANK_SLOWDOWN="RANK:FACTOR[,RANK:FACTOR]" makes those global ranks compute FACTOR x
as long, to stand in for a slower GPU in a mixed cluster (benchmarks/uneven_split.py, the planner's tests).

After each measured piece of compute (a micro-batch's forward + backward; a pipeline stage's chunk) the rank
sleeps (FACTOR - 1) x its measured time. On CPU the measure is this thread's CPU time, so time spent blocked
on a peer's collective is not stretched (run ranks with OMP_NUM_THREADS=1); on CUDA, synchronised wall time.
Unset (always, outside those tests), nothing is measured and nothing sleeps.
"""

from __future__ import annotations

import functools
import os
import time

from paratrain.errors import UserError

SLOWDOWN_ENV = "PARATRAIN_TEST_RANK_SLOWDOWN"


def rank_slowdown(rank: int) -> float:
    """This global rank's slowdown factor from PARATRAIN_TEST_RANK_SLOWDOWN (1.0: not throttled)."""
    text = os.environ.get(SLOWDOWN_ENV, "").strip()
    factors = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        try:
            who, factor = item.split(":")
            factors[int(who)] = float(factor)
        except ValueError:
            raise UserError(f"{SLOWDOWN_ENV}={text!r}: give RANK:FACTOR[,RANK:FACTOR], e.g. 1:2") from None
        if not factors[int(who)] >= 1.0:
            raise UserError(f"{SLOWDOWN_ENV}={text!r}: a factor must be >= 1 (got {factor})")
    return factors.get(rank, 1.0)


class Throttle:
    """Stretches measured compute by a factor: start() ... stop() sleeps (factor - 1) x the time between."""

    def __init__(self, factor: float, device_type: str):
        self.factor, self.cuda = factor, device_type == "cuda"
        self.t0 = 0.0
        self.slept_s = 0.0

    @classmethod
    def for_rank(cls, rank: int, device_type: str) -> Throttle | None:
        factor = rank_slowdown(rank)
        if factor <= 1.0:
            return None
        if device_type != "cuda":
            import torch

            if torch.get_num_threads() > 1:  # the other threads' CPU time would go unmeasured: too little sleep
                raise UserError(f"{SLOWDOWN_ENV} on CPU stretches this thread's CPU time, but torch computes on "
                                f"{torch.get_num_threads()} threads; run the ranks with OMP_NUM_THREADS=1")
        return cls(factor, device_type)

    def _now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()

    def start(self) -> None:
        self.t0 = self._now()

    def stop(self) -> None:
        pause = (self.factor - 1.0) * (self._now() - self.t0)
        self.slept_s += pause
        time.sleep(pause)

    def wrap(self, fn):
        """fn, throttled: each call's compute is stretched."""
        @functools.wraps(fn)
        def slowed(*args, **kwargs):
            self.start()
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop()

        return slowed
