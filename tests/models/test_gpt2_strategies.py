"""GPT-2 (tied embedding, frozen key bias) under every strategy that shards, splits or pipelines it. Reference:
verify/parity.py's single-device run of the same seed and batches (fp32 tolerances); the suite's shared 2- and
4-rank process groups run every verify (tests/groups.py)."""

from __future__ import annotations

import pytest

from groups import GPT2_TIED, GPT2_TIED_PP, verified
from paratrain.config import TrainConfig
from paratrain.train.validate import validate_run


@pytest.mark.timeout(500)
def test_tied_gpt2_verify_passes_under_dp_tp_and_cp(two_ranks):
    reports = [r for r in two_ranks["verify"] if r["id"].startswith("gpt2-") and "-pp-" not in r["id"]]
    assert [r["strategy"] for r in reports] == list(GPT2_TIED)
    for report in reports:
        assert report["passed"], report


@pytest.mark.timeout(500)
def test_tied_gpt2_verify_passes_under_pipelines(two_ranks):
    """The first stage's table and the last stage's copy, their gradients summed (1F1B and interleaved 1F1B)."""
    for case in GPT2_TIED_PP:
        report = verified(two_ranks, case["id"])
        assert report["passed"] and report["dims"]["pp"] == 2, report


@pytest.mark.timeout(500)
def test_tied_gpt2_verify_passes_under_fsdp_times_tp_sp(four_ranks):
    report = verified(four_ranks, "gpt2-fsdp2xtp-sp2")
    assert report["passed"] and report["dims"]["dp_shard"] == 2 and report["dims"]["tp"] == 2, report


def test_pipelines_accept_a_tied_embedding():
    for strategy in ("pp", "model"):
        validate_run(TrainConfig(model="gpt2-tiny", strategy=strategy, nproc=2, global_batch=4), 2)
