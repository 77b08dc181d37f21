"""The published-runs benchmark's rules and the distributed-optimizer overlap they rely on (hand computations);
the benchmark asks `paratrain plan` with each case's flags, and every scheme it prices is such a flag."""

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
    best, by_mb, _ = bench.evaluate_case(tiny_case(None))
    assert sorted(by_mb) == [1, 2, 4]  # the divisors of the local batch (32 / 8)
    assert best["micro_batch"] == min(by_mb, key=by_mb.get)
    assert best["step_time_s"] == min(by_mb.values())
    assert best["microbatches"] == 4 // best["micro_batch"]


def test_published_micro_batch_is_never_searched(bench):
    _, by_mb, _ = bench.evaluate_case(tiny_case(1))
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


def test_the_benchmark_answers_what_plan_json_answers_with_the_cases_flags(bench, cli_inproc):
    """One code path: a published case is priced by `paratrain plan --json` with the flags a user would give (a
    Megatron-Core row: the distributed optimizer, async TP, compile, 16-bit weights; its micro-batch left open by
    the source)."""
    case = next(c for c in bench.json.loads(bench.RUNS.read_text())["cases"] if c["id"] == "megatron-core-h100-7.1b")
    row = bench.predict(case)
    flags = row["plan_flags"]
    assert {"--dist-optimizer", "--async-tp", "--compile", "--half-weights", "--hf-config"} <= set(flags)
    assert flags[flags.index("--micro-batch") + 1] == str(row["micro_batch"])
    res = cli_inproc("plan", *flags, "--json")
    assert res.returncode == 0, res.stderr
    cand = res.json()["candidates"][0]
    assert cand["step_time_s"] == row["predicted_step_s"]
    assert cand["memory_gib"]["total"] == row["predicted_memory_gib"]
    assert res.json()["job"]["dist_optimizer"] and res.json()["job"]["async_tp"] and res.json()["job"]["half_weights"]
    # without the schemes' flags the same layout is priced as paratrain's runtime would run it: slower
    plain = [f for f in flags if f not in ("--dist-optimizer", "--async-tp", "--half-weights")]
    res = cli_inproc("plan", *plain, "--json")
    assert res.json()["candidates"][0]["step_time_s"] > row["predicted_step_s"] * 1.05


PLAN = ("plan", "--model", "llama-162m", "--gpu", "h100-sxm", "--seq-len", "1024", "--micro-batch", "1", "--ac", "none")


def _step(cli_inproc, *flags) -> dict:
    res = cli_inproc(*PLAN, *flags, "--json")
    assert res.returncode == 0, res.stderr
    return res.json()["candidates"][0]


def test_every_scheme_the_cost_model_prices_is_a_plan_flag(cli_inproc):
    """--dist-optimizer, --async-tp, --mem-bw-gbs and --moe-routing change what `plan` answers, and say so."""
    zero1 = ("--gpus", "32", "--global-batch", "64", "--strategy", "zero1", "--dp-replicate", "16", "--tp", "2",
             "--sp", "--compile")
    base = _step(cli_inproc, *zero1)
    dist = _step(cli_inproc, *zero1, "--dist-optimizer")
    assert dist["step_time_s"] < base["step_time_s"]
    assert any("--dist-optimizer" in r for r in dist["reasons"]) and not any("--dist-optimizer" in r for r in base["reasons"])
    overlapped = _step(cli_inproc, *zero1, "--async-tp")
    assert overlapped["time_breakdown_s"]["tp_comm_s"] < base["time_breakdown_s"]["tp_comm_s"]
    assert any("--async-tp" in r for r in overlapped["reasons"])
    fsdp = ("--gpus", "8", "--global-batch", "8", "--dp-shard", "8")
    slow = _step(cli_inproc, *fsdp, "--mem-bw-gbs", "1000")
    assert slow["step_time_s"] > _step(cli_inproc, *fsdp)["step_time_s"]
    moe = ("plan", "--model", "moe-tiny", "--gpu", "h100-sxm", "--gpus", "8", "--dp-shard", "8", "--ep", "2",
           "--global-batch", "8", "--micro-batch", "1", "--json")
    # moe-tiny's 4 experts, top-2, 2 per rank: consecutive experts (2t, 2t + 1) sit on one rank, a token's rows
    # reach 1 rank; two random ones reach 2 x (1 - 1/6) ranks (costs/expert_spread.py)
    random, consecutive = (cli_inproc(*moe, "--moe-routing", r).json() for r in ("random", "consecutive"))
    assert consecutive["job"]["moe_routing"] == "consecutive"
    assert consecutive["candidates"][0]["time_breakdown_s"]["ep_comm_s"] < \
        random["candidates"][0]["time_breakdown_s"]["ep_comm_s"]


@pytest.mark.parametrize("flags, message", [
    (("--moe-routing", "sorted"), "--moe-routing must be random or consecutive"),
    (("--async-tp",), "--async-tp prices torch's micro-pipelined TP, which runs compiled"),
    (("--mem-bw-gbs", "0"), "--mem-bw-gbs must be > 0"),
])
def test_a_bad_scheme_flag_is_one_line_and_exit_2(cli_inproc, flags, message):
    res = cli_inproc(*PLAN, "--gpus", "2", *flags)
    assert res.returncode == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1
