"""Counterfactual probes: time the step with one cause removed, so a cause's cost is a measured difference.

Exposed time understates a cause that competes with compute for the same cores or memory bandwidth (gloo's
threads, a loader's decoding): its cost is what the step saves without it. After the measured and profiled
steps, every rank runs the same probe steps on one pre-staged batch, interleaved round by round so drift in
the machine's load hits every variant alike (the fastest round of each counts; within a round each variant
runs twice in a row and the second is timed):
    staged        the full step on data already on the device
    no_grad_sync  the gradient all-reduce skipped (DDP's no_sync); only where the layout is plain DDP
    no_optimizer  clipping and the optimizer step skipped
    alone         each rank in turn runs the step with no collective at all (the DDP-wrapped module itself,
                  the loss not reduced) while its peers wait in a barrier: the step as on one rank. Only for
                  plain DDP. full - alone is what running distributed costs this rank: the gradient sync
                  (full - no_grad_sync) plus the slowdown its peer ranks cause by computing at the same time
                  on shared cores or memory bandwidth (no_grad_sync - alone)
staged and no_optimizer drop the gradients first, as Trainer.train_step does. no_grad_sync and alone zero them in
place instead, before their timer starts (the step they stand for drops its gradients, it does not memset them;
timing the memset of 8.6M gradients on 2 CPU ranks added 1.2 ms to the alone step, against a 33 ms cost). So they
remove the collective and nothing else: the full DDP step leaves its gradients in DDP's persistent buckets,
while a no_sync or alone step after gradients set to None keeps freshly allocated ones (tens of MiB for a large
model), and whether glibc serves those from its heap or from fresh pages (a page fault each)
depends on what ran just before. On 2 CPU ranks (8.6M parameters, load ~5) the alone step so page-faulted 16k
times against 8k for a one-rank run's step and ran 54 ms slower; with the gradients kept in place, 8k and -4 ms.
Probe steps change the parameters; doctor keeps no checkpoint, so nothing of them outlives the run.
"""

from __future__ import annotations

import contextlib
import resource
import time

import torch
import torch.distributed as dist


def grad_sync_removable(trainer) -> bool:
    """True where a probe can skip the gradient sync: every model part is DDP-wrapped (has no_sync)."""
    parts = trainer.step_runner.model_parts
    return trainer.distributed and bool(parts) and all(hasattr(p, "no_sync") for p in parts) and \
        not trainer.layout.splits_stages


def _no_grad_sync(trainer):
    stack = contextlib.ExitStack()
    for part in trainer.step_runner.model_parts:
        stack.enter_context(part.no_sync())
    return stack


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _zero_grads(trainer, in_place: bool) -> None:
    """Drop the gradients (as training does) or zero them where they are (see the module's docstring)."""
    for opt in trainer.optimizers:
        opt.zero_grad(set_to_none=not in_place)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def probe_step(trainer, micro_batches, sync: bool = True, optimizer: bool = True, reduce_loss: bool = True,
               keep_grads: bool = False) -> dict:
    """Seconds of one step on pre-staged micro-batches, with the gradient sync, the optimizer and/or the loss
    all-reduce removed: {"step_s", "forward_backward_s", "optimizer_s", "minor_faults"} (page faults taken).
    `keep_grads`: zero the gradients in place rather than set them to None."""
    device = trainer.rt.device
    if keep_grads:
        # outside the timing: the step this probe stands for drops its gradients (free), it does not memset them
        _zero_grads(trainer, True)
    faults = _minor_faults()
    t0 = _now(device)
    if not keep_grads:
        _zero_grads(trainer, False)
    with (contextlib.nullcontext() if sync else _no_grad_sync(trainer)):
        local = trainer.step_runner.forward_backward(micro_batches)
    t1 = _now(device)
    if optimizer:
        trainer.optimizer_step()
    t2 = _now(device)
    if reduce_loss:
        trainer.global_loss(local)
    else:
        float(local.item())
    t3 = _now(device)
    return {"step_s": t3 - t0, "forward_backward_s": t1 - t0, "optimizer_s": t2 - t1,
            "minor_faults": _minor_faults() - faults}


def alone_step(trainer, micro_batches) -> dict:
    """probe_step on the module inside DDP: no gradient sync, no buffer broadcast, the loss not reduced
    (clipping and the optimizer are local under plain DDP). The peers must not run a collective meanwhile."""
    runner = trainer.step_runner
    ddp = runner.model
    runner.model = ddp.module
    try:
        return probe_step(trainer, micro_batches, reduce_loss=False, keep_grads=True)
    finally:
        runner.model = ddp


