"""Counterfactual probes: time the step with one cause removed, so a cause's cost is a measured difference.

Exposed time understates a cause that competes with compute for the same cores or memory bandwidth (gloo's
threads, a loader's decoding): its cost is what the step saves without it. After the measured and profiled
steps, every rank runs the same probe steps on one pre-staged batch, interleaved round by round so drift in
the machine's load hits every variant alike (the fastest round of each counts):
    staged        the full step on data already on the device
    no_grad_sync  the gradient all-reduce skipped (DDP's no_sync); only where the layout is plain DDP
    no_optimizer  clipping and the optimizer step skipped
Probe steps change the parameters; doctor keeps no checkpoint, so nothing of them outlives the run.
"""

from __future__ import annotations

import contextlib
import time

import torch


def grad_sync_removable(trainer) -> bool:
    """True where a probe can skip the gradient sync: every model part is DDP-wrapped (has no_sync)."""
    parts = trainer.step_runner.model_parts
    return trainer.distributed and bool(parts) and all(hasattr(p, "no_sync") for p in parts) and \
        trainer.layout.pp == 1


def _no_grad_sync(trainer):
    stack = contextlib.ExitStack()
    for part in trainer.step_runner.model_parts:
        stack.enter_context(part.no_sync())
    return stack


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def probe_step(trainer, micro_batches, sync: bool = True, optimizer: bool = True) -> dict:
    """Seconds of one step on pre-staged micro-batches, with the gradient sync and/or optimizer removed:
    {"step_s", "forward_backward_s", "optimizer_s"}."""
    device = trainer.rt.device
    t0 = _now(device)
    for opt in trainer.optimizers:
        opt.zero_grad(set_to_none=True)
    with (contextlib.nullcontext() if sync else _no_grad_sync(trainer)):
        local = trainer.step_runner.forward_backward(micro_batches)
    t1 = _now(device)
    if optimizer:
        trainer.optimizer_step()
    t2 = _now(device)
    trainer.global_loss(local)
    t3 = _now(device)
    return {"step_s": t3 - t0, "forward_backward_s": t1 - t0, "optimizer_s": t2 - t1}


def run_probes(trainer, micro_batches, rounds: int) -> dict | None:
    """Fastest seconds per variant and part over `rounds` interleaved rounds (after one untimed step);
    None if rounds < 1."""
    if rounds < 1 or not micro_batches:
        return None
    variants = {"staged": {}, "no_optimizer": {"optimizer": False}}
    if grad_sync_removable(trainer):
        variants["no_grad_sync"] = {"sync": False}
    phase_timer, trainer.phase_timer = trainer.phase_timer, None
    try:
        probe_step(trainer, micro_batches)
        times: dict[str, list[dict]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, kwargs in variants.items():
                times[name].append(probe_step(trainer, micro_batches, **kwargs))
    finally:
        trainer.phase_timer = phase_timer
    out: dict = {"rounds": rounds}
    for name, rows in times.items():
        for part in rows[0]:
            key = name + ("_s" if part == "step_s" else "_" + part)
            # the fastest round: the estimator least disturbed by other load on the machine
            out[key] = min(r[part] for r in rows)
    return out


def counterfactual_costs(probes: dict | None, measured_step_s: float) -> dict:
    """Seconds per step each removable cause costs: the full step minus the step without it (>= 0).

    data_loading compares the real loop (loader included) with the staged step; the others compare probe
    variants measured side by side, on the part of the step the removal changes (skipping the gradient
    sync changes forward+backward, so the optimizer's own run-to-run noise stays out of its difference).
    A cause no probe can remove is absent."""
    if not probes:
        return {}
    staged = probes["staged_s"]
    costs = {"data_loading": max(0.0, measured_step_s - staged),
             "optimizer": max(0.0, staged - probes["no_optimizer_s"])}
    if probes.get("no_grad_sync_forward_backward_s") is not None:
        costs["communication"] = max(0.0, probes["staged_forward_backward_s"] -
                                     probes["no_grad_sync_forward_backward_s"])
    return costs
