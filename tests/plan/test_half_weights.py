"""--half-weights (issue 51): Megatron holds its weights in 16 bits (Float16Module) with fp32 masters in the optimizer,
and its weight-gradient GEMMs accumulate into fp32 main gradients (--gradient-accumulation-fusion). paratrain's
autocast instead casts each fp32 weight in every micro-batch's forward, casts each gradient back and adds it into
fp32. The trace tags those ops (tracing/units.py MixedPrecisionOps); the time model leaves them out under the flag
and adds the masters' one copy into the weights per step."""

from __future__ import annotations

import collections

import pytest

from paratrain.costs.hardware import profile_from_spec
from paratrain.gpu_catalog import get_gpu
from paratrain.models.presets import get_preset
from paratrain.parallel.layout import Layout
from paratrain.plan.costing.time import estimate_time
from paratrain.plan.tracing.units import UnitKey, unit_trace

TAGS = ("weight_cast", "grad_cast", "grad_accumulate")


def _tagged_bytes(dtype: str, ac: str) -> tuple[dict, object]:
    ut = unit_trace(UnitKey(args=get_preset("tiny"), seq_len=64, dtype=dtype, micro_batch=1, ac=ac))
    out = {}
    for segment, ops in ut.ops.items():
        by = collections.Counter()
        for kind, _, nbytes, count, _ in ops:
            if kind in TAGS:
                by[kind] += nbytes * count
        out[segment] = by
    return out, ut


def _linear_params(args) -> int:
    """The block's matmul weights: the q, k, v and output projections and the three MLP matrices."""
    kv = args.n_kv_heads * (args.dim // args.n_heads)
    return 2 * args.dim * args.dim + 2 * kv * args.dim + 3 * args.dim * args.ffn_dim


@pytest.mark.parametrize("ac", ["none", "full"])
def test_the_trace_tags_autocasts_weight_casts_and_fp32_gradient_accumulation(ac):
    tagged, ut = _tagged_bytes("bf16", ac)
    linear = _linear_params(get_preset("tiny"))
    # each matmul weight read in fp32 and written in bf16 per use; a recomputation (full AC) casts it again
    assert tagged["block/fwd"]["weight_cast"] == 6 * linear
    assert tagged["block/bwd"]["weight_cast"] == (6 * linear if ac == "full" else 0)
    # its bf16 gradient cast back to fp32 (2 + 4 bytes), then every parameter's gradient added into the fp32 one
    assert tagged["block/bwd"]["grad_cast"] == 6 * linear
    assert tagged["block/bwd"]["grad_accumulate"] == 3 * ut.params["block"]
    fp32, _ = _tagged_bytes("fp32", ac)  # no autocast: no casts, the accumulation stays
    assert fp32["block/fwd"]["weight_cast"] == 0 and fp32["block/bwd"]["grad_cast"] == 0
    assert fp32["block/bwd"]["grad_accumulate"] == 3 * ut.params["block"]


def _step(m: int, dtype: str = "bf16", half_weights: bool = False, pp: int = 2):
    args = get_preset("tiny")
    layout = Layout(pp=pp, microbatches=m, dtype=dtype)
    return estimate_time(profile_from_spec(get_gpu("a100-80")), args, layout, 64, dtype, "cuda",
                         half_weights=half_weights)


def test_half_weights_drop_a_per_micro_batch_cost_and_add_one_copy_per_step():
    saved = {m: _step(m).compute_s - _step(m, half_weights=True).compute_s for m in (2, 4, 8)}
    assert saved[2] > 0
    # linear in the micro-batches: a term each micro-batch pays (the copy into the weights is once per step)
    assert saved[8] - saved[4] == pytest.approx(2 * (saved[4] - saved[2]), rel=1e-9)
    per_mb = (saved[4] - saved[2]) / 2
    assert saved[2] < 2 * per_mb  # the one copy per step is paid back
    # fp32 weights are what the run computes with: nothing to leave out
    assert _step(4, "fp32", True).step_s == _step(4, "fp32").step_s


def test_plan_half_weights_is_a_flag_that_says_so(cli_inproc):
    flags = ("plan", "--model", "tiny", "--gpu", "a100-80", "--gpus", "2", "--pp", "2", "--global-batch", "8",
             "--micro-batch", "1", "--seq-len", "64", "--json")
    plain, half = (cli_inproc(*flags, *extra) for extra in ((), ("--half-weights",)))
    assert plain.returncode == 0 and half.returncode == 0, half.stderr
    assert half.json()["job"]["half_weights"] and not plain.json()["job"]["half_weights"]
    fast, slow = half.json()["candidates"][0], plain.json()["candidates"][0]
    assert fast["step_time_s"] < slow["step_time_s"]
    assert any("--half-weights" in r for r in fast["reasons"]) and not any("--half-weights" in r for r in slow["reasons"])