def alone_in_turn(trainer, micro_batches) -> dict:
    """Every rank runs alone_step in turn, rank by rank, the others waiting in a barrier; this rank's times."""
    mine = None
    for rank in range(dist.get_world_size()):
        if rank == dist.get_rank():
            mine = alone_step(trainer, micro_batches)
        dist.barrier()
    return mine


def alone_removable(trainer) -> bool:
    """True where the step can run on one rank alone: plain DDP over a single model (PlainStep)."""
    from paratrain.parallel.ep.expert_parallel import forward_runs_collectives

    return grad_sync_removable(trainer) and len(trainer.step_runner.model_parts) == 1 and \
        hasattr(trainer.step_runner.model, "module") and dist.is_initialized() and \
        not forward_runs_collectives(trainer.step_runner.model)


def run_probes(trainer, micro_batches, rounds: int) -> dict | None:
    """Fastest seconds per variant and part over `rounds` interleaved rounds (after one untimed step);
    None if rounds < 1."""
    if rounds < 1 or not micro_batches:
        return None
    variants = {"staged": {}, "no_optimizer": {"optimizer": False}}
    if grad_sync_removable(trainer):
        variants["no_grad_sync"] = {"sync": False, "keep_grads": True}
    alone = alone_removable(trainer)
    # probe steps bypass train_step, so no on_phase hook (doctor's phase timer) sees them
    times: dict[str, list[dict]] = {name: [] for name in variants}
    if alone:
        times["alone"] = []
    for _ in range(rounds):
        # each variant twice in a row, the second timed: a timed step follows a step of its own kind, so
        # the allocator holds what that variant frees and reuses (see the module's docstring), and the
        # alone step's first run outside DDP is never timed
        for name, kwargs in variants.items():
            probe_step(trainer, micro_batches, **kwargs)
            times[name].append(probe_step(trainer, micro_batches, **kwargs))
        if alone:
            alone_in_turn(trainer, micro_batches)
            times["alone"].append(alone_in_turn(trainer, micro_batches))
    out: dict = {"rounds": rounds}
    for name, rows in times.items():
        for part in rows[0]:
            key = name + ("_s" if part == "step_s" else "_" + part)
            # the fastest round: the estimator least disturbed by other load on the machine
            out[key] = min(r[part] for r in rows)
    return out


def counterfactual_costs(probes: dict | None, measured_step_s: float) -> dict:
    """Seconds per step each removable cause costs: the full step minus the step without it (>= 0).

    data_loading compares the real loop (loader included; `measured_step_s`, its fastest measured step, as the
    probes count their fastest round) with the staged step; the others compare probe variants measured side by
    side, on the part of the step the removal changes: skipping the gradient sync changes forward+backward, so
    the optimizer's run-to-run noise stays out of its difference, and skipping the optimizer changes the
    optimizer phase, so forward+backward's stays out of its (whole steps differed by the noise of a second of
    forward+backward on a loaded machine: a 40 ms optimizer came out as 0.0 ms). A cause no probe can remove
    is absent."""
    if not probes:
        return {}
    staged = probes["staged_s"]
    optimizer = probes["staged_optimizer_s"] - probes.get("no_optimizer_optimizer_s", 0.0)
    costs = {"data_loading": max(0.0, measured_step_s - staged), "optimizer": max(0.0, optimizer)}
    split = communication_split(probes)
    if split is not None:
        # ranked by what running distributed costs where the alone probe ran, else by the sync alone
        costs["communication"] = split["distributed_s"] if split["distributed_s"] is not None else split["sync_s"]
    return costs


def communication_split(probes: dict | None) -> dict | None:
    """{"sync_s", "contention_s", "distributed_s"}: the gradient sync (full - no_grad_sync, on forward+backward),
    the peer ranks' contention (the rest of full - alone) and their sum, full - alone (whole steps: contention
    slows the optimizer too). The last two are None without the alone probe; None without the no_sync probe."""
    if not probes or probes.get("no_grad_sync_forward_backward_s") is None:
        return None
    sync = max(0.0, probes["staged_forward_backward_s"] - probes["no_grad_sync_forward_backward_s"])
    if probes.get("alone_s") is None:
        return {"sync_s": sync, "contention_s": None, "distributed_s": None}
    distributed = max(0.0, probes["staged_s"] - probes["alone_s"])
    return {"sync_s": sync, "contention_s": max(0.0, distributed - sync), "distributed_s": distributed}
