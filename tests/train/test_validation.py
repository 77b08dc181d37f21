"""Validation loss: --val-data / --val-fraction, --eval-every; identical under every strategy.

Reference: a single-device trainer's val loss on the same held-out batches (fp32: rel 1e-5). One 2-rank group
runs ddp, zero3, tp, pp and cp-ring against it (tests/train/val_worker.py, in the suite's shared 2-rank group of
tests/groups.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import CLIResult
from paratrain.train.data.indexed_sets import TokenFile
from reliability.inproc import run_cli_inproc


@pytest.fixture(scope="module")
def two_ranks(two_ranks):
    """val_worker.py's curves, run in the suite's shared 2-rank group (tests/groups.py): no launch of their own."""
    return two_ranks["validation"]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "tp", "pp", "cp-ring"])
def test_val_loss_is_the_same_under_every_strategy(two_ranks, strategy):
    ref = two_ranks["single"]
    assert ref[2] < ref[0]  # training moved the weights: the later values test something
    for rank_curve in two_ranks[strategy]:  # every rank reports the same global value
        assert rank_curve == pytest.approx(ref, rel=1e-5, abs=0)


def test_the_comparison_catches_an_unreduced_val_loss(two_ranks):
    """Fault injected (ddp, after 2 steps): each rank reports its own shard's loss, not the global mean."""
    ref, locals_ = two_ranks["single"][2], two_ranks["ddp_unreduced"]
    assert max(abs(x - ref) / ref for x in locals_) > 1e-4
    assert sum(locals_) / len(locals_) == pytest.approx(ref, rel=1e-5)  # equal shards: their mean is the value


def write_bin(path, n: int, vocab: int = 256):
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, n, dtype=np.uint16).tofile(path)


def test_val_fraction_holds_out_the_tail_and_never_trains_on_it(tmp_path):
    write_bin(tmp_path / "t.bin", 10_000)
    train = TokenFile(str(tmp_path / "t.bin"), 256, 32, split=(0.0, 0.9))
    val = TokenFile(str(tmp_path / "t.bin"), 256, 32, split=(0.9, 1.0))
    starts = train.window_starts(np.arange(20_000))
    assert starts.max() + 33 <= 9_000 and starts.min() >= 0
    assert val.sequential_starts(np.arange(val.num_windows())).min() >= 9_000
    assert val.num_windows() == (1_000 - 1) // 32


def test_val_data_file_is_read_in_order_from_its_start(tmp_path):
    from paratrain.train.data.indexed_sets import make_val_dataset

    write_bin(tmp_path / "v.bin", 1_000)
    val = make_val_dataset("synthetic", str(tmp_path / "v.bin"), 0.0, 0, 256, 32, 0)
    tokens = np.fromfile(tmp_path / "v.bin", dtype=np.uint16)
    assert val.samples(np.arange(3)).tolist() == [tokens[i * 32:i * 32 + 33].tolist() for i in range(3)]


@pytest.mark.timeout(200)
def test_cli_reports_val_loss_every_n_steps(tmp_path):
    write_bin(tmp_path / "t.bin", 40_000)
    # in this process (one rank): no interpreter start
    res = CLIResult(*run_cli_inproc(["train", "--data", "t.bin", "--val-fraction", "0.1", "--eval-every", "2",
                                     "--strategy", "single", "--steps", "4", "--global-batch", "8", "--seq-len", "32",
                                     "--out", "r", "--json"], cwd=tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [("val_loss" in x) for x in lines] == [False, True, False, True]
    assert lines[1]["val_ppl"] == pytest.approx(np.exp(lines[1]["val_loss"]))
    doc = res.json()
    assert doc["val_loss"] == lines[3]["val_loss"]
    assert "val " in res.stderr


@pytest.mark.parametrize("args,needle", [
    (["--val-fraction", "0.9"], "val_fraction"),
    (["--data", "t.bin", "--eval-every", "2"], "--eval-every needs --val-data or --val-fraction"),
    (["--data", "t.bin", "--val-fraction", "0.001"], "held-out"),
    (["--data", "t.bin", "--val-fraction", "0.1", "--val-data", "t.bin"], "give --val-data or --val-fraction, not both"),
    (["--val-fraction", "0.1"], "synthetic data validates on held-out sequences"),
    (["--data", "t.bin", "--val-data", "nope.bin"], "data file not found: nope.bin"),
])
def test_bad_validation_options(cli_inproc, tmp_path, args, needle):
    write_bin(tmp_path / "t.bin", 40_000)
    res = cli_inproc("train", "--strategy", "single", "--steps", "2", "--global-batch", "8", "--seq-len", "32", *args)
    assert res.returncode == 2 and needle in res.stderr, res.stderr
