"""The calibration's fit (calibrate/fit.py): given reference step times that a known set of costs would produce,
it recovers those costs; and a fitted cost moves the prediction of the strategy it belongs to only."""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.calibrate import fit
from paratrain.costs.hardware import profile_from_spec
from paratrain.gpu_catalog import get_gpu

TRUE_COSTS = {"ddp_us_per_mib": 300.0, "fsdp_scale": 1.2, "fsdp_bwd_scale": 0.8, "dtensor_op": 40.0,
              "sp_call": 700.0, "cp_p2p_call": 500.0, "cp_all_to_all_call": 250.0, "pp_microbatch": 800.0}


def cpu_profile():
    """A host-synchronous (CPU-like) profile with measured-looking collectives and FSDP group costs."""
    profile = profile_from_spec(get_gpu("cpu"))
    profile.overhead_overlaps = False
    profile.op_overhead_us = {"fwd": 2.0, "bwd": 3.0, "view": 0.5, "opt": 2.0}
    profile.collectives = {k: {"latency_us": 900.0, "busbw_gbs": 1.5}
                           for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p")}
    profile.framework_us.update({"fsdp_world": 2.0, "fsdp_gather_us": 2000.0, "fsdp_gather_us_per_mib": 900.0,
                                 "fsdp_bwd_gather_us": 300.0, "fsdp_bwd_gather_us_per_mib": 1200.0,
                                 "fsdp_reduce_scatter_us": 1700.0, "fsdp_reduce_scatter_us_per_mib": 1500.0})
    return profile


@pytest.mark.timeout(240)
def test_fit_recovers_known_costs():
    truth = cpu_profile()
    truth.compute_scale, truth.overhead_scale = 1.4, 5.0
    truth.framework_us.update(TRUE_COSTS)
    measured = {name: fit._predict(truth, name, 2, "cpu") for name, _, _ in fit.FITS}

    fitted = cpu_profile()
    fit.fit_profile(fitted, measured, 2, "cpu")
    assert fitted.compute_scale == pytest.approx(1.4, rel=1e-6)
    assert fitted.overhead_scale == pytest.approx(5.0, rel=1e-6)
    for cost, value in TRUE_COSTS.items():
        assert fitted.framework_us[cost] == pytest.approx(value, rel=1e-6), cost
    assert sum(n.startswith("fit: reference step") for n in fitted.notes) == len(fit.FITS) - 1


def test_a_cost_the_reference_does_not_need_is_clamped_at_zero():
    profile = cpu_profile()
    measured = {"pp": 0.5 * fit._predict(profile, "pp", 2, "cpu")}  # faster than the model with no extra cost
    fit.fit_profile(profile, measured, 2, "cpu")
    assert profile.framework_us["pp_microbatch"] == 0.0


def test_each_cost_moves_only_the_strategies_that_pay_it():
    base = cpu_profile()
    names = ("ddp", "zero2", "zero3", "tp", "tp-sp", "cp-ring", "cp-ulysses", "pp")
    before = {name: fit._predict(base, name, 2, "cpu") for name in names}
    payers = {"ddp_us_per_mib": {"ddp", "cp-ring", "cp-ulysses"},  # CP runs DDP over its dp x cp group
              "fsdp_scale": {"zero2", "zero3"}, "fsdp_bwd_scale": {"zero3"}, "dtensor_op": {"tp", "tp-sp"},
              "sp_call": {"tp-sp"},  # plain TP keeps the logits vocabulary-sharded into the loss (loss parallel)
              "cp_p2p_call": {"cp-ring"}, "cp_all_to_all_call": {"cp-ulysses"}, "pp_microbatch": {"pp"}}
    for cost, paying in payers.items():
        changed = dataclasses.replace(base, framework_us={**base.framework_us, cost: 1000.0})
        for name, t in before.items():
            after = fit._predict(changed, name, 2, "cpu")
            if name in paying:
                assert after > t, (cost, name)
            else:
                assert after == pytest.approx(t), (cost, name)
