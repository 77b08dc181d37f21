"""Every predicted step time carries the planner's measured error (issue 32): plan --json gives each candidate an
`error_bar`, the human output prints ±, and the shipped bars are the ones the published-runs benchmark computes
from the current case list and cost model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from paratrain.parallel.layout import Layout
from paratrain.plan.error_bars import BARS_FILE, compute_bars, inputs_digest, layout_family

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "benchmarks" / "published_runs.json"
REGENERATE = "run `python benchmarks/planner_published.py --write-error-bars`"


def _shipped() -> dict:
    return json.loads(BARS_FILE.read_text())


def test_every_candidate_has_an_error_bar_and_the_text_shows_it(cli_inproc):
    args = ("plan", "--model", "tiny", "--gpu", "h100-sxm", "--gpus", "2", "--seq-len", "64", "--global-batch", "8")
    res = cli_inproc(*args, "--json")
    assert res.returncode == 0, res.stderr
    cands = res.json()["candidates"]
    assert cands
    for cand in cands:
        bar = cand["error_bar"]
        assert {"step_time_rel", "cases", "family"} <= set(bar)
        assert 0 < bar["step_time_rel"] < 1 and bar["cases"] >= 3
    text = cli_inproc(*args).stderr
    assert "±" in text and "published" in text


def test_families_follow_the_layout():
    assert layout_family(Layout(dp_shard=8)) == "FSDP"
    assert layout_family(Layout(dp_replicate=8)) == "DDP/ZeRO-1"
    assert layout_family(Layout(tp=8, dp_shard=4)) == "tensor-parallel"
    assert layout_family(Layout(tp=8, pp=4, dp_shard=2)) == "pipeline"
    # expert parallelism first, and its bar is measured on MoE runs alone (no dense family counts them)
    assert layout_family(Layout(pp=4, dp_shard=64, ep=64)) == "expert-parallel"
    bars = _shipped()["families"]
    assert bars["expert-parallel"]["family"] == "expert-parallel" and bars["all"]["cases"] == 26


def test_the_shipped_bars_match_the_case_list_and_cost_model():
    """Cheap: the hash of the inputs the bars were computed from, and the bars recomputed from the per-case
    errors; the case errors themselves are checked on one case below."""
    doc = _shipped()
    assert doc["inputs_sha256"] == inputs_digest(RUNS), f"error_bars.json is stale: {REGENERATE}"
    recomputed = compute_bars({cid: (c["family"], c["step_error"]) for cid, c in doc["cases"].items()})
    assert recomputed["families"] == doc["families"] and recomputed["cases"] == doc["cases"]
    runs = json.loads(RUNS.read_text())
    assert set(doc["cases"]) == {c["id"] for c in runs["cases"]}
    assert doc["frozen_cases"] == runs["frozen_before_tuning"]["ids"]
    for cid, case in doc["cases"].items():  # leave-one-out: a case's bar never counts the case itself
        whole = doc["families"][case["family"]]
        if whole["family"] == case["leave_one_out"]["family"]:
            assert case["leave_one_out"]["cases"] == whole["cases"] - 1, cid


@pytest.mark.timeout(300)
def test_one_case_recomputes_to_its_shipped_error():
    """The traced model code is not in the hash: one case (a GPT-style 22B on 8 A100s) is predicted again."""
    spec = importlib.util.spec_from_file_location("planner_published", ROOT / "benchmarks" / "planner_published.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    case = next(c for c in json.loads(RUNS.read_text())["cases"] if c["id"] == "korthikanti-22b-full-recompute")
    cand, _, _ = bench.evaluate_case(case)
    error = cand["step_time_s"] / bench.published_step_time(case) - 1
    assert error == pytest.approx(_shipped()["cases"][case["id"]]["step_error"], abs=1e-4), REGENERATE
