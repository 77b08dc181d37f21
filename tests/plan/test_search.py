"""Search, layouts and the time model's formulas: unit checks against hand computations."""

from __future__ import annotations

import pytest

from paratrain.costs.collectives import collective_time, wire_bytes
from paratrain.costs.hardware import profile_from_spec
from paratrain.gpu_catalog import get_gpu
from paratrain.models.presets import get_preset
from paratrain.parallel.group_nodes import members_per_node
from paratrain.parallel.layout import Layout
from paratrain.parallel.pp.pp_cost import in_flight, pipeline_factor
from paratrain.parallel.strategies import resolve_layout, train_args
from paratrain.plan.search import Job, base_layouts, structural_problem


def test_ring_formulas():
    prof = profile_from_spec(get_gpu("h100-sxm"))
    n, size = 8, 1e9
    assert wire_bytes("all_reduce", size, n) == pytest.approx(2 * 7 / 8 * size)
    assert wire_bytes("all_gather", size, n) == pytest.approx(7 / 8 * size)
    t = collective_time(prof, "all_reduce", size, n, "intra")
    bw = 450 * 0.8 * 1e9
    assert t == pytest.approx(2 * 7 / 8 * size / bw + 2 * 7 * 10e-6)
    assert collective_time(prof, "all_reduce", size, 1, "intra") == 0.0
    assert collective_time(prof, "all_gather", size, n, "inter") > 5 * collective_time(prof, "all_gather", size, n, "intra")


def test_placement_keeps_inner_dims_in_a_node():
    lay = Layout(dp_shard=4, tp=4)  # 16 GPUs, 8 per node
    assert lay.placement("tp", 8) == "intra"
    assert lay.placement("dp_shard", 8) == "inter"
    assert Layout(dp_replicate=2, tp=4).placement("dp", 8) == "intra"


def test_inter_node_groups_use_one_nic_per_member_on_a_node():
    prof = profile_from_spec(get_gpu("h100-sxm"))  # 50 GB/s NIC per GPU, 450 GB/s NVLink, 80% of each
    assert members_per_node(Layout(dp_shard=48), "dp_shard", 8) == 8
    assert members_per_node(Layout(dp_shard=48, tp=2), "dp_shard", 8) == 4
    assert members_per_node(Layout(dp_shard=48, tp=8), "dp_shard", 8) == 1
    size, n = 1e9, 48
    wire = 47 / 48 * size
    one = collective_time(prof, "reduce_scatter", size, n, "inter", 1)
    four = collective_time(prof, "reduce_scatter", size, n, "inter", 4)
    eight = collective_time(prof, "reduce_scatter", size, n, "inter", 8)
    latency = 47 * prof.latency_us["inter"] * 1e-6
    assert one - latency == pytest.approx(wire / (50 * 0.8e9))
    assert four - latency == pytest.approx(wire / (4 * 50 * 0.8e9))
    assert eight - latency == pytest.approx(wire / (400 * 0.8e9))
    # never faster than the NVLink that feeds the NICs, and a point-to-point hand-off uses one NIC
    assert collective_time(prof, "reduce_scatter", size, n, "inter", 16) - latency == pytest.approx(wire / (450 * 0.8e9))
    assert collective_time(prof, "p2p", size, 2, "inter", 8) == collective_time(prof, "p2p", size, 2, "inter", 1)


