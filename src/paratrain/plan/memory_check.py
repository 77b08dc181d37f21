"""`train`'s memory check: the planner's predicted peak per device against what the run may use, before any
process starts or any file is written; when it does not fit, the best layout that does (docs/train.md).

The budget is `--mem-budget-gib` when given, else the GPU's memory less the share the planner keeps free. CPU
ranks share the host's memory, which no per-device figure describes, so on CPU the check runs only when a
budget is given. `--no-memory-check` skips it.
"""

from __future__ import annotations

import dataclasses
import logging

from paratrain.errors import UserError

log = logging.getLogger("paratrain")
GIB = 2**30


def memory_budget_gib(cfg, device_type: str, reserve: float) -> tuple[float, str] | None:
    """(GiB one device may use, where that figure comes from), or None when nothing bounds it."""
    if cfg.mem_budget_gib is not None:
        return cfg.mem_budget_gib, "--mem-budget-gib"
    if device_type != "cuda":
        return None
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
    return total * (1 - reserve), f"{total:.1f} GiB of {torch.cuda.get_device_name()} less {reserve:.0%} kept free"


def check_memory(cfg, layout, args, device_type: str) -> float | None:
    """The predicted peak GiB per device (None: not checked); UserError when it exceeds the budget."""
    from paratrain.plan.search import Job

    if not cfg.memory_check or args is None:
        return None
    job = Job(args=args, model_name=cfg.model, gpus=layout.world, seq_len=cfg.seq_len,
              global_batch=cfg.global_batch, dtype=cfg.dtype, device_type=device_type,
              optimizer=cfg.optimizer, momentum=cfg.momentum)
    budget = memory_budget_gib(cfg, device_type, job.mem_reserve)
    if budget is None:
        return None
    limit, source = budget
    from paratrain.plan.costing.memory import estimate_memory
    from paratrain.plan.gc_pause import gc_paused

    with gc_paused():
        estimate = estimate_memory(args, layout, cfg.seq_len, layout.dtype, device_type, job.optimizer_states)
    peak = estimate.total / GIB
    if peak <= limit:
        log.info("memory check: %s predicted at %.3g GiB per device, within %.3g GiB (%s)", layout.label(), peak,
                 limit, source)
        return peak
    raise UserError(f"{layout.label()} is predicted to need {peak:.3g} GiB per device (params "
                    f"{estimate.params / GIB:.2g}, grads {estimate.grads / GIB:.2g}, optimizer "
                    f"{estimate.optimizer / GIB:.2g}, activations {estimate.activations / GIB:.2g}) but "
                    f"{limit:.3g} GiB is available ({source}); {best_fitting(job, limit, device_type, cfg)}; "
                    f"--no-memory-check runs it anyway")


def best_fitting(job, limit_gib: float, device_type: str, cfg) -> str:
    """The planner's first layout of this many devices within `limit_gib`, as the flags that run it."""
    from paratrain.parallel.strategies import train_args
    from paratrain.plan.auto import auto_hardware
    from paratrain.plan.gc_pause import gc_paused
    from paratrain.plan.search import search

    profile, _ = auto_hardware(device_type)
    spec = dataclasses.replace(profile.gpu, mem_gib=limit_gib / (1 - job.mem_reserve),
                               gpus_per_node=max(profile.gpu.gpus_per_node, job.gpus))
    profile = dataclasses.replace(profile, gpu=spec)
    with gc_paused():
        feasible, infeasible, _ = search(job, profile, {})
    if not feasible:
        closest = f"; the closest needs {infeasible[0].memory.total / GIB:.3g} GiB" if infeasible else ""
        return f"no layout of {job.gpus} device(s) fits{closest}: use more devices or a smaller micro-batch"
    best = feasible[0]
    flags = " ".join(train_args(best.layout, cfg.seq_len, cfg.global_batch))
    return f"the best layout that fits is {best.layout.label()} at {best.memory.total / GIB:.3g} GiB: {flags}"
