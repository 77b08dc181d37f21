"""Counterfactual probes: time the step with one cause removed, so a cause's cost is a measured difference.

Exposed time understates a cause that competes with compute for the same cores or memory bandwidth (gloo's
threads, a loader's decoding): its cost is what the step saves without it. After the measured and profiled
steps, every rank runs the same probe steps on one pre-staged batch, interleaved round by round so drift in
the machine's load hits every variant alike:
    staged        the full step on data already on the device
    no_grad_sync  the gradient all-reduce skipped (DDP's no_sync); only where the layout is plain DDP
    no_optimizer  clipping and the optimizer step skipped
Probe steps change the parameters; doctor keeps no checkpoint, so nothing of them outlives the run.
"""

from __future__ import annotations

import contextlib
import statistics
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


def probe_step(trainer, micro_batches, sync: bool = True, optimizer: bool = True) -> float:
    """Seconds for one step on pre-staged micro-batches, with the gradient sync and/or optimizer removed."""
    device = trainer.rt.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for opt in trainer.optimizers:
        opt.zero_grad(set_to_none=True)
    with (contextlib.nullcontext() if sync else _no_grad_sync(trainer)):
        local = trainer.step_runner.forward_backward(micro_batches)
    if optimizer:
        trainer.optimizer_step()
    trainer.global_loss(local)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def run_probes(trainer, micro_batches, rounds: int) -> dict | None:
    """Median seconds per variant over `rounds` interleaved rounds (after one untimed step); None if rounds < 1."""
    if rounds < 1 or not micro_batches:
        return None
    variants = {"staged": {}, "no_optimizer": {"optimizer": False}}
    if grad_sync_removable(trainer):
        variants["no_grad_sync"] = {"sync": False}
    phase_timer, trainer.phase_timer = trainer.phase_timer, None
    try:
        probe_step(trainer, micro_batches)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, kwargs in variants.items():
                times[name].append(probe_step(trainer, micro_batches, **kwargs))
    finally:
        trainer.phase_timer = phase_timer
    return {f"{name}_s": statistics.median(values) for name, values in times.items()} | {"rounds": rounds}


def counterfactual_costs(probes: dict | None, measured_step_s: float) -> dict:
    """Seconds per step each removable cause costs: the full step minus the step without it (>= 0).

    data_loading compares the real loop (loader included) with the staged step; the others compare probe
    variants measured side by side. A cause no probe can remove is absent."""
    if not probes:
        return {}
    staged = probes["staged_s"]
    costs = {"data_loading": max(0.0, measured_step_s - staged),
             "optimizer": max(0.0, staged - probes["no_optimizer_s"])}
    if probes.get("no_grad_sync_s") is not None:
        costs["communication"] = max(0.0, staged - probes["no_grad_sync_s"])
    return costs
