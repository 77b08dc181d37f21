"""doctor's pieces without processes: interval arithmetic, shapes, breakdown arithmetic, rule ranking,
trace merging, the NVML summary (with a stand-in NVML module), and timers that leave training unchanged."""

import json
from types import SimpleNamespace

import pytest

from paratrain.config import load_config
from paratrain.doctor.analyze import CATEGORIES, breakdown
from paratrain.doctor.chrome_trace import merge_traces
from paratrain.doctor.nvml import NvmlSampler, decode_reasons
from paratrain.doctor.profile_stats import intersect, merge, subtract, total
from paratrain.doctor.rules import Context, diagnose
from paratrain.doctor.shapes import misaligned_shapes, misaligned_share
from paratrain.models.presets import get_preset
from paratrain.parallel.layout import Layout


def test_interval_arithmetic():
    a = merge([(0, 10), (5, 12), (20, 30)])
    assert a == [(0, 12), (20, 30)]
    b = merge([(2, 4), (11, 25)])
    assert intersect(a, b) == [(2, 4), (11, 12), (20, 25)]
    assert subtract(a, b) == [(0, 2), (4, 11), (25, 30)]
    assert total(subtract(a, b)) + total(intersect(a, b)) == total(a)


def test_shapes_flags_gpt2_vocab_and_odd_hidden_with_padded_sizes():
    args = get_preset("tiny")
    import dataclasses

    odd = dataclasses.replace(args, vocab_size=50257, dim=96)
    issues = {i["name"]: i for i in misaligned_shapes(odd)}
    assert issues["vocab_size"]["padded"] == 50304 and issues["dim"]["padded"] == 128
    assert misaligned_share(list(issues.values())) == 1.0
    assert misaligned_shapes(get_preset("gpt2-124m")) == []  # already padded to 50304
    # under tp=4 the shard must be aligned: pad to a multiple of 256
    tp4 = {i["name"]: i for i in misaligned_shapes(dataclasses.replace(args, vocab_size=50304), tp=4)}
    assert tp4["vocab_size"]["padded"] == 50432


def capture(rank=0, *, iteration=0.1, data=0.0, fwd=0.03, bwd=0.05, opt=0.02, sync=0.0, busy_fb=0.07,
            busy_opt=0.02, ops_fb=100, ops_opt=20, comm=0.0, threads=1, cores=8, metrics_s=5e-6,
            flops=1e12, rate=1e10, pipeline_idle=None):
    steps = [{"step": i, "step_time_s": iteration, "data_wait_s": data, "iteration_s": iteration,
              "forward_s": fwd, "backward_s": bwd, "optimizer_s": opt, "loss_sync_s": sync,
              "pipeline_idle_s": pipeline_idle} for i in range(3)]
    return {"rank": rank, "steps": steps,
            "profile": {"ops_per_step": ops_fb + ops_opt, "ops_forward_backward": ops_fb, "ops_optimizer": ops_opt,
                        "busy_forward_backward_s": busy_fb, "busy_optimizer_s": busy_opt, "comm_exposed_s": comm,
                        "comm_in_flight_s": comm, "device_compute_s": None},
            "calibration": {"tiny_program_s": 1e-4, "tiny_program_ops": 100, "tiny_program_profiled_s": 1e-4,
                            "tiny_program_busy_s": 1e-4, "matmul_flops_per_s": rate, "metrics_record_s": metrics_s},
            "flops_per_step": flops, "tokens_per_step": 512, "memory_gib": 0.4, "model_state_bytes": None,
            "threads": threads, "cores": cores, "involuntary_switches_per_step": 3.0, "comm": None, "nvml": None}


