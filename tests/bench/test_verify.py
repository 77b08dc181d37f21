"""verify: the CLI contract on DDP (2 processes against the single-device reference, fp32), the comparisons'
ability to fail (a perturbed replica, NaN), tolerances from a measured floor, and refusals of options that would
not act within the verified steps. The planted-bug tests are in test_verify_mutations.py."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import plugin_env
from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.parallel.strategies import resolve_layout
from paratrain.train.hooks import KINDS, Hooks
from paratrain.verify.compare import Tolerance, compare_step, divergence, judge, nanmax
from paratrain.verify.parity import check_verifiable, describe_divergence
from support.faults import FAULT_ENV, MUTATIONS, plant, plugin

CONTRACT = {"strategy", "dims", "world_size", "steps", "dtype", "tolerance", "max_loss_abs_diff", "max_grad_rel_diff",
            "max_param_abs_diff", "passed", "per_step"}


@pytest.mark.timeout(240)
def test_verify_ddp_two_ranks_passes(cli_here):
    """The CLI's contract, on DDP with full activation checkpointing (reference: one process, ac none): one launch
    for what were three (the contract, AC under DDP, the model-state bytes in the JSON). In this process, the
    ranks' output in stderr (ranks=True)."""
    res = cli_here("verify", "--strategy", "ddp", "--nproc", "2", "--ac", "full", "--steps", "5", "--json", ranks=True)
    assert res.returncode == 0, res.stderr[-2000:]
    report = res.json()
    assert CONTRACT <= set(report)
    assert report["dtype"] == "fp32" and "applied full activation checkpointing to 2 blocks" in res.stderr
    assert set(report["model_state_bytes"]["mean"]) >= {"params", "grads", "optimizer", "total"}
    assert len(report["model_state_bytes"]["per_rank"]) == 2
    assert set(report["tolerance"]) >= {"loss_atol", "loss_rtol", "param_atol", "param_rtol"}
    assert report["passed"] is True and report["world_size"] == 2 and report["dims"]["dp_replicate"] == 2
    assert report["first_divergence"] is None and report["compared"]["ranks"] == 2
    assert report["compared"]["grads"] == "before clipping" and report["compared"]["activations"] is True
    assert len(report["per_step"]) == 5
    for row in report["per_step"]:
        assert abs(row["loss"] - row["loss_ref"]) <= 1e-5 * abs(row["loss_ref"])
        assert row["grad_norm"] == pytest.approx(row["grad_norm_ref"], rel=1e-5) and row["passed"]


@pytest.mark.timeout(240)
def test_verify_cli_fails_with_exit_1_and_says_where(cli_here):
    res = cli_here("verify", "--strategy", "ddp", "--nproc", "2", "--steps", "2", "--json",
              env=plugin_env("support.faults:plugin", **{FAULT_ENV: "dp-grad-sum"}))
    assert res.returncode == 1, res.stderr[-2000:]
    report = res.json()
    assert report["passed"] is False and report["checks"]["grads"] is False and report["checks"]["loss"] is True
    where = report["first_divergence"]
    assert where["step"] == 1 and where["differs"] == "grads"
    assert "first divergence at step 1: only the gradients differ" in res.stderr
    assert "gradient 2x the reference" in res.stderr


# -- the comparisons can fail --------------------------------------------------------------------------------------
def _step(w: torch.Tensor, loss: float = 2.0, norm: float = 1.0) -> dict:
    return {"loss": loss, "grad_norm": norm, "grads": {"w": w.clone()}, "params": {"w": w.clone()}, "acts": None}


def _ref() -> dict:
    ref = _step(torch.ones(4, 4))
    ref["update"] = {"w": 0.1}  # this step moved w by 0.1 (L2)
    return ref


def test_one_bad_replica_is_caught_and_named():
    ref, tol = _ref(), Tolerance.for_dtype("fp32")
    good, drifted = _step(torch.ones(4, 4)), _step(torch.ones(4, 4))
    drifted["params"]["w"][0, 0] += 0.01  # 10% of the step's update, on rank 1 only
    err = compare_step(ref, [good, drifted])
    ok = judge(err, ref, tol)
    assert ok == {"loss": True, "activations": True, "grads": True, "params": False}
    where = divergence(3, err, ok, tol, [])
    assert where["step"] == 3 and where["differs"] == "params"
    assert where["parameters"][0]["name"] == "w" and where["parameters"][0]["rank"] == 1
    assert where["parameters"][0]["rel_error"] == pytest.approx(0.1, rel=1e-3) and where["ranks"] == [1]
    assert "step 3: only the parameters differ" in describe_divergence(where)
    assert judge(compare_step(ref, [good, good]), ref, tol) == {k: True for k in ok}


