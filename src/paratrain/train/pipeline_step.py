"""The Trainer's step runner for pp > 1: carve the model into stages, parallelize each, and run one optimizer
step's micro-batches through a torch.distributed.pipelining schedule, timing each rank's busy and idle time."""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from paratrain.parallel.collective_hooks import collective
from paratrain.parallel.layout import Layout
from paratrain.parallel.loss_weighting import LossWeighting
from paratrain.parallel.options import PP_SCHEDULES
from paratrain.parallel.parallelize import parallelize
from paratrain.parallel.pp.pipeline_split import carve_stage, split_into_stages, stage_ranks
from paratrain.parallel.tied_weights import TiedGradSum, end_stage_groups, mark_copy, tied_table_name
from paratrain.train.data.indexed_sets import Batch
from paratrain.train.optim import build_run_optimizer
from paratrain.train.step import autocast_context, lm_loss
from paratrain.train.step_runner import run_after_optimizer_step

log = logging.getLogger("paratrain")

# torch's class for each schedule name of parallel/options.py (the names are declared there, once)
SCHEDULES = dict(zip(PP_SCHEDULES, (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
                                    ScheduleInterleavedZeroBubble), strict=True))


class BusyClock:
    """Wall time this rank spends computing inside a schedule step (forward, backward, loss, grad reduce).

    Everything else in the step is waiting on a neighbour stage (the bubble) or p2p transfer.
    """

    def __init__(self):
        self.busy_s = 0.0

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - t0

        return timed

    def instrument(self, stage: PipelineStage) -> None:
        # instance attributes shadow the class methods the schedule calls
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "perform_reduce_grad"):
            setattr(stage, name, self.wrap(getattr(stage, name)))


def _autocast_forward(module: nn.Module, device_type: str, dtype: str) -> None:
    """Run this module's forward under autocast without wrapping it (a wrapper would rename its FQNs and
    hide FSDP/DDP from the schedule, which special-cases them)."""
    forward = module.forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with autocast_context(device_type, dtype):
            return forward(*args, **kwargs)

    module.forward = run


def _mesh_named(layout: Layout, names: tuple[str, ...], mesh_layout=None):
    """The mesh a DTensor crossing a stage boundary lives on (sequence-parallel activations: "tp")."""
    return layout.mesh[names if len(names) > 1 else names[0]]


def _forward_without_sync(ddp_stage: nn.Module) -> None:
    """DDP stages: every forward runs under no_sync, as the schedule already runs its micro-batches' (it prepares
    DDP's reducer itself in the last backward). The one it would otherwise not cover is its one-off
    shape-inference forward, whose parameters DDP's reducer would record and then fail its bucket rebuild on the
    next real forward."""
    entered = []

    def enter(module, args):
        entered.append(module.no_sync())
        entered[-1].__enter__()

    def leave(module, args, output):
        entered.pop().__exit__(None, None, None)

    ddp_stage.register_forward_pre_hook(enter)
    ddp_stage.register_forward_hook(leave, always_call=True)


