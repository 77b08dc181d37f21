"""Pipeline parallelism (--pp) as the registry holds it: its check and how a step's parts add up around the
pipeline. Its apply is the split into stages (pipeline_split.py), made by the caller per stage before
parallelize() runs on each stage's model."""

from __future__ import annotations

from paratrain.errors import UserError
from paratrain.parallel.options import (
    DEFAULT_PP_SCHEDULE,
    MULTI_STAGE_SCHEDULES,
    PP_SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
)
from paratrain.parallel.pp import pp_cost
from paratrain.parallel.technique import Technique
from paratrain.parallel.uneven_split import stage_layer_counts


def check_pp(args, layout, seq_len: int | None = None) -> None:
    """pp > 1: enough layers for the stages and a schedule that runs this layout. (A tied embedding is held by
    the first and last stage, its gradients summed between them: parallel/tied_weights.py.)"""
    if args.n_layers < layout.pp * layout.virtual_stages:
        raise UserError(f"pp={layout.pp} x {layout.virtual_stages} stage(s) per rank = "
                        f"{layout.pp * layout.virtual_stages} stages but the model has only {args.n_layers} layers")
    if layout.pp_layers:
        stage_layer_counts(":".join(map(str, layout.pp_layers)), layout.pp * layout.virtual_stages, args.n_layers)
    check_pipeline(layout)


def check_pipeline(layout) -> None:
    schedule, v, pp, m = layout.pp_schedule, layout.virtual_stages, layout.pp, layout.microbatches
    if schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        raise UserError(f"--pp-schedule {schedule} runs one stage per rank; --virtual-stages {v} needs "
                        f"interleaved-1f1b or zero-bubble")
    if schedule == "interleaved-1f1b" and v < 2:
        raise UserError("--pp-schedule interleaved-1f1b needs --virtual-stages 2 or more (stages per rank)")
    if layout.cp > 1:
        raise UserError(f"pipeline parallelism (pp={pp}) does not combine with context parallelism (cp={layout.cp}) "
                        "in this build; use tp or dp with pp")
    if layout.dtype == "fp16":
        # GradScaler's skip-step decision is per rank: stages would disagree on whether to step
        raise UserError("--dtype fp16 with pipeline parallelism is not supported (the loss scaler lives on the last "
                        "stage only); use --dtype bf16")
    if schedule == "zero-bubble" and layout.dp > 1:
        # its weight-gradient pass writes .grad directly, so DDP's and FSDP's gradient hooks never fire
        raise UserError(f"--pp-schedule zero-bubble cannot be combined with data parallelism (dp={layout.dp}): its "
                        "deferred weight gradients bypass DDP/FSDP; use 1f1b or interleaved-1f1b")
    if schedule == "1f1b" and m < pp:
        raise UserError(f"--pp-schedule 1f1b needs at least as many micro-batches as stages: {m} < pp={pp}")
    if schedule in MULTI_STAGE_SCHEDULES:
        rounds = max(1, m // pp)
        if m % rounds:
            raise UserError(f"--pp-schedule {schedule} needs the micro-batch count ({m}) to be a multiple of "
                            f"{rounds} (micro-batches // pp); try {rounds * pp}")


def stages_per_rank(schedule: str) -> int:
    """The pipeline stages per rank the planner tries for a schedule (when --virtual-stages is not fixed)."""
    return 2 if schedule in MULTI_STAGE_SCHEDULES else 1


class PipelineParallel(Technique):
    family, family_rank = "pipeline", 50
    composes_step = True

    def enabled(self, layout) -> bool:
        return layout.pp > 1

    def check(self, args, layout, seq_len: int | None = None) -> None:
        check_pp(args, layout, seq_len)

    search_order = 3
    inference_role = "stages"

    def inference_problem(self, args, degree: int) -> str | None:
        return f"{degree} stages exceed the model's {args.n_layers} layers" if degree > args.n_layers else None

    def inference_comm_s(self, args, degree: int, rows: int, act_bytes: int, link: tuple[float, float]) -> float:
        """The hidden states sent across each of the degree - 1 stage boundaries."""
        bw, hop = link
        return (degree - 1) * (rows * args.dim * act_bytes / bw + hop)

    def search_options(self, degrees: dict[str, int], fixed: dict, dims: tuple) -> list[dict]:
        if degrees["pp"] == 1:
            return [{"pp_schedule": DEFAULT_PP_SCHEDULE, "virtual_stages": 1}]
        if fixed.get("pp_schedule"):
            schedule = fixed["pp_schedule"]
            return [{"pp_schedule": schedule, "virtual_stages": fixed.get("virtual_stages") or stages_per_rank(schedule)}]
        # the default schedule first: the planner's order decides between equally fast layouts
        return [{"pp_schedule": s, "virtual_stages": stages_per_rank(s)}
                for s in sorted(PP_SCHEDULES, key=lambda s: s != DEFAULT_PP_SCHEDULE)]

    def deferred_in_search(self, layout, fixed: dict, nodes: int) -> bool:
        # a pipeline joins when the cluster has several nodes or --pp is given; else only when nothing else fits
        return self.enabled(layout) and not (nodes > 1 or (fixed.get("pp") or 1) > 1)

    def allows_microbatches(self, layout, microbatches: int) -> bool:
        # 1F1B needs at least as many micro-batches as stages
        return not (self.enabled(layout) and layout.pp_schedule == "1f1b") or microbatches >= layout.pp

    def step_reasons(self, r) -> list[str]:
        lay = r.layout
        if not self.enabled(lay):
            return []
        bubble = r.time.bubble_s / r.time.step_s
        return [f"pipeline {lay.pp_schedule}{f' x{lay.virtual_stages} stages/rank' if lay.virtual_stages > 1 else ''}"
                f": {lay.microbatches} micro-batches, bubble {bubble:.0%} of the step"]

    def stages(self, layout, n_layers: int, split) -> list[tuple[int, str, int]]:
        """(rank, part, layers) of every stage: `split()` (the planner's copy of the runtime's split), or the
        whole model on rank 0 without a pipeline."""
        return split() if self.enabled(layout) else [(0, "whole", n_layers)]

    def in_flight(self, layout, rank: int) -> int:
        """Micro-batches (per model part) whose activations stage rank `rank` holds at once (1 without a
        pipeline: each micro-batch's backward runs before the next forward)."""
        if not self.enabled(layout):
            return 1
        return pp_cost.in_flight(layout.pp_schedule, layout.pp, rank, layout.microbatches, layout.virtual_stages)

    def schedule(self, p, ranks: dict, io: float) -> pp_cost.Schedule:
        return pp_cost.schedule(p, ranks, io)

    def compose(self, p, chunks: list, sched: pp_cost.Schedule, opt: float, terms: dict[str, float]) -> None:
        pp_cost.compose(p, chunks, sched, opt, terms)


PIPELINE_PARALLEL = PipelineParallel()
