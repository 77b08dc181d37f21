"""GPT-2 (tied embedding, frozen key bias) under the strategies that can hold a tied table, and the refusal of
those that cannot. Reference: bench/verify.py's single-device run of the same seed and batches (fp32
tolerances); one launch of 2 gloo ranks runs every verify (tests/parallel/dp_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import cli_env
from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.train.validate import validate_run

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel", "dp_worker.py")
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "tp", "tp-sp", "cp-ring")


@pytest.mark.timeout(300)
def test_tied_gpt2_verify_passes_under_dp_tp_and_cp(tmp_path):
    spec = {"verify": [{"strategy": s, "model": "gpt2-tiny", "steps": 3} for s in STRATEGIES]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER,
           str(tmp_path / "spec.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=290, env=cli_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = json.loads(proc.stdout.strip().splitlines()[-1])["verify"]
    assert [r["strategy"] for r in reports] == list(STRATEGIES)
    for report in reports:
        assert report["passed"], report


def test_pipelines_refuse_a_tied_embedding_with_one_line(cli_inproc):
    for strategy in ("pp", "model"):
        with pytest.raises(UserError, match="cannot hold gpt2-tiny's tied embedding"):
            validate_run(TrainConfig(model="gpt2-tiny", strategy=strategy, nproc=2, global_batch=4), 2)
    res = cli_inproc("train", "--model", "gpt2-tiny", "--strategy", "pp", "--nproc", "2", "--steps", "1")
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and "tied embedding" in res.stderr
