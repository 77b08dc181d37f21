"""`train --strategy auto --probe K`: the top K layouts measured a few steps each, the model refitted, the measured
best trained. The guarantee: a wrong prediction (injected by tests/support/prediction_scale.py, a plugin)
is overturned by what the probe measures."""

from __future__ import annotations

import pytest

from helpers import plugin_env
from paratrain.parallel.layout import Layout
from paratrain.plan.costing.time import TimeEstimate
from paratrain.plan.probe_refit import Probe, choose, format_probe_table
from paratrain.plan.search import Candidate

# what these tests measure is a share of a step's time: under -n no other test runs beside them (conftest.py)
pytestmark = pytest.mark.alone


def candidate(predicted: float, **degrees) -> Candidate:
    return Candidate(Layout(**degrees), time=TimeEstimate(step_s=predicted), feasible=True)


def test_the_measured_best_wins_and_the_model_is_refitted_per_strategy():
    ddp, zero3, zero2 = candidate(1.0, dp_replicate=2), candidate(2.0, dp_shard=2, zero_stage=3), \
        candidate(3.0, dp_shard=2, zero_stage=2)
    unprobed = candidate(2.5, tp=2)
    probes = [Probe(0, ddp, 1.0, [4.0, 4.4, 4.2]), Probe(1, zero3, 2.0, [3.0, 3.1, 2.9]),
              Probe(2, zero2, 3.0, [], error="boom")]
    result = choose(probes, [ddp, zero3, unprobed, zero2])
    assert result.winner is probes[1]  # measured 3.0 s beats 4.2 s, against the prediction
    assert result.factors["ddp"] == pytest.approx(4.2) and result.factors["zero3"] == pytest.approx(1.5)
    assert result.factors["*"] == pytest.approx((4.2 + 1.5) / 2)  # zero2 measured nothing: not in the fit
    refit = {c.layout.strategy: t for c, t in result.refit}
    assert refit["tp"] == pytest.approx(2.5 * result.factors["*"])  # not probed: the median over all probes
    assert any("overturned the planner's first choice" in r for r in result.reasons)
    table = format_probe_table(result)
    assert "<- chosen" in table and "failed" in table and "4.2e+03" in table


def test_probe_needs_strategy_auto(cli_inproc):
    res = cli_inproc("train", "--strategy", "ddp", "--probe", "2", "--device", "cpu")
    assert res.returncode == 2 and "--probe 2 needs --strategy auto" in res.stderr
    res = cli_inproc("train", "--strategy", "auto", "--probe", "-1", "--device", "cpu")
    assert res.returncode == 2 and "probe" in res.stderr


@pytest.mark.timeout(240)
def test_probe_3_overturns_a_wrong_prediction_and_trains_the_measured_best(cli_here, tmp_path):
    # the catalog's cpu entry (no saved profile); zero3 made to look 100x faster than the model says: on CPU
    # FSDP's per-parameter work makes it measure well behind DDP-style layouts, so the probe must not keep it
    env = {"PARATRAIN_CACHE": str(tmp_path / "cache"),
           **plugin_env("support.prediction_scale:plugin", PARATRAIN_TEST_PREDICTION_SCALE="zero3:0.01")}
    res = cli_here("train", "--strategy", "auto", "--probe", "3", "--model", "tiny", "--nproc", "2", "--steps", "1",
              "--device", "cpu", "--seq-len", "32", "--global-batch", "4", "--no-metrics", "--json",
              "--timeout-s", "60", "--out", str(tmp_path / "run"), env=env, timeout=230)
    assert res.returncode == 0, res.stderr
    assert "probe: predicted vs measured step time" in res.stderr and "<- chosen" in res.stderr
    doc = res.json()
    probes = doc["probe"]["probes"]
    assert len(probes) == 3 and probes[0]["strategy"] == "zero3"  # the mis-predicted layout ranked first
    measured = [p["measured_step_time_s"] for p in probes]
    assert all(m and m > 0 for m in measured)
    winner = probes[doc["probe"]["winner"]]
    assert winner["measured_step_time_s"] <= 1.05 * min(measured)  # the acceptance's 5%
    assert winner["strategy"] != "zero3" and "overturned the planner's first choice" in res.stderr
    config = (tmp_path / "run" / "config.toml").read_text()
    assert f'strategy = "{winner["strategy"]}"' in config and "probe = 0" in config
