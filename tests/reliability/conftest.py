"""Fixtures for the reliability tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from reliability.inproc import make_trainer, one_rank


@pytest.fixture(scope="session")
def good_checkpoints(tmp_path_factory) -> Path:
    """A checkpoint dir with complete step-2 and step-4 from a 4-step one-rank run (made once)."""
    root = tmp_path_factory.mktemp("good") / "ck"
    with one_rank() as rt:
        make_trainer(rt, ckpt_dir=str(root), ckpt_every=2, resume="never").fit()
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-4"]
    return root


@pytest.fixture
def ckpts(good_checkpoints, tmp_path) -> Path:
    """A private copy of good_checkpoints to break."""
    return Path(shutil.copytree(good_checkpoints, tmp_path / "ck"))
