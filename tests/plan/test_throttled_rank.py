"""A mixed cluster, run: 2 CPU ranks, rank 1 throttled FACTOR x (tests/support/throttle.py, loaded into the
workers as a PARATRAIN_PLUGINS plugin) and described to the planner as that much slower (a cluster file with
speed 1 / FACTOR).

Checked here, none of it a timing: the planner gives the slower rank the smaller share of the batch; the even
and the planner's uneven layout both run to completion in one process group (bench's run_cells), the uneven one
with exactly the split the planner chose; and the throttle reached the workers, rank 1 and only rank 1 (each
throttled rank records how long it slept: support/throttle_record.py). Whether the uneven split is faster, and
by about the predicted margin, is a measurement that a loaded machine can sway: benchmarks/throttled_rank.py
prints it (docs/mixed-clusters.md has the figures).
"""

from __future__ import annotations

import json

import pytest

from helpers import plugin_env

FACTOR = 3.0


@pytest.mark.timeout(240)
def test_the_planners_uneven_split_runs_with_the_throttle_on_the_slower_rank(tmp_path, monkeypatch):
    from paratrain.bench.probe_layouts import probe_config
    from paratrain.bench.scaling import run_cells, slowest_rank_step_times
    from paratrain.config import TrainConfig
    from paratrain.parallel.layout import Layout
    from paratrain.plan.plan_cli import build_plan_inputs
    from paratrain.plan.plan_report import plan_document

    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"nodes": [{"gpu": "cpu", "count": 2, "speed": [1.0, 1 / FACTOR]}]}))
    job, hw, fixed, mixed = build_plan_inputs({"model": "tiny", "seq_len": 64, "global_batch": 16, "dtype": "fp32",
                                               "cluster": str(cluster), "strategy": "ddp"})
    best = plan_document(job, hw, fixed, top=1, cluster=mixed)["candidates"][0]
    split = best["dp_batch_split"]
    assert split and split[0] > split[1] and sum(split) == 16, best  # the slower rank 1 takes less
    assert best["step_time_s"] < best["step_time_even_s"]  # and the planner says why: it predicts a gain

    slept = tmp_path / "slept"
    slept.mkdir()
    env = plugin_env("support.throttle_record:plugin", PARATRAIN_TEST_RANK_SLOWDOWN=f"1:{FACTOR:g}",
                     PARATRAIN_TEST_SLEPT_DIR=str(slept))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the throttle measures this thread's CPU time

    base = TrainConfig(model="tiny", seq_len=64, global_batch=16, nproc=2, device="cpu", dtype="fp32", timeout_s=60.0)
    even = Layout(dp_replicate=2, micro_batch=8, microbatches=1, dtype="fp32")
    uneven = Layout(dp_replicate=2, micro_batch=max(split), microbatches=best["microbatches"], dtype="fp32",
                    dp_micro_batches=tuple(split))
    cells = run_cells([probe_config(base, lay, 2, 2) for lay in (even, uneven)], 2, 2, 2)
    assert [c.get("error") for c in cells] == [None, None], cells
    assert cells[0]["layout"]["dp_micro_batches"] in (None, [], [8, 8]), cells[0]["layout"]
    assert cells[1]["layout"]["dp_micro_batches"] == split  # the split the planner chose is the one that ran
    for cell in cells:  # both ran their measured steps on both ranks
        assert len(cell["ranks"]) == 2 and len(slowest_rank_step_times(cell)) == 2
    assert sorted(p.name for p in slept.iterdir()) == ["rank-1"]  # the throttle reached rank 1 alone
    assert float((slept / "rank-1").read_text()) > 0
