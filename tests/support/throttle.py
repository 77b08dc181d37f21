"""A slowed rank, attached through paratrain's hooks: those global ranks compute FACTOR x as long, to stand in
for a slower GPU in a mixed cluster (benchmarks/uneven_split.py, tests/plan/test_throttled_rank.py,
tests/parallel/test_uneven.py).

After each measured piece of compute (a micro-batch's forward + backward: the around_compute hook; a pipeline
stage's chunk: on_pipeline_stage) the rank sleeps (FACTOR - 1) x its measured time. On CPU the measure is this
thread's CPU time, so time spent blocked on a peer's collective is not stretched (run ranks with
OMP_NUM_THREADS=1); on CUDA, synchronised wall time.

    attach(hooks, Throttle(3.0, "cpu"))                      # in-process
    PARATRAIN_PLUGINS=support.throttle:plugin PARATRAIN_TEST_RANK_SLOWDOWN=1:3   # every worker; RANK:FACTOR[,...]
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

from paratrain.errors import UserError

SLOWDOWN_ENV = "PARATRAIN_TEST_RANK_SLOWDOWN"
STAGE_COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def parse_slowdown(text: str) -> dict[int, float]:
    """"1:3, 2:1.5" -> {1: 3.0, 2: 1.5}; one UserError line for anything else."""
    factors = {}
    for item in filter(None, (p.strip() for p in text.strip().split(","))):
        try:
            who, factor = item.split(":")
            factors[int(who)] = float(factor)
        except ValueError:
            raise UserError(f"{SLOWDOWN_ENV}={text!r}: give RANK:FACTOR[,RANK:FACTOR], e.g. 1:2") from None
        if not factors[int(who)] >= 1.0:
            raise UserError(f"{SLOWDOWN_ENV}={text!r}: a factor must be >= 1 (got {factor})")
    return factors


def rank_slowdown(rank: int, text: str | None = None) -> float:
    """This global rank's slowdown factor (1.0: not throttled), from `text` or PARATRAIN_TEST_RANK_SLOWDOWN."""
    return parse_slowdown(os.environ.get(SLOWDOWN_ENV, "") if text is None else text).get(rank, 1.0)


class Throttle:
    """Stretches measured compute by a factor: start() ... stop() sleeps (factor - 1) x the time between."""

    def __init__(self, factor: float, device_type: str):
        self.factor, self.cuda = factor, device_type == "cuda"
        self.t0 = 0.0
        self.slept_s = 0.0

    @classmethod
    def for_rank(cls, rank: int, device_type: str, text: str | None = None) -> Throttle | None:
        factor = rank_slowdown(rank, text)
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

    @contextlib.contextmanager
    def stretched(self, *_args):
        self.start()
        yield
        self.stop()

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

    def wrap_stage(self, stage, _spec=None) -> None:
        """A pipeline stage's chunks, throttled (registered before its busy clock: slowed counts as busy)."""
        for name in STAGE_COMPUTE:
            setattr(stage, name, self.wrap(getattr(stage, name)))


def attach(hooks, throttle: Throttle | None) -> list:
    """Throttle this rank's compute through `hooks`; returns the handles (none for None)."""
    if throttle is None:
        return []
    return [hooks.around_compute(throttle.stretched), hooks.on_pipeline_stage(throttle.wrap_stage)]


def plugin(hooks) -> None:
    """PARATRAIN_PLUGINS entry: the ranks PARATRAIN_TEST_RANK_SLOWDOWN names, each throttled in its own process
    (the rank is known once the process group exists, at the first compute)."""
    text = os.environ.get(SLOWDOWN_ENV, "")
    parse_slowdown(text)  # a bad setting fails when the plugin loads, in the CLI's process already
    mine: list = []

    def throttle() -> Throttle | None:
        if not mine:
            import torch
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else \
                int(os.environ.get("RANK", "0"))
            device = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
            mine.append(Throttle.for_rank(rank, device, text))
        return mine[0]

    def around_compute(index):
        found = throttle()
        return found.stretched() if found is not None else contextlib.nullcontext()

    def on_pipeline_stage(stage, spec):
        found = throttle()
        if found is not None:
            found.wrap_stage(stage)

    hooks.around_compute(around_compute)
    hooks.on_pipeline_stage(on_pipeline_stage)
