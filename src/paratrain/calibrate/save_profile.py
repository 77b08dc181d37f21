"""`paratrain plan --calibrate`: run the microbenchmarks and reference training steps on this machine, and
turn them into a hardware profile (saved where `plan` and `train --strategy auto` look)."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from paratrain.calibrate.fit import fit_profile
from paratrain.calibrate.microbench import (
    MATMUL_SIZES,
    bench_collectives,
    bench_matmul,
    bench_memory,
    bench_overheads,
    bench_overlap,
)
from paratrain.calibrate.timing import record_latencies
from paratrain.costs.hardware import HardwareProfile, default_profile_path, detect
from paratrain.gpu_catalog import GPUSpec
from paratrain.plan.request import PlanRequest

log = logging.getLogger("paratrain")


def calibrate_worker(opts: dict) -> dict | None:
    from paratrain.calibrate.fit import measure_references
    from paratrain.calibrate.framework_bench import bench_framework
    from paratrain.train.runtime import init_runtime, shutdown

    rt = init_runtime(opts.get("device", "auto"), float(opts.get("timeout_s", 120)))
    budget = float(opts.get("budget_s", 0.05))
    torch.manual_seed(rt.rank)
    try:
        result = {
            "matmul": bench_matmul(rt.device, opts.get("matmul_sizes") or MATMUL_SIZES[rt.device_type], budget),
            "mem_bw_gbs": bench_memory(rt.device, budget),
            "overheads": bench_overheads(rt.device, budget),
        }
        if rt.world_size > 1:
            dist.barrier()
            result["collectives"] = bench_collectives(rt.device, opts.get("comm_sizes", (2**14, 2**18, 2**21, 2**23)),
                                                      budget)
            record_latencies(result["collectives"])
            result["overlap"] = bench_overlap(rt.device, budget)
            result["framework"] = bench_framework(rt.device, budget)
        rounds = int(opts.get("rounds", 9))
        # a one-round (quick) calibration warms up once: each visit's untimed first step already re-warms caches
        result["reference_steps"] = measure_references(rt, rounds=rounds, warmup=min(2, rounds))
        result["device_type"] = rt.device_type
        result["backend"] = rt.backend
        result["world"] = rt.world_size
    finally:
        shutdown()
    return result if rt.rank == 0 else None


def calibrate(nproc: int = 2, device: str = "auto", timeout_s: float = 120.0, budget_s: float = 0.05,
              rounds: int = 9) -> HardwareProfile:
    """Run the microbenchmarks on `nproc` local processes and turn rank 0's figures into a profile."""
    from paratrain.train.launch import run_workers

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(nproc, 1))))
    raw = run_workers(calibrate_worker, ({"device": device, "timeout_s": timeout_s, "budget_s": budget_s,
                                             "rounds": rounds},), nproc,
                      0, timeout_s)[0]
    return profile_from_measurements(raw, nproc)


def profile_from_measurements(raw: dict, nproc: int) -> HardwareProfile:
    machine = detect()
    on_cpu = raw["device_type"] == "cpu"
    best = {d: max(r for _, r in pts) for d, pts in raw["matmul"].items()}
    p2p = raw.get("collectives", {}).get("p2p", {}).get("busbw_gbs") or 1.0
    name = "cpu" if on_cpu else (machine.get("gpu") or machine.get("device_name", "gpu"))
    mem_gib = machine["mem_gib"] / max(nproc, 1) if on_cpu else machine["mem_gib"]
    spec = GPUSpec(name=name, peak_tflops=best, mem_gib=round(mem_gib, 2), intra_node_gbs=p2p, inter_node_gbs=p2p,
                   gpus_per_node=nproc if on_cpu else machine.get("gpus_per_node", nproc),
                   mem_bw_gbs=raw["mem_bw_gbs"],
                   source=f"calibrated with {raw['world']} {raw['backend']} process(es) on this machine: peak = the "
                          "best matmul rate measured per dtype",
                   assumptions=f"memory per device = machine memory / {nproc} processes" if on_cpu else "")
    collectives = {k: {"latency_us": v["latency_us"], "busbw_gbs": v["busbw_gbs"]}
                   for k, v in raw.get("collectives", {}).items()}
    notes = [f"{k}: {v['latency_us']:.0f} us + bytes / {v['busbw_gbs']:.2f} GB/s" for k, v in collectives.items()]
    profile = HardwareProfile(gpu=spec, dtype_tflops=best, matmul_curve=raw["matmul"], attention_tflops_fraction=1.0,
                           mem_bw_gbs=raw["mem_bw_gbs"], op_overhead_us=raw["overheads"], overhead_overlaps=not on_cpu,
                           collectives=collectives, link_gbs={"intra": p2p, "inter": p2p},
                           latency_us={"intra": collectives.get("p2p", {}).get("latency_us", 10.0),
                                       "inter": collectives.get("p2p", {}).get("latency_us", 10.0)},
                           overlap=raw.get("overlap", 0.5), calibrated=True,
                           framework_us={"dtensor_op": 0.0, "fsdp_param": 0.0, "pp_microbatch": 0.0,
                                         **raw.get("framework", {})},
                           source=f"calibrated ({raw['backend']}, {raw['world']} processes)", notes=notes)
    fit_profile(profile, raw.get("reference_steps", {}), raw["world"], raw["device_type"])
    return profile


def calibrate_and_save(request: PlanRequest) -> tuple[HardwareProfile, str]:
    """`plan --calibrate`: calibrate with request.nproc processes (on this machine's default device), save to
    request.hardware (or the default path)."""
    nproc, rounds = request.nproc or 2, request.calibrate_rounds or 9
    log.info("calibrating on %d process(es): microbenchmarks, then %d rounds of reference training steps under "
             "each strategy (about two minutes at 9 rounds on a 2-core machine)", nproc, rounds)
    profile = calibrate(nproc=nproc, rounds=rounds)
    path = request.hardware or str(default_profile_path())
    profile.save(path)
    return profile, path
