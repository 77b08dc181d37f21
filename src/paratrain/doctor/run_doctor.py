"""`paratrain doctor`: run the configured training for a few steps, measured, and diagnose it."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from paratrain.errors import CheckFailed, UserError

log = logging.getLogger("paratrain")


def run_doctor(cfg, steps: int, warmup: int, trace: str | None, mem_budget_gib: float | None,
               probe_rounds: int = 3) -> dict | None:
    """The doctor report (see report.build_report); None on a non-zero rank under torchrun/srun.

    `probe_rounds`: rounds of counterfactual probe steps (0: none, costs by exposure only)."""
    from paratrain.doctor.capture import PROFILED_STEPS, doctor_worker
    from paratrain.doctor.chrome_trace import merge_traces
    from paratrain.doctor.doctor_report import build_report
    from paratrain.models.presets import model_args_for
    from paratrain.parallel.layout import Layout
    from paratrain.plan.predict import predict_layout
    from paratrain.train.launch import run_workers
    from paratrain.train.runtime import pick_device_type
    from paratrain.train.validate import validate_run, world_size_for

    if steps < 1:
        raise UserError("--steps must be at least 1")
    if warmup < 1:
        raise UserError("--warmup must be at least 1 (the first step includes one-time setup)")
    if mem_budget_gib is not None and mem_budget_gib <= 0:
        raise UserError("--mem-budget-gib must be positive")
    if probe_rounds < 0:
        raise UserError("--probe-rounds must be 0 or more")
    cfg = cfg.model_copy(update={"steps": warmup + steps + PROFILED_STEPS, "resume": "never", "ckpt_every": 0})
    world = world_size_for(cfg)
    validate_run(cfg, world)
    args = model_args_for(cfg)
    device_type = pick_device_type(cfg.device)
    temp = cfg.out is None
    run_dir = Path(tempfile.mkdtemp(prefix="paratrain-doctor-")) if temp else Path(cfg.out)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create run directory {run_dir}: {exc.strerror or exc}") from None
    stub = str(run_dir / "doctor-trace.json") if trace else None
    log.info("doctor: %d warm-up + %d measured steps of %s on %d process(es)", warmup, steps, cfg.strategy, world)
    try:
        results = run_workers(doctor_worker, (cfg.model_dump(), str(run_dir), warmup, steps, stub, probe_rounds),
                              world, 0, cfg.timeout_s)
        if 0 not in results:
            return None
        result = results[0]
        if result is None:
            raise CheckFailed("rank 0 returned no measurements")
        trace_out = None
        if trace:
            waits = [(r["rank"], r["trace_file"], [s["data_wait_s"] for s in r["profiled_steps"]]) for r in result["ranks"]
                     if r.get("trace_file")]
            trace_out = str(merge_traces(waits, trace))
        # predict for exactly the layout the workers ran
        layout = Layout.from_dict(result["summary"]["layout"])
        predicted = predict_layout(layout, args, cfg.seq_len, cfg.device)
        return build_report(cfg, args, layout, device_type, result, mem_budget_gib, predicted, trace_out)
    finally:
        if temp:
            shutil.rmtree(run_dir, ignore_errors=True)