def test_pipeline_bubble_and_in_flight():
    assert pipeline_factor("1f1b", 4, 8, 1) == (8.0, 3.0)
    assert pipeline_factor("interleaved-1f1b", 4, 8, 2) == (8.0, 1.5)
    assert pipeline_factor("zero-bubble", 4, 8, 2)[1] == pytest.approx(0.5)
    assert [in_flight("1f1b", 4, r, 8, 1) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("gpipe", 4, 0, 8, 1) == 8


def test_base_layouts_respect_fixed_choices():
    job = Job(args=get_preset("small"), model_name="small", gpus=8, seq_len=256, global_batch=16)
    layouts = base_layouts(job, {"tp": 2, "pp": 1}, 8)
    assert layouts and all(lay.tp == 2 and lay.pp == 1 and lay.world == 8 for lay in layouts)
    assert all(lay.cp == 1 for lay in layouts)  # short sequences: CP is not searched unless asked for
    assert {lay.strategy for lay in layouts} >= {"zero3", "zero2", "ddp", "zero1", "hsdp"}


def test_structural_checks_use_the_runtime_rules():
    job = Job(args=get_preset("tiny"), model_name="tiny", gpus=8, seq_len=64, global_batch=8)
    assert "does not divide" in structural_problem(job, Layout(tp=8, micro_batch=8), 8)  # tiny has 4 heads
    assert structural_problem(job, Layout(dp_shard=8, micro_batch=1, microbatches=1), 8) is None


def test_candidates_run_unchanged_through_train_config():
    """A candidate's `paratrain train` arguments resolve to the very layout the planner evaluated."""
    from paratrain.cli import resolve_config

    job = Job(args=get_preset("tiny4"), model_name="tiny4", gpus=4, seq_len=64, global_batch=8)
    for lay in [Layout(dp_shard=2, tp=2, sp=True, zero_stage=3, micro_batch=2, microbatches=2, ac="selective"),
                Layout(pp=2, dp_replicate=2, pp_schedule="1f1b", micro_batch=1, microbatches=4),
                Layout(dp_replicate=2, dp_shard=2, zero_stage=3, micro_batch=1, microbatches=2),
                Layout(dp_replicate=4, zero_stage=1, micro_batch=2, microbatches=1),
                Layout(cp=2, dp_shard=2, cp_impl="ulysses", zero_stage=3, micro_batch=4, microbatches=1)]:
        argv = ["--model", job.model_name, *train_args(lay, job.seq_len, job.global_batch)]
        opts = {argv[i][2:].replace("-", "_"): argv[i + 1] for i in range(0, len(argv) - 1) if argv[i].startswith("--")
                and not argv[i + 1].startswith("--")}
        opts = {k: (int(v) if v.isdigit() else v) for k, v in opts.items()}
        opts["sp"] = "--sp" in argv
        cfg = resolve_config({**opts, "config": None})
        assert resolve_layout(cfg, lay.world) == lay, lay.label()


def test_async_tp_and_distributed_optimizer_pricing():
    """Async TP hides TP collectives under the matmuls only when compiled with SP; ZeRO-1 as a distributed optimizer
    reduce-scatters the gradients and all-gathers the parameters once per step instead of ZeRO's broadcasts."""
    from dataclasses import replace

    from paratrain.plan.costing.time import estimate_time

    prof = profile_from_spec(get_gpu("h100-sxm"))
    args = get_preset("small")
    lay = Layout(tp=2, sp=True, dp_replicate=8, zero_stage=1, micro_batch=1, microbatches=4, dtype="bf16",
                 compile=True)

    def est(layout, **kw):
        return estimate_time(prof, args, layout, 256, "bf16", "cuda", **kw)

    plain, overlapped = est(lay), est(lay, async_tp=True)
    assert overlapped.breakdown["tp_comm_s"] < 0.6 * plain.breakdown["tp_comm_s"]
    assert overlapped.step_s < plain.step_s
    # eager (no compile) or plain TP: torch's micro-pipelined TP does not apply, nothing changes
    for off in (replace(lay, compile=False), replace(lay, sp=False)):
        assert est(off, async_tp=True).step_s == pytest.approx(est(off).step_s)
    zero1, dist = est(lay), est(lay, dist_optimizer=True)
    assert "broadcast" in zero1.comm_by_kind and "broadcast" not in dist.comm_by_kind
    assert {"reduce_scatter", "all_gather"} <= set(dist.comm_by_kind)
    assert dist.breakdown["dp_comm_exposed_s"] < zero1.breakdown["dp_comm_exposed_s"]
    # bytes (no TP, whose SP collectives would add to the same kinds): the fp32 gradients reduce-scattered, the
    # bf16 parameters all-gathered
    dp_only = est(replace(lay, tp=1, sp=False, dp_replicate=16), dist_optimizer=True).comm_by_kind
    assert dp_only["all_gather"] == pytest.approx(dp_only["reduce_scatter"] / 2, rel=0.01)
