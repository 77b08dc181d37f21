"""Fixtures for the export / import tests."""

from __future__ import annotations

import pytest


def write_tiny_checkpoint(root):
    """A real single-process checkpoint of the tiny preset (1 step), written by the Trainer in this process."""
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime
    from paratrain.train.trainer import Trainer

    cfg = TrainConfig(strategy="single", nproc=1, device="cpu", steps=1, ckpt_every=1, metrics=False,
                      ckpt_dir=str(root / "ck"), resume="never")
    Trainer(cfg, init_runtime("cpu", 60.0), quiet=True).fit()
    return root / "ck" / "step-1"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ck"))
