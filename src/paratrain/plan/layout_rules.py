"""Which layouts the planner may price: structural_problem() says why paratrain's runtime (or the planner's own
rule) refuses a layout; unpriceable() says whether the cost model can price it all the same (the model and the
batch split as asked). A refused but priceable layout becomes a candidate marked runtime_unsupported."""

from __future__ import annotations

import functools
from dataclasses import replace

from paratrain.errors import UserError
from paratrain.models.args import ModelArgs
from paratrain.models.hf_files import is_hf_model
from paratrain.parallel.layout import Layout
from paratrain.plan.priced_job import Job


@functools.lru_cache(maxsize=64)
def _check_tp_plan(args: ModelArgs, tp: int, sp: bool) -> None:
    """The model family must have a TP plan the runtime can apply (models/plans.py). Building even a meta model
    imports torch's compiler stack (seconds), so the answer is cached on disk with the traces."""
    from paratrain.plan.tracing.trace_cache import cached

    problem = cached("tp-plan", {"args": args, "tp": tp, "sp": sp}, lambda: _tp_plan_problem(args, tp, sp),
                     lambda doc: doc)
    if problem:
        raise UserError(problem)


def _tp_plan_problem(args: ModelArgs, tp: int, sp: bool) -> str:
    from paratrain.models.plans import tp_plan_for
    from paratrain.models.presets import build_model

    try:  # the plan is per block: one block shows whether it applies
        tp_plan_for(build_model(replace(args, n_layers=1), "meta", seed=None), tp, sp=sp)
    except UserError as exc:
        return str(exc)
    return ""


def structural_problem(job: Job, lay: Layout, gpus_per_node: int) -> str | None:
    """Why this layout cannot run at all (the runtime's own check_layout, plus what the planner knows of the
    model family and the cluster), or None."""
    from paratrain.parallel.checks import check_layout

    try:
        check_layout(lay, job.args, job.seq_len, job.global_batch, job.device_type)
        if lay.splits_within_layers:
            _check_tp_plan(job.args, lay.tp, lay.sp)
        _check_hf_runtime(job, lay)
    except UserError as exc:
        return str(exc)
    if lay.tp > gpus_per_node:
        return f"tp={lay.tp} would span nodes ({gpus_per_node} GPUs per node)"
    return None


def _check_hf_runtime(job: Job, lay: Layout) -> None:
    """An `hf:` model runs as transformers' own modules (models/hf_model.py), in fewer layouts than paratrain's
    models: the runtime's own refusals (pp with tp or cp; for MoE: experts whose layout --ep / --tp cannot split,
    read from the model as train reads it; ep with tp, pp or cp, SP, tp not dividing the experts)."""
    spec = job.hf_config or (job.model_name if is_hf_model(job.model_name) else None)
    if not spec:
        return
    from paratrain.train.hf_run_checks import check_hf_moe_run, check_hf_pipeline_layout

    if job.args.moe:
        split_refusal = _hf_split_refusal(spec) if lay.splits_experts or lay.splits_within_layers else None
        check_hf_moe_run(lay, _hf_model_type(spec), job.args.n_experts, split_refusal)
    check_hf_pipeline_layout(lay)


@functools.lru_cache(maxsize=16)
def _hf_split_refusal(spec: str) -> str | None:
    """Why the runtime cannot split the model's experts (train/hf_run_checks.py model_facts, which builds it on the
    meta device), cached on disk by the config and transformers' version: a plan answered from the cache does not
    import transformers (seconds)."""
    import importlib.metadata

    from paratrain.models.hf_files import read_hf_config
    from paratrain.plan.tracing.trace_cache import cached
    from paratrain.train.hf_run_checks import model_facts

    key = {"config": read_hf_config(spec), "transformers": importlib.metadata.version("transformers")}
    return cached("split-refusal", key, lambda: {"refusal": model_facts(spec)[0]}, lambda doc: doc)["refusal"]


@functools.lru_cache(maxsize=16)
def _hf_model_type(spec: str) -> str:
    from paratrain.models.hf_files import read_hf_config

    return read_hf_config(spec)["model_type"]


def unpriceable(job: Job, lay: Layout, gpus_per_node: int) -> str | None:
    """Why the cost model cannot price this layout at all, or None: the model or the batch does not split as
    asked, the family has no TP plan to trace, or TP would span nodes (the planner's own rule). Any other
    structural problem is a rule of paratrain's runtime: such a layout is priced and marked runtime_unsupported."""
    from paratrain.parallel.cp.cp_technique import check_cp

    args = job.args
    if args.n_layers < lay.pp * lay.virtual_stages:
        return (f"pp={lay.pp} x {lay.virtual_stages} stage(s) per rank = {lay.pp * lay.virtual_stages} stages but "
                f"the model has only {args.n_layers} layers")
    try:
        if lay.splits_within_layers:
            args.check_tp_divides(lay.tp)
            _check_tp_plan(args, lay.tp, lay.sp)
        check_cp(args, lay, job.seq_len)
    except UserError as exc:
        return str(exc)
    if job.global_batch % lay.dp or lay.micro_batch * lay.microbatches * lay.dp != job.global_batch:
        return f"the global batch {job.global_batch} does not split into {lay.dp} data-parallel ranks x " \
               f"{lay.microbatches} micro-batches of {lay.micro_batch}"
    if lay.tp > gpus_per_node:
        return f"tp={lay.tp} would span nodes ({gpus_per_node} GPUs per node)"
    return None


def admitted(job: Job, lay: Layout, gpus_per_node: int, unsupported_ok: bool) -> tuple[bool, str | None]:
    """(may this layout be priced, the runtime rule it breaks). Without unsupported_ok only runnable layouts."""
    problem = structural_problem(job, lay, gpus_per_node)
    if problem is None:
        return True, None
    if unsupported_ok and unpriceable(job, lay, gpus_per_node) is None:
        return True, problem
    return False, problem
