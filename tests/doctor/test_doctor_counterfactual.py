"""Communication's cost by counterfactual: a large DDP model with a tiny micro-batch, as in issue #20.

The doctor's communication finding must carry what skipping the gradient sync saves, and that must agree
(within a quarter) with what the all-reduce costs by the plain measurement: the same per-rank step under
`train` on two ranks minus on one rank.
"""

import json
import statistics

import pytest

# 8.6M parameters, almost all in the embedding and output (a 33 MiB all-reduce); 16 tokens per rank
LARGE_DDP = 'model = "tiny"\nvocab_size = 16384\ndim = 256\nffn_dim = 512\nn_layers = 1\nseq_len = 16\n'
WARMUP, STEPS = 2, 5


def train_step_s(cli, tmp_path, name, *args):
    out = tmp_path / name
    res = cli("train", "--config", str(tmp_path / "run.toml"), "--json", "--timeout-s", "120", "--out", str(out),
              "--steps", str(WARMUP + STEPS), *args, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows if r["step"] > WARMUP)


@pytest.mark.timeout(400)
def test_large_ddp_communication_cost_matches_two_ranks_minus_one(cli, tmp_path):
    (tmp_path / "run.toml").write_text(LARGE_DDP)
    one = train_step_s(cli, tmp_path, "one", "--strategy", "single", "--nproc", "1", "--global-batch", "1")
    res = cli("doctor", "--config", str(tmp_path / "run.toml"), "--strategy", "ddp", "--nproc", "2",
              "--global-batch", "2", "--warmup", str(WARMUP), "--steps", str(STEPS), "--json", "--timeout-s", "120",
              timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = res.json()
    two = train_step_s(cli, tmp_path, "two", "--strategy", "ddp", "--nproc", "2", "--global-batch", "2")
    measured = two - one

    comm = next(f for f in report["findings"] if f["cause"] == "communication")
    counterfactual = comm["numbers"]["counterfactual_ms"] / 1e3
    detail = f"two ranks {two}, one rank {one}, counterfactual {counterfactual:.4f} s, report {report['counterfactual']}"
    assert measured > 0, detail
    assert abs(counterfactual - measured) <= 0.25 * measured, detail
    # ranked by that cost: the finding's score is at least the counterfactual share of the step
    assert comm["score"] >= comm["numbers"]["counterfactual_fraction"] - 1e-9
    assert report["findings"][0]["cause"] == "communication", [f["cause"] for f in report["findings"]]
