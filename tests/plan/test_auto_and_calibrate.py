"""`plan --calibrate` (microbenchmarks on 2 gloo ranks -> a profile `--hardware` reads) and `--strategy auto`."""

from __future__ import annotations

import pytest

from helpers import CLIResult
from paratrain.config import TrainConfig
from paratrain.costs.hardware import load_profile
from paratrain.plan.auto import resolve_auto_strategy
from reliability.inproc import run_cli_inproc


@pytest.mark.timeout(600)
def test_calibrate_then_plan_with_the_profile(tmp_path):
    profile = tmp_path / "cpu.json"
    # 1 round (the default is 9) keeps this end-to-end check short; the fit's quality at the default is what
    # benchmarks/planner_accuracy.py measures. In this process: its 2 ranks fork from the suite's warm forkserver
    res = CLIResult(*run_cli_inproc(["plan", "--calibrate", "--calibrate-rounds", "1", "--hardware", str(profile),
                                     "--nproc", "2", "--json"], cwd=tmp_path))
    assert res.returncode == 0, res.stderr
    prof = load_profile(profile)
    assert prof.calibrated and prof.gpu.name == "cpu" and prof.dtype_tflops["fp32"] > 0
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        assert prof.collectives[kind]["busbw_gbs"] > 0
    assert prof.compute_scale > 0 and prof.op_overhead_us["fwd"] > 0
    # the reference steps were measured and every framework cost fitted (and saved) from them
    fitted = [n for n in prof.notes if n.startswith("fit: reference step")]
    assert len(fitted) == 9, prof.notes
    for cost in ("ddp_us_per_mib", "fsdp_scale", "fsdp_bwd_scale", "dtensor_op", "sp_call", "cp_p2p_call",
                 "cp_all_to_all_call", "pp_microbatch", "fsdp_gather_us", "fsdp_reduce_scatter_us_per_mib"):
        assert prof.framework_us[cost] >= 0
    # in this process: planning starts no worker
    plan = CLIResult(*run_cli_inproc(["plan", "--model", "tiny", "--hardware", str(profile), "--gpus", "2", "--seq-len",
                                      "64", "--global-batch", "8", "--dtype", "fp32", "--json", "--top", "3"],
                                     cwd=tmp_path))
    assert plan.returncode == 0, plan.stderr
    doc = plan.json()
    assert doc["cluster"]["calibrated"] and doc["fits"] and doc["candidates"][0]["step_time_s"] > 0


def test_auto_picks_a_runnable_layout(monkeypatch, tmp_path):
    # no saved profile: the catalog's cpu entry (the session's trace cache stays: traces other tests made are reused)
    monkeypatch.setenv("PARATRAIN_HARDWARE", str(tmp_path / "no-profile.json"))
    cfg = TrainConfig(model="tiny", strategy="auto", nproc=2, device="cpu", seq_len=64, global_batch=8)
    resolved = resolve_auto_strategy(cfg)
    assert resolved.strategy != "auto" and resolved.nproc == 2
    from paratrain.train.validate import validate_run

    dims = validate_run(resolved, 2)
    assert dims.world_size == 2


@pytest.mark.timeout(200)
def test_train_strategy_auto_runs(cli_here):
    res = cli_here("train", "--strategy", "auto", "--model", "tiny", "--nproc", "2", "--steps", "2", "--device", "cpu",
              "--seq-len", "32", "--global-batch", "4", "--timeout-s", "120", "--json", "--no-metrics", timeout=190)
    assert res.returncode == 0, res.stderr
    assert "--strategy auto" in res.stderr and "because:" in res.stderr
    assert res.json()["steps"] == 2