class PipelineStep:
    """The Trainer's step runner for pp > 1: forward + backward of one optimizer step through the schedule.
    A StepRunner (train/step_runner.py)."""

    def __init__(self, schedule, stages: list[PipelineStage], parts: list[nn.Module], layout: Layout,
                 device: torch.device, last_pp_rank: int, tied_grad_sum=None,
                 loss_weighting: LossWeighting | None = None):
        self.schedule, self.stages, self.model_parts = schedule, stages, parts
        self.tied_grad_sum = tied_grad_sum  # a tied embedding: the end stages' copies summed after backward
        self.layout, self.device, self.microbatches = layout, device, layout.microbatches
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.pp_mesh = layout.submesh("pp")
        self.last_pp_rank = last_pp_rank
        self.clock = BusyClock()
        for stage in stages:
            self.clock.instrument(stage)
        self._losses: list[torch.Tensor] = []
        self.last_timing: dict | None = None
        self._global_tokens: int | None = None  # document data: the global batch's count of real targets (per step)
        self.loss_weighting = loss_weighting or LossWeighting.on_this_rank(layout)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss for the schedule, which divides the grads by the micro-batch count itself
        (scale_grads=True): its mean loss, or for document data its term of the mean over the global batch's
        real targets times the micro-batch count (parallel/loss_weighting.py)."""
        t0 = time.perf_counter()
        weighting = self.loss_weighting
        if self._global_tokens is None:
            loss = weighting.dense_loss(lm_loss(logits, targets))
            self._losses.append(loss.detach())
        else:
            summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
            term = summed * weighting.summed_token_factor(self._global_tokens)
            self._losses.append(term.detach())
            loss = weighting.for_backward(term)
        self.clock.busy_s += time.perf_counter() - t0
        return loss

    def _schedule_inputs(self, micro_batches: list[Batch]) -> tuple[tuple, torch.Tensor | None, dict]:
        """(args, target, kwargs) of a schedule call on this rank: the tokens on the first stage, the targets on
        the last, and for packed rows every stage's per-document positions and document ids (its layers'
        attention masks need them; the schedule cuts them into micro-batches like the tokens and hands each
        stage its micro-batch's, while only activations travel between stages)."""
        inputs = torch.cat([mb.inputs for mb in micro_batches])
        targets = torch.cat([mb.targets for mb in micro_batches])
        self._global_tokens = micro_batches[0].global_tokens
        kwargs = {}
        if micro_batches[0].doc_ids is not None:
            kwargs = {"positions": torch.cat([mb.positions for mb in micro_batches]),
                      "doc_ids": torch.cat([mb.doc_ids for mb in micro_batches])}
        return (inputs,) if self.has_first else (), targets if self.has_last else None, kwargs

    def _local_loss(self) -> torch.Tensor:
        # the first step also runs loss_fn once on dummy data to infer backward shapes: keep the last M
        if not self.has_last:
            return torch.zeros((), device=self.device)
        losses = torch.stack(self._losses[-self.microbatches:]).float()
        return self.loss_weighting.rank_share(losses, dense=self._global_tokens is None)

    def evaluate_loss(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Forward only (validation): this rank's loss as forward_backward computes it."""
        args, target, kwargs = self._schedule_inputs(micro_batches)
        self._losses = []
        self.schedule.eval(*args, target=target, **kwargs)
        return self._local_loss()

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Mean loss over this rank's batch on a rank holding the last stage (zero elsewhere)."""
        args, target, kwargs = self._schedule_inputs(micro_batches)
        self._losses = []
        self.clock.busy_s = 0.0
        t0 = time.perf_counter()
        self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
        total = time.perf_counter() - t0
        busy = min(self.clock.busy_s, total)
        self.last_timing = {"busy_s": busy, "total_s": total, "idle_s": total - busy,
                            "idle_fraction": (total - busy) / total if total > 0 else 0.0,
                            "microbatches": self.microbatches}
        if self.tied_grad_sum is not None:
            self.tied_grad_sum()
        return self._local_loss()

    def reduce_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The global mean loss, identical on every rank: broadcast from the last stage, average over dp. A
        tensor on the device: the trainer reads it when the record needs it (train/step_record.py)."""
        value = local.detach().float().clone()
        if self.pp_mesh is not None:
            group = self.pp_mesh.get_group()
            src = dist.get_global_rank(group, self.last_pp_rank)
            collective("loss", "pp", "broadcast", group, lambda: dist.broadcast(value, src=src, group=group),
                       (value,), src=self.last_pp_rank)
        dp_cp = self.layout.submesh("dp_cp")
        if dp_cp is not None:
            group = dp_cp.get_group()
            collective("loss", "dp_cp", "all_reduce", group, lambda: dist.all_reduce(value, group=group), (value,))
            value = self.loss_weighting.global_mean(value)
        return value

    def build_optimizers(self, cfg) -> list:
        """One optimizer per model part, so checkpoints pair each part with its own optimizer state."""
        return [build_run_optimizer([p for p in part.parameters() if p.requires_grad or not cfg.lora_r], cfg,
                                    self.device.type) for part in self.model_parts]

    def after_optimizer_step(self) -> None:
        run_after_optimizer_step(self.model_parts)

    def timing_report(self) -> dict | None:
        """Every rank's busy/idle time in the last step (a collective over the world: call on all ranks).

        A rank whose schedule ends early idles until the slowest rank is done (in training, inside the next
        collective), so the pipeline-wide idle fraction of rank r is 1 - busy_r / slowest rank's step time.
        """
        if self.last_timing is None:
            return None
        mine = {"rank": dist.get_rank(), "pp_rank": self.pp_mesh.get_local_rank(), **self.last_timing}
        everyone: list = [None] * dist.get_world_size()
        collective("pipeline_timing", "world", "all_gather_object", None,
                   lambda: dist.all_gather_object(everyone, mine))
        everyone = [r for r in everyone if r is not None] or [mine]  # an interceptor's None: no row arrived
        step_s = max(r["total_s"] for r in everyone)
        for r in everyone:
            r["own_idle_fraction"] = r.pop("idle_fraction")
            r["idle_fraction"] = 1 - r["busy_s"] / step_s if step_s > 0 else 0.0
        idle = [r["idle_fraction"] for r in everyone]
        return {"schedule": type(self.schedule).__name__, "microbatches": self.microbatches, "pp": self.layout.pp,
                "virtual_stages": self.layout.virtual_stages, "step_s": step_s,
                "ideal_bubble_fraction": self.layout.ideal_bubble,
                "idle_fraction_mean": sum(idle) / len(idle), "per_rank": everyone}

    def verify_extras(self) -> dict:
        report = self.timing_report()
        return {"pipeline": report} if report else {}


def build_pipeline_step(model: nn.Module, layout: Layout, device: torch.device, seq_len: int,
                        tp_plan_for=None, hooks=None, loss_weighting: LossWeighting | None = None) -> PipelineStep:
    """Split `model` into stages, keep this rank's, parallelize each (TP/FSDP/DDP), and build the schedule.

    tp_plan_for(stage_module) gives each stage's TP plan when tp > 1 (the model family's, from the caller).
    fp16 (loss scaling) never reaches here: check_layout rejects it for pipelines. --pp-layers fixes the
    blocks per stage. A tied embedding: the first and last stages each hold a copy, their gradients summed after
    each schedule step (parallel/tied_weights.py). `hooks` (train/hooks.py): after_parallelize sees each stage's
    module, on_pipeline_stage each PipelineStage before the busy clock wraps it (so what a hook adds to a chunk
    counts as busy). `loss_weighting`: the trainer's (parallel/loss_weighting.py); default: this rank's.
    """
    specs = split_into_stages(model, layout.pp, layout.virtual_stages, seq_len, layout.pp_layers)
    ranks = stage_ranks(layout.pp, len(specs))
    pp_mesh = layout.submesh("pp")
    pp_rank = pp_mesh.get_local_rank()
    table = tied_table_name(model)  # a tied embedding: copies on the first and last stage (parallel/tied_weights.py)
    stages, parts, tied_copy = [], [], None
    for spec in specs:
        if ranks[spec.index] != pp_rank:
            continue
        carved = carve_stage(model, spec)
        part = parallelize(carved, layout, tp_plan_for(carved) if layout.splits_within_layers else None)
        if table is not None and spec.first:
            tied_copy = carved.get_parameter(f"tok_embeddings.{table}")  # after parallelize: the sharded one
        elif table is not None and spec.last:
            tied_copy = carved.output.weight
            mark_copy(tied_copy)
        if hooks is not None:
            hooks.fire("after_parallelize", part, layout)
        if layout.dtype != "fp32":
            _autocast_forward(part, device.type, layout.dtype)
        parts.append(part)
        if hasattr(part, "no_sync"):
            _forward_without_sync(part)
        stage = PipelineStage(part, spec.index, len(specs), device, group=pp_mesh.get_group(),
                              get_mesh=functools.partial(_mesh_named, layout))
        if hooks is not None:
            hooks.fire("on_pipeline_stage", stage, spec)
        stages.append(stage)
    tied_sum = None
    if table is not None:
        tied_sum = TiedGradSum(tied_copy, end_stage_groups(layout.mesh, "pp", device.type))
    step = PipelineStep(None, stages, parts, layout, device, ranks[-1], tied_sum, loss_weighting)
    cls = SCHEDULES[layout.pp_schedule]
    stage_arg = stages if cls in (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble) else stages[0]
    step.schedule = cls(stage_arg, layout.microbatches, loss_fn=step.loss_fn, scale_grads=True)
    if pp_rank == 0:
        split = "; ".join(f"stage {s.index}: layers {s.layers[0]}-{s.layers[-1]}"
                          + (" +embed" if s.first else "") + (" +head" if s.last else "") for s in specs)
        log.info("pipeline %s, pp=%d x %d stage(s)/rank, %d micro-batches; %s", layout.pp_schedule, layout.pp,
                 layout.virtual_stages, layout.microbatches, split)
    return step
