"""The published-runs benchmark's rules and the distributed-optimizer overlap they rely on (hand computations)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from paratrain.costs.collectives import collective_time
from paratrain.costs.hardware import profile_from_spec
from paratrain.gpu_catalog import get_gpu
from paratrain.parallel.dp.dp_cost import DDP_BUCKET_BYTES, distributed_optimizer_comm
from paratrain.parallel.layout import Layout
from paratrain.plan.costing.time import TimeEstimate

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "planner_published.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("planner_published", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_case(micro_batch):
    """A small GPT on 16 H100s, TP 2 x DP 8 with the distributed optimizer: local batch 4."""
    return {"id": "tiny", "model": {"family": "gpt2", "layers": 2, "dim": 256, "heads": 4, "ffn_dim": 1024,
                                    "vocab_size": 1024, "seq_len": 256},
            "gpu": "h100-sxm", "gpus": 16,
            "layout": {"tp": 2, "pp": 1, "dp_replicate": 8, "dp_shard": 1, "cp": 1, "sp": True, "zero_stage": 1,
                       "pp_schedule": "1f1b", "virtual_stages": 1},
            "global_batch": 32, "micro_batch": micro_batch, "precision": "bf16", "recompute": "none",
            "dist_optimizer": True, "runtime_unsupported": "priced only", "kind": "TP+DP",
            "published": {"step_time_s": 1.0}}


def test_unpublished_micro_batch_is_the_planners_fastest_of_every_valid_one(bench):
    best, by_mb = bench.evaluate_case(tiny_case(None))
    assert sorted(by_mb) == [1, 2, 4]  # the divisors of the local batch (32 / 8)
    assert best.layout.micro_batch == min(by_mb, key=by_mb.get)
    assert best.time.step_s == min(by_mb.values())
    assert best.layout.microbatches == 4 // best.layout.micro_batch


def test_published_micro_batch_is_never_searched(bench):
    _, by_mb = bench.evaluate_case(tiny_case(1))
    assert list(by_mb) == [1]
    row = bench.predict(tiny_case(2))
    assert row["micro_batch"] == 2 and not row["micro_batch_searched"]


def test_pipelined_unpublished_micro_batch_keeps_one_per_stage(bench):
    case = tiny_case(None)
    case["layout"].update(pp=2, tp=1)  # 16 = pp 2 x dp 8: local batch 4, 1F1B needs 4 / mb >= 2
    assert bench.micro_batch_choices(case) == [1, 2]


def test_distributed_optimizer_hides_only_under_the_compute_it_is_given():
    """Megatron-Core reduces gradients during the last micro-batch's backward only (earlier ones run under
    no_sync) and gathers parameters under the first forward: the exposed time is what does not fit under that
    one micro-batch, plus a bucket each way; the caller passes one micro-batch's forward and backward."""
    prof = profile_from_spec(get_gpu("h100-sxm"))
    lay = Layout(tp=8, dp_replicate=48, zero_stage=1, sp=True)  # one data-parallel member per node: one NIC
    grads, params = 16e9, 8e9

    def rails(group):  # one member per node: one NIC
        return 1

    def expected(fwd, bwd):
        total = 0.0
        for kind, nbytes, under in (("reduce_scatter", grads, bwd), ("all_gather", params, fwd)):
            whole = collective_time(prof, kind, nbytes, 48, "inter", 1)
            bucket = collective_time(prof, kind, DDP_BUCKET_BYTES, 48, "inter", 1)
            total += bucket + max(0.0, whole - bucket - prof.overlap * under)
        return total

    short = distributed_optimizer_comm(prof, lay, grads, params, 0.06, 0.13, TimeEstimate(), rails)
    long = distributed_optimizer_comm(prof, lay, grads, params, 0.25, 0.55, TimeEstimate(), rails)
    assert short == pytest.approx(expected(0.06, 0.13))
    assert long == pytest.approx(expected(0.25, 0.55))
    # 16 GB of fp32 gradients over one 400 Gb/s NIC at 80% take ~0.39 s: a 0.13 s backward leaves most exposed
    assert short > 0.3 and long < 0.1


def test_a_board_variants_stated_memory_bandwidth_prices_memory_bound_ops_and_keeps_the_peaks():
    """torchtitan's H100s are 96 GB HBM2e boards at 2.4 TB/s: memory-bound work slows by 3.35 / 2.4, matmuls keep
    the SXM datasheet peak."""
    from paratrain.costs.hardware import with_cluster_overrides
    from paratrain.plan.costing.time import op_cost

    sxm = profile_from_spec(get_gpu("h100-sxm"))
    board = profile_from_spec(with_cluster_overrides(get_gpu("h100-sxm"), mem_gib=96, mem_bw_gbs=2400))
    assert board.gpu.mem_gib == 96 and board.dtype_tflops == sxm.dtype_tflops
    mem_sxm, mem_board = op_cost(sxm, "bf16", "fwd")("mem", 0.0, 1e9), op_cost(board, "bf16", "fwd")("mem", 0.0, 1e9)
    assert mem_board / mem_sxm == pytest.approx(3350 / 2400)
    big_mm = (1e13, 1e8)  # compute-bound: the same on both
    assert op_cost(board, "bf16", "fwd")("mm", *big_mm) == op_cost(sxm, "bf16", "fwd")("mm", *big_mm)