def context(captures, budget=None, **cfg_over):
    cfg = load_config(None, {"strategy": "single", "nproc": 1, **cfg_over})
    world = len(captures)
    layout = Layout(dp_replicate=world, micro_batch=max(1, cfg.global_batch // world))
    from paratrain.models.presets import model_args_for

    return Context(cfg=cfg, args=model_args_for(cfg), layout=layout, device_type="cpu", analysis=breakdown(captures),
                   captures=captures, mem_budget_gib=budget)


def test_breakdown_sums_to_one_and_splits_host_from_compute():
    # 120 ops at 1 us fixed cost inside 90 ms of ops: 0.12 ms overhead in ops + 10 ms between ops
    b = breakdown([capture()])
    assert set(b["fractions"]) == set(CATEGORIES)
    assert sum(b["fractions"].values()) == pytest.approx(1.0)
    assert b["seconds"]["host_overhead"] == pytest.approx(0.01 + 120e-6, rel=1e-6)
    assert b["seconds"]["compute"] == pytest.approx(0.09 - 120e-6, rel=1e-6)
    # data wait and exposed collectives come out of the step as measured
    b = breakdown([capture(iteration=0.15, data=0.05, comm=0.02)])
    assert b["seconds"]["data_wait"] == pytest.approx(0.05)
    assert b["seconds"]["communication_exposed"] == pytest.approx(0.02)
    # a pipeline stage's measured idle time is its bubble, taken out of the exposed p2p waits first
    b = breakdown([capture(comm=0.03, pipeline_idle=0.02)])
    assert b["seconds"]["bubble"] == pytest.approx(0.02)
    assert b["seconds"]["communication_exposed"] == pytest.approx(0.01)
    assert breakdown([capture(comm=0.03)])["seconds"]["bubble"] == 0.0  # no pipeline: no bubble


def test_math_ceiling_turns_slow_tiny_ops_into_overhead():
    # 1 MFLOP at 10 GFLOP/s is 0.1 ms of math: at most 1 ms of the 70 ms in forward/backward ops is compute
    b = breakdown([capture(flops=1e6)])
    assert b["seconds"]["compute"] == pytest.approx(1e-3 + 0.02 - 20e-6, rel=1e-3)
    assert b["fractions"]["host_overhead"] > 0.7


def top(findings):
    return findings[0].cause if findings else None


def test_rules_rank_each_injected_cause_first():
    assert top(diagnose(context([capture(iteration=0.2, data=0.1)]))) == "data_loading"
    assert top(diagnose(context([capture(flops=1e6)]))) == "small_compute"
    assert top(diagnose(context([capture(comm=0.05), capture(1, comm=0.05)], strategy="ddp"))) == "communication"
    assert top(diagnose(context([capture()], vocab_size=50257, dim=96))) == "shapes"
    assert top(diagnose(context([capture(threads=4, cores=2), capture(1, threads=4, cores=2)],
                                strategy="ddp"))) == "allocation"
    memory = diagnose(context([capture()], budget=0.3))
    assert top(memory) == "memory" and "--strategy zero3" in memory[0].fix
    quiet = diagnose(context([capture()], metrics=False))
    assert [f.cause for f in quiet] == ["monitoring"] and quiet[0].severity == "low"
    assert diagnose(context([capture()])) == []  # a healthy run has nothing to say


def test_unbalanced_pipeline_stages_are_an_allocation_finding():
    ctx = context([capture(), capture(1)], strategy="pp")
    ctx.layout = Layout(pp=2, microbatches=2, micro_batch=8)
    import dataclasses

    ctx.args = dataclasses.replace(get_preset("tiny"), n_layers=3)
    finding = diagnose(ctx)[0]
    assert finding.cause == "allocation" and finding.numbers["layers_per_stage"] == [2, 1]


def test_merge_traces_names_ranks_and_adds_data_wait(tmp_path):
    for rank in (0, 1):
        doc = {"baseTimeNanoseconds": 1000 * rank, "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 10 + rank, "tid": 0, "args": {"name": "python"}},
            {"ph": "X", "name": "paratrain.forward_backward", "pid": 10 + rank, "tid": 5, "ts": 100.0, "dur": 50.0},
            {"ph": "X", "name": "aten::mm", "pid": 10 + rank, "tid": 5, "ts": 110.0, "dur": 5.0}]}
        (tmp_path / f"r{rank}.json").write_text(json.dumps(doc))
    out = merge_traces([(r, str(tmp_path / f"r{r}.json"), [20e-6]) for r in (0, 1)], tmp_path / "t.json")
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {"rank 0", "rank 1"}
    waits = [e for e in events if e["name"] == "paratrain.data_wait"]
    assert len(waits) == 2 and waits[0]["dur"] == pytest.approx(20.0)
    assert not (tmp_path / "r0.json").exists()


class FakeNvml:
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"Fake GPU"

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 3

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 4

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 300000

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return 1980

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=40, memory=20)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=2 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h):
        return 150000

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1500

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return 0x4 | 0x20


def test_nvml_sampler_summarises_telemetry_with_a_stand_in_module():
    sampler = NvmlSampler(0, nvml=FakeNvml())
    assert sampler.available
    for _ in range(3):
        sampler.samples.append(sampler.sample_once())
    summary = sampler.stop()
    assert summary["sm_util_mean"] == 40 and summary["power_limit_w"] == 300 and summary["name"] == "Fake GPU"
    assert summary["throttle_reasons"] == {"sw_power_cap": 1.0, "sw_thermal_slowdown": 1.0}
    assert summary["pcie_gen"] == 3 and summary["pcie_gen_max"] == 4
    assert decode_reasons(0x1) == ["gpu_idle"]
    assert NvmlSampler(0, nvml=None).available in (False, True)  # real NVML: absent here, optional anyway


