"""GPT-2 (tied embedding, frozen key bias) under the strategies that can hold a tied table, and the refusal of
those that cannot. Reference: verify/parity.py's single-device run of the same seed and batches (fp32
tolerances); the suite's shared 2-rank process group runs every verify (tests/groups.py)."""

from __future__ import annotations

import pytest

from groups import GPT2_TIED
from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.train.validate import validate_run


@pytest.mark.timeout(500)
def test_tied_gpt2_verify_passes_under_dp_tp_and_cp(two_ranks):
    reports = [r for r in two_ranks["verify"] if r["id"].startswith("gpt2-")]
    assert [r["strategy"] for r in reports] == list(GPT2_TIED)
    for report in reports:
        assert report["passed"], report


def test_pipelines_refuse_a_tied_embedding_with_one_line(cli_inproc):
    for strategy in ("pp", "model"):
        with pytest.raises(UserError, match="cannot hold gpt2-tiny's tied embedding"):
            validate_run(TrainConfig(model="gpt2-tiny", strategy=strategy, nproc=2, global_batch=4), 2)
    res = cli_inproc("train", "--model", "gpt2-tiny", "--strategy", "pp", "--nproc", "2", "--steps", "1")
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and "tied embedding" in res.stderr
