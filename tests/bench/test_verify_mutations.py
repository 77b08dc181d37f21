"""verify catches planted bugs and names where they are.

One 2-rank launch (mutation_worker.py, gloo) runs, for each mutation of tests/support/faults.py, a clean
verify of its strategy (must pass: no false alarm) and the same verify with the bug planted (must fail at step 1
and name the layer, parameter or rank). Reference: the single-device run of the same seed, weights and batches;
fp32 tolerances of verify/compare.py, and for bf16 4x the measured noise floor.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from reliability.inproc import launch_here

HERE = os.path.dirname(os.path.abspath(__file__))
LAST_STAGE = ("layers.1.", "norm.", "output.")  # pp=2 on the 2-layer tiny model: the last stage's parameters


@pytest.fixture(scope="module")
def runs():
    # its 2 ranks fork from this process's warm forkserver (reliability/inproc.py); they import the worker by name
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    from mutation_worker import worker

    return json.loads(json.dumps(launch_here(worker, (), 2, timeout_s=120.0), default=str))


def caught(runs, name: str) -> dict:
    """The clean run passes, the mutated one fails at step 1; return where it says the run diverges."""
    clean, bad = runs[name]["clean"], runs[name]["mutated"]
    assert clean["passed"] is True and clean["first_divergence"] is None, clean
    assert bad["passed"] is False, bad
    where = bad["first_divergence"]
    assert where["step"] == 1, where
    return where


def names(where: dict) -> list[str]:
    return [p["name"] for p in where["parameters"]]


@pytest.mark.timeout(420)
def test_a_gradients_summed_instead_of_averaged(runs):
    where = caught(runs, "dp-grad-sum")
    assert where["differs"] == "grads" and not where["loss_differs"], where
    assert all(abs(p["grad_scale"] - 2.0) < 1e-3 for p in where["parameters"]), where  # 2 ranks summed


@pytest.mark.timeout(420)
def test_b_fsdp_shard_skips_its_update_on_one_rank(runs):
    where = caught(runs, "fsdp-skip-update")
    assert where["differs"] == "params" and not where["grads_differ"], where
    assert names(where)[0] == "layers.0.feed_forward.w1.weight", where
    assert abs(where["parameters"][0]["rel_error"] - 0.5 ** 0.5) < 0.05  # half the tensor kept its old values


@pytest.mark.timeout(420)
def test_c_row_parallel_layer_without_its_all_reduce(runs):
    where = caught(runs, "tp-row-no-reduce")
    assert where["module"] == "layers.1.feed_forward", where  # the faulty block, not layer 0 before it
    assert where["differs"] in ("loss", "activations"), where


@pytest.mark.timeout(420)
def test_d_context_parallel_rope_positions_wrong_on_one_rank(runs):
    where = caught(runs, "cp-rope-positions")
    assert where["module"] == "layers.0.attention", where  # the first module RoPE feeds
    assert where["differs"] in ("loss", "activations"), where


@pytest.mark.timeout(420)
def test_e_pipeline_stage_drops_one_microbatch_gradient(runs):
    where = caught(runs, "pp-drop-microbatch-grad")
    assert where["differs"] == "grads" and not where["loss_differs"], where
    assert all(n.startswith(LAST_STAGE) for n in names(where)) and where["ranks"] == [1], where


@pytest.mark.timeout(420)
def test_f_zero1_shard_never_broadcast_back(runs):
    where = caught(runs, "zero1-no-broadcast")
    assert where["differs"] == "params" and not where["grads_differ"], where
    # rank 1 updated its own shard; rank 0 holds the stale copy: only a per-rank comparison sees it
    assert where["ranks"] == [0] and where["parameters"][0]["rel_error"] > 0.9, where


@pytest.mark.timeout(420)
def test_g_sequence_parallel_norm_grads_not_reduced(runs):
    where = caught(runs, "sp-norm-grad-no-reduce")
    assert where["differs"] == "grads" and not where["loss_differs"], where
    assert all(n.endswith("norm.weight") for n in names(where)), where


@pytest.mark.timeout(420)
def test_i_tied_embedding_copies_not_summed_between_pipeline_stages(runs):
    where = caught(runs, "tied-grad-not-summed")
    assert where["differs"] == "grads" and not where["loss_differs"], where
    tied = [p for p in where["parameters"] if p["name"] == "tok_embeddings.tokens.weight"]
    assert sorted(p["rank"] for p in tied) == [0, 1], where  # the table's copy on each end stage
    # each copy holds only its own stage's part of the gradient: the two parts add up to the whole
    assert abs(sum(p["grad_scale"] for p in tied) - 1.0) < 1e-3 and all(p["grad_scale"] < 0.9 for p in tied), where


@pytest.mark.timeout(420)
def test_bf16_tolerance_is_a_stated_multiple_of_the_measured_floor(runs):
    clean, bad = runs["bf16"]["clean"], runs["bf16"]["mutated"]
    floor, k, tol = clean["noise_floor"], clean["floor_multiple"], clean["tolerance"]
    assert clean["passed"] is True and k >= 1 and all(v > 0 for v in floor.values()), clean
    assert tol["grad_rtol"] == pytest.approx(max(1e-4, k * floor["grad"]))
    assert tol["param_rtol"] == pytest.approx(max(1e-2, k * floor["param"]))
    assert bad["passed"] is False and bad["first_divergence"]["differs"] == "grads", bad  # (a) caught in bf16 too


@pytest.mark.timeout(420)
def test_clean_runs_stay_well_inside_their_tolerances(runs):
    """Measured margins (tolerance / largest error over 3 steps and both ranks): at least 5x everywhere."""
    for name, pair in runs.items():
        if name == "bf16":  # its bounds are 4x its own noise floor, checked above
            continue
        for check, margin in pair["clean"]["margins"].items():
            assert margin is None or margin >= 5, (name, check, margin)  # None: the error was exactly 0