@pytest.mark.timeout(120)
def test_phase_timer_leaves_training_unchanged(monkeypatch):
    """Same losses with and without the timer (and the profiler ranges it opens) attached."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded by monkeypatch, so what init_runtime sets is undone after
        monkeypatch.delenv(key)
    from paratrain.doctor.timers import PhaseTimer
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer

    cfg = load_config(None, {"strategy": "single", "nproc": 1, "steps": 3, "metrics": False, "global_batch": 2,
                             "seq_len": 16})
    rt = init_runtime("cpu", 60)
    try:
        plain = Trainer(cfg, rt, quiet=True).fit()["losses"]
        timed = Trainer(cfg, rt, quiet=True)
        timer = PhaseTimer("cpu", annotate=True)
        timer.attach(timed)
        seen = []
        losses = timed.fit(on_step=lambda t, r: seen.append(dict(timer.current)))["losses"]
    finally:
        shutdown()
    assert losses == plain
    assert all(s["forward"] > 0 and s["backward"] > 0 and s["optimizer"] > 0 for s in seen)


def test_communication_is_graded_by_its_counterfactual_cost_not_only_exposure():
    # exposed 2 ms of a 100 ms step (below the 3% floor), but skipping the gradient sync saves 23 ms: as in
    # issue #20, gloo's threads slowed compute without leaving the step waiting
    probes = {"rounds": 3, "staged_s": 0.1, "staged_forward_backward_s": 0.08, "staged_optimizer_s": 0.02,
              "no_optimizer_s": 0.08,
              "no_grad_sync_s": 0.077, "no_grad_sync_forward_backward_s": 0.057}
    caps = [{**capture(rank, comm=0.002), "probes": probes} for rank in (0, 1)]
    ctx = context(caps, strategy="ddp")
    assert ctx.analysis["counterfactual"]["seconds"]["communication"] == pytest.approx(0.023)
    comm = next(f for f in diagnose(ctx) if f.cause == "communication")
    assert comm.severity == "medium" and comm.score == pytest.approx(0.23)
    assert comm.numbers["exposed_fraction"] == pytest.approx(0.02) and "no_sync" in comm.evidence
    # without the probe the same run is graded by exposure alone: below the floor, no finding
    bare = context([capture(rank, comm=0.002) for rank in (0, 1)], strategy="ddp")
    assert all(f.cause != "communication" for f in diagnose(bare))


def test_alone_probe_splits_running_distributed_into_sync_and_peer_contention():
    # full step 100 ms; without the sync 77 ms (sync 23 ms on forward+backward); alone 60 ms: running distributed
    # costs 40 ms, 17 ms of it peer-rank contention; the finding is ranked by the 40 ms
    probes = {"rounds": 3, "staged_s": 0.1, "staged_forward_backward_s": 0.08, "staged_optimizer_s": 0.02,
              "no_optimizer_s": 0.08,
              "no_grad_sync_s": 0.077, "no_grad_sync_forward_backward_s": 0.057, "alone_s": 0.06}
    ctx = context([{**capture(rank, comm=0.002), "probes": probes} for rank in (0, 1)], strategy="ddp")
    assert ctx.analysis["counterfactual"]["seconds"]["communication"] == pytest.approx(0.04)
    split = ctx.analysis["counterfactual"]["communication_split"]
    assert split == pytest.approx({"sync_s": 0.023, "contention_s": 0.017, "distributed_s": 0.04})
    comm = next(f for f in diagnose(ctx) if f.cause == "communication")
    assert comm.score == pytest.approx(0.4) and comm.numbers["contention_ms"] == pytest.approx(17)
    assert "one rank alone" in comm.evidence and "contention" in comm.evidence


def test_oversubscribed_cores_charge_peer_contention_to_allocation_not_communication():
    # the same probes, but 2 ranks x 4 threads on 2 cores: the contention is the oversubscription's doing, so the
    # communication finding is ranked by the 23 ms sync alone and the allocation finding comes first
    probes = {"rounds": 3, "staged_s": 0.1, "staged_forward_backward_s": 0.08, "staged_optimizer_s": 0.02,
              "no_optimizer_s": 0.08,
              "no_grad_sync_s": 0.077, "no_grad_sync_forward_backward_s": 0.057, "alone_s": 0.02}
    ctx = context([{**capture(rank, comm=0.002, threads=4, cores=2), "probes": probes} for rank in (0, 1)],
                  strategy="ddp")
    findings = diagnose(ctx)
    comm = next(f for f in findings if f.cause == "communication")
    assert comm.score == pytest.approx(0.23) and comm.numbers["counterfactual_ms"] == pytest.approx(23)
    assert "contention" not in comm.evidence
    assert findings[0].cause == "allocation" and findings[0].severity == "high"
    # with enough cores the same numbers rank running distributed (80 ms) first, as communication
    fits = context([{**capture(rank, comm=0.002, threads=1, cores=2), "probes": probes} for rank in (0, 1)],
                   strategy="ddp")
    assert diagnose(fits)[0].cause == "communication" and diagnose(fits)[0].score == pytest.approx(0.8)


def test_configured_dp_batch_split_is_not_a_straggler():
    # rank 0 reads 3 sequences per step, rank 1 one: 3x the compute is the configured split, not a straggler
    heavy = capture(0, iteration=0.3, fwd=0.09, bwd=0.15, opt=0.06, busy_fb=0.21, busy_opt=0.06, ops_fb=300)
    caps = [heavy, capture(1)]
    even = context(caps, strategy="ddp")
    assert top(diagnose(even)) == "allocation"  # the fault: the same times with an even split are a straggler
    split = context(caps, strategy="ddp")
    split.layout = Layout(dp_replicate=2, micro_batch=2, dp_micro_batches=(3, 1))
    assert all(f.cause != "allocation" for f in diagnose(split))
    # per sequence, rank 1 is now 3x slower: that is a straggler, and the finding names the split
    split.analysis = breakdown([capture(0), capture(1, iteration=0.3, fwd=0.09, bwd=0.15, opt=0.06, busy_fb=0.21,
                                                       busy_opt=0.06, ops_fb=300)])
    found = next(f for f in diagnose(split) if f.cause == "allocation")
    assert "--dp-batch-split" in found.evidence and found.numbers["sequences_per_rank"] == [3, 1]


def test_optimizer_cost_is_its_phase_not_whole_steps_that_differ_by_noise():
    # issue 35: the optimizer took 40 ms of a ~1 s step, but the no-optimizer probe's forward+backward happened
    # to run 60 ms slower, so whole steps said removing the optimizer saves 0.0 ms against the phase bars' 40 ms
    probes = {"rounds": 3, "staged_s": 1.0, "staged_forward_backward_s": 0.955, "staged_optimizer_s": 0.04,
              "no_optimizer_s": 1.015, "no_optimizer_forward_backward_s": 1.015, "no_optimizer_optimizer_s": 0.0}
    ctx = context([{**capture(rank, iteration=1.0, fwd=0.3, bwd=0.655, opt=0.04), "probes": probes} for rank in (0, 1)],
                  strategy="ddp")
    saved = ctx.analysis["counterfactual"]["seconds"]["optimizer"]
    measured = ctx.analysis["per_rank"][0]["phases_s"]["optimizer"]
    assert saved == pytest.approx(0.04) and saved == pytest.approx(measured)


def test_data_loading_cost_compares_fastest_with_fastest():
    # a staged step as fast as the fastest real step: the loader costs nothing, however slow the other steps were
    cap = capture(iteration=0.1)
    cap["steps"][1]["step_time_s"] = 0.16  # one step slowed by the machine, not by the loader
    probes = {"rounds": 3, "staged_s": 0.1, "staged_forward_backward_s": 0.08, "staged_optimizer_s": 0.02,
              "no_optimizer_s": 0.08}
    ctx = context([{**cap, "probes": probes}])
    assert ctx.analysis["counterfactual"]["seconds"]["data_loading"] == pytest.approx(0.0)


def test_shapes_fix_on_an_hf_model_names_its_config_json_keys(tmp_path):
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512}))
    ctx = context([capture()], model=f"hf:{folder}")
    fix = next(f for f in diagnose(ctx) if f.cause == "shapes").fix
    assert "intermediate_size = 384" in fix and "vocab_size = 1024" in fix and str(folder / "config.json") in fix
    assert "ffn_dim" not in fix and "--config TOML" not in fix  # the hf: path refuses shape keys in the TOML
    pretrained = context([capture()], model=f"hf:{folder}", init_from=str(folder))
    fix = next(f for f in diagnose(pretrained) if f.cause == "shapes").fix
    assert "--micro-batch" in fix and "intermediate_size" not in fix


def test_straggler_is_the_rank_that_arrives_late_not_the_ones_that_wait():
    # issue 34: rank 1 spends 60 ms more in its optimizer; rank 0 waits that long in the loss all-reduce. Whole
    # steps are equal, so busy time cannot tell them apart; the time before the loss all-reduce can.
    # (its profiled ops are the same: a throttled or shared device, which the compute comparison cannot see)
    late = capture(1, opt=0.08, sync=0.0, iteration=0.16)
    waits = capture(0, opt=0.02, sync=0.06, iteration=0.16)
    found = next(f for f in diagnose(context([waits, late], strategy="ddp")) if f.cause == "straggler")
    assert found.numbers["rank"] == 1 and found.numbers["phase"] == "optimizer", found
    even = [capture(0, sync=0.01), capture(1, sync=0.01)]  # the fault removed: no straggler
    assert all(f.cause != "straggler" for f in diagnose(context(even, strategy="ddp")))
