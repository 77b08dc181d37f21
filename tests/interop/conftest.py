"""Fixtures for the export / import tests."""

from __future__ import annotations

import os

import pytest


def write_tiny_checkpoint(root, model: str = "tiny", steps: int = 1):
    """A real single-process checkpoint (`steps` steps), written by the Trainer in this process."""
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer

    cfg = TrainConfig(model=model, strategy="single", nproc=1, device="cpu", steps=steps, ckpt_every=steps, metrics=False,
                      ckpt_dir=str(root / "ck"), resume="never")
    saved = dict(os.environ)  # init_runtime marks this process as rank 0 of 1: undo it afterwards
    try:
        Trainer(cfg, init_runtime("cpu", 60.0), quiet=True).fit()
    finally:
        shutdown()
        os.environ.clear()
        os.environ.update(saved)
    return root / "ck" / f"step-{steps}"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ck"))


@pytest.fixture
def write_checkpoint():
    """write_tiny_checkpoint(root, model, steps), for tests that need another preset."""
    return write_tiny_checkpoint