def test_nan_never_passes():
    ref, tol = _ref(), Tolerance.for_dtype("fp32")
    assert math.isnan(nanmax([1.0, float("nan"), 3.0])) and max(1.0, float("nan")) == 1.0  # what builtin max hides
    nan_loss = judge(compare_step(ref, [_step(torch.ones(4, 4), loss=float("nan"))]), ref, tol)
    assert nan_loss["loss"] is False
    bad = torch.ones(4, 4)
    bad[1, 1] = float("nan")
    nan_grad = judge(compare_step(ref, [_step(bad)]), ref, tol)
    assert nan_grad["grads"] is False and nan_grad["params"] is False
    assert judge(compare_step(ref, [_step(torch.ones(4, 4), norm=float("nan"))]), ref, tol)["grads"] is False


def test_missing_or_extra_parameters_fail():
    ref, tol = _ref(), Tolerance.for_dtype("fp32")
    empty = {"loss": 2.0, "grad_norm": 1.0, "grads": {}, "params": {}, "acts": None}
    err = compare_step(ref, [empty])
    assert err["missing"] == ["w"] and judge(err, ref, tol)["params"] is False
    extra = _step(torch.ones(4, 4))
    extra["grads"]["v"] = torch.zeros(2)
    assert judge(compare_step(ref, [extra]), ref, tol)["grads"] is False


def test_parameters_whose_gradient_is_rounding_are_set_aside_and_a_fault_is_still_caught():
    """DeepSeek-V4's first hyper-connection (4 identical streams into a scale-free RMSNorm) has 83% of its weight's
    gradient at rounding level (fp64: 1e-10 and 1e-27 beside 7e-4): Adam moves each such element by up to ~lr with
    the sign rounding gives it, so another summation order lands 1.6% of the update away. Such elements (the
    tensor's gradient within grad_rtol, the element's off by more than half) leave the parameter check; the rest,
    and elements whose gradient is exactly 0 in both runs, stay in it."""
    tol = Tolerance.for_dtype("fp32")
    g_ref = torch.tensor([[1e-3, 1e-3, 1e-10, 0.0]] * 4)  # column 2: rounding; column 3: no gradient at all
    p_ref = torch.zeros(4, 4)
    ref = {"loss": 2.0, "grad_norm": 1.0, "grads": {"w": g_ref}, "params": {"w": p_ref}, "update": {"w": 0.1},
           "acts": None}

    def run(grad_col2: float, param_change: tuple[int, int, float]) -> dict:
        g, p = g_ref.clone(), p_ref.clone()
        g[:, 2] = grad_col2
        p[param_change[:2]] += param_change[2]
        return {"loss": 2.0, "grad_norm": 1.0, "grads": {"w": g}, "params": {"w": p}, "acts": None}

    rounded = run(-2e-10, (0, 2, 0.02))  # the sign flipped by rounding: Adam moved it 20% of the update
    assert judge(compare_step(ref, [rounded]), ref, tol)["params"] is False  # compared as before: fails
    set_aside: dict = {}
    err = compare_step(ref, [rounded], set_aside, tol.grad_rtol)
    assert judge(err, ref, tol) == {"loss": True, "activations": True, "grads": True, "params": True}
    assert set_aside[(0, "w")][:, 2].all() and int(set_aside[(0, "w")].sum()) == 4  # that column only
    # the set-aside elements stay out at later steps; the rest, and the gradient-free column, are still compared
    for fault in ((1, 0, 0.005), (2, 3, 0.005)):
        err = compare_step(ref, [run(-2e-10, fault)], set_aside, tol.grad_rtol)
        assert judge(err, ref, tol)["params"] is False and err["params"][0][0] == pytest.approx(0.05), fault
    # gradients off by more than grad_rtol set nothing aside: the parameters are judged whole
    doubled = run(2e-10, (0, 2, 0.02))
    doubled["grads"]["w"] *= 2
    fresh: dict = {}
    assert judge(compare_step(ref, [doubled], fresh, tol.grad_rtol), ref, tol)["params"] is False and not fresh


