"""An in-process one-rank trainer for the reliability tests (fast: no process spawn)."""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def one_rank():
    """A world-1 process group in this process; os.environ is restored afterwards."""
    from paratrain.train.runtime import init_runtime, shutdown

    saved = dict(os.environ)
    try:
        yield init_runtime("cpu", 60)
    finally:
        shutdown()
        os.environ.clear()
        os.environ.update(saved)


def tiny_config(**overrides):
    from paratrain.config import TrainConfig

    base = dict(
        model="tiny",
        strategy="single",
        nproc=1,
        device="cpu",
        steps=4,
        seq_len=32,
        global_batch=4,
        metrics=False,
        timeout_s=60,
    )
    return TrainConfig(**{**base, **overrides})


def make_trainer(rt, **overrides):
    from paratrain.train.trainer import Trainer

    return Trainer(tiny_config(**overrides), rt, None, quiet=True)
