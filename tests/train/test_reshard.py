"""Resharding: a checkpoint saved at one layout resumes at another with the next-step loss of a resume at the
original layout (fp32, rel 1e-5). Pairs: dp_shard2 -> single, tp2 -> dp_shard2, pp2 -> single; all in one
2-rank group (tests/train/reshard_worker.py, run in the suite's shared 2-rank group of tests/groups.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def resumed(two_ranks):
    return two_ranks["reshard"]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("pair", ["dp_shard2->single", "tp2->dp_shard2", "pp2->single"])
def test_resharded_resume_matches_the_original_layout(resumed, pair):
    got = resumed[pair]
    assert got["resharded"] == pytest.approx(got["original"], rel=1e-5)
    # the comparison can fail: skipping the load (fresh weights, same batch) is far off
    assert abs(got["not_loaded"] - got["original"]) > 1e-3 * abs(got["original"])