def test_low_precision_tolerance_is_the_floor_times_the_multiple():
    floor = {"loss": 1e-4, "grad_norm": 1e-3, "grad": 1e-2, "param": 1e-1, "act": 1e-9}
    tol = Tolerance.from_floor(floor, multiple=4)
    assert tol.loss_rtol == pytest.approx(4e-4) and tol.grad_rtol == pytest.approx(4e-2)
    assert tol.param_rtol == pytest.approx(0.4) and tol.act_rtol == Tolerance().act_rtol  # never below fp32's
    assert tol.basis == "4 x noise floor"


# -- options that would not act are refused -------------------------------------------------------------------------
def _refusal(**overrides) -> str:
    cfg = TrainConfig(device="cpu", steps=5, **overrides)
    with pytest.raises(UserError) as exc:
        check_verifiable(cfg, resolve_layout(cfg, 2))
    return str(exc.value)


def test_options_that_would_not_act_are_refused():
    assert "would not compress within 5 steps (it starts at step 6)" in _refusal(strategy="ddp", ddp_comm_hook="powersgd")
    assert "would not act within 5 steps" in _refusal(strategy="ddp", local_sgd_period=8)
    assert "each rank steps on its own gradients" in _refusal(strategy="ddp", local_sgd_period=2)
    assert "--microbatches 4 does not act without a pipeline" in _refusal(strategy="ddp", microbatches=4)
    assert "no gradient accumulation happens" in _refusal(strategy="ddp", micro_batch=8)
    fine = TrainConfig(device="cpu", steps=5, strategy="ddp", micro_batch=4)
    check_verifiable(fine, resolve_layout(fine, 2))  # 2 micro-batches per step: accumulation acts


def test_refusal_is_one_line_and_exit_2(cli_inproc):
    res = cli_inproc("verify", "--strategy", "ddp", "--nproc", "2", "--ddp-comm-hook", "powersgd")
    assert res.returncode == 2 and "verify refuses --ddp-comm-hook powersgd" in res.stderr
    assert len([line for line in res.stderr.splitlines() if line.strip()]) == 1, res.stderr


@pytest.mark.timeout(240)
def test_a_ranks_own_error_is_the_last_line(cli_here, tmp_path):
    """Issue 44: a rank's UserError (here: a transformers TP plan paratrain cannot translate) is the run's one last
    line and exit 2, not followed by torch elastic's pointer to its docs."""
    import json

    from paratrain.models.hf_model import build_hf_model
    from paratrain.models.hf_tp_plan import hf_tp_plan

    folder = tmp_path / "granite_swa"  # its plan's "local_params" style is not translated (gpt_neox's now is)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "granite_swa", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 128}))
    with pytest.raises(UserError) as refused:  # what the ranks meet, met here
        hf_tp_plan(build_hf_model(f"hf:{folder}", 0), tp=2, sp=False)
    res = cli_here("verify", "--model", f"hf:{folder}", "--strategy", "tp", "--nproc", "2", "--steps", "2")
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.splitlines()[-1] == f"error: {refused.value}", res.stderr[-2000:]


def registered(hooks: Hooks) -> dict:
    return {kind: len(hooks.callbacks(kind)) for kind in KINDS if hooks.callbacks(kind)}


def test_fault_plugin_plants_nothing_unless_named(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    hooks = Hooks()
    plugin(hooks)
    assert registered(hooks) == {}
    monkeypatch.setenv(FAULT_ENV, "dp-grad-sum")
    plugin(hooks)
    assert registered(hooks) == {"after_parallelize": 1}
    monkeypatch.setenv(FAULT_ENV, "typo")
    with pytest.raises(UserError, match="not a known mutation"):
        plugin(hooks)
    for name in MUTATIONS:  # each planted, then taken out again: the registry is as it was
        handles = plant(name, hooks)
        assert handles and registered(hooks) != {"after_parallelize": 1}
        for handle in handles:
            handle.remove()
        assert registered(hooks) == {"after_parallelize": 1}, name
