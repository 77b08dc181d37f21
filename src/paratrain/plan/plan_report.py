"""The plan report: explain each candidate in plain language and build the `plan --json` document."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from paratrain.costs.hardware import HardwareProfile
from paratrain.errors import UserError
from paratrain.parallel.dims import dims_in_mesh_order, techniques
from paratrain.parallel.layout import Layout
from paratrain.parallel.strategies import train_args
from paratrain.plan.costing.memory import GIB
from paratrain.plan.error_bars import error_bar
from paratrain.plan.gc_pause import gc_paused
from paratrain.plan.search import (
    Candidate,
    Job,
    model_states_floor,
    search_all,
    smallest_gpu_count,
    with_time,
)

log = logging.getLogger("paratrain")


def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB" if x >= 0.1 * GIB else f"{x / 2**20:.1f} MiB"


@dataclass
class ReasonContext:
    """What a technique's reasons read of a planned layout (parallel/technique.py `reasons`)."""

    layout: Layout
    gpu: object  # gpu_catalog.py GPUSpec
    seq_len: int
    usable: float  # bytes per GPU
    states: Callable[[Layout], float]  # a rank's model-state bytes under a layout
    gib: Callable[[float], str]
    time: object = None  # plan/costing/time.py TimeEstimate, once priced
    # schemes priced that paratrain's runtime does not run (plan --dist-optimizer, --async-tp)
    dist_optimizer: bool = False
    async_tp: bool = False


def explain(job: Job, hw: HardwareProfile, cand: Candidate) -> list[str]:
    """Plain-language reasons: what fits and why, what each technique costs or buys here (each technique's
    layout reasons in the dims' order, then the AC, then their reasons on the priced step, outermost first)."""
    lay, mem, gpu = cand.layout, cand.memory, hw.gpu
    usable = gpu.mem_gib * GIB * (1 - job.mem_reserve)
    out = []
    if cand.feasible:
        out.append(f"fits: {_gib(mem.total)} of {gpu.mem_gib:g} GiB per GPU (peak during the {mem.phase})")
    else:
        out.append(f"does not fit: {_gib(mem.total)} > {_gib(usable)} usable of {gpu.mem_gib:g} GiB per GPU "
                   f"(peak during the {mem.phase})")
    r = ReasonContext(lay, gpu, job.seq_len, usable, lambda layout: model_states_floor(job, layout), _gib,
                      cand.time, job.dist_optimizer, job.async_tp)
    for technique in techniques():
        out += technique.reasons(r)
    if job.half_weights and job.dtype != "fp32":
        out.append(f"priced with {job.dtype} weights (--half-weights: fp32 masters in the optimizer, gradients "
                   "accumulated by the weight-gradient GEMMs, as Megatron runs); paratrain's runtime casts its fp32 "
                   "weights in every micro-batch's forward and adds each gradient into fp32")
    if lay.ac != "none":
        extra = "re-runs each block's forward in the backward" if lay.ac == "full" else \
            "recomputes norms and elementwise ops, keeps matmul outputs"
        out.append(f"activation checkpointing '{lay.ac}' {extra}; without it this layout needs more memory")
    if cand.time is not None:
        t = cand.time
        for technique in {id(d.technique): d.technique for d in dims_in_mesh_order()}.values():
            out += technique.step_reasons(r)
        out.append(f"step {t.step_s:.3g} s: compute {t.compute_s / t.step_s:.0%}, exposed communication "
                   f"{t.comm_exposed_s / t.step_s:.0%}" + (f", bubble {t.bubble_s / t.step_s:.0%}" if t.bubble_s else ""))
        if lay.microbatches > 1 and not lay.splits_stages:
            out.append(f"micro-batch {lay.micro_batch} x {lay.microbatches} gradient-accumulation steps per GPU")
    return out


def candidate_doc(job: Job, hw: HardwareProfile, cand: Candidate, mixed=None, cluster=None) -> dict:
    lay, t = cand.layout, cand.time
    doc = {
        "strategy": lay.strategy, "dims": lay.degrees(),
        "pp_schedule": lay.pp_schedule if lay.splits_stages else None, "virtual_stages": lay.virtual_stages,
        "microbatches": lay.microbatches, "micro_batch": lay.micro_batch, "activation_checkpointing": lay.ac,
        "zero_stage": lay.zero_stage, "sp": lay.sp and lay.splits_within_layers,
        "cp_impl": lay.cp_impl if lay.splits_sequences else None,
        "memory_gib": cand.memory.gib() if cand.memory else None,
        "memory_bytes": cand.memory.parts() if cand.memory else None,
        "memory_peak_phase": cand.memory.phase if cand.memory else None,
        "step_time_s": t.step_s if t else None,
        "tokens_per_s_per_device": cand.tokens_per_s_per_device if t else None,
        "mfu": cand.mfu if t else None,
        "comm_bytes_per_step": t.comm_bytes if t else None,
        "comm_wire_bytes_per_step": t.comm_wire_bytes if t else None,
        "bubble_fraction": (t.bubble_s / t.step_s if t.step_s else 0.0) if t else None,
        "time_breakdown_s": {"compute": t.compute_s, "communication_exposed": t.comm_exposed_s,
                             "bubble": t.bubble_s, **{k: v for k, v in t.breakdown.items()
                                                      if isinstance(v, float)}} if t else None,
        "feasible": cand.feasible, "reasons": explain(job, hw, cand) + cand.reasons,
        "notes": cand.memory.notes if cand.memory else [],
        "command": "paratrain train " + " ".join([*job.model_flags(),
                                                  *train_args(lay, job.seq_len, job.global_batch),
                                                  *job.optimizer_flags()]),
        "dp_batch_split": None, "pp_layers": None,
        "runtime_unsupported": cand.runtime_unsupported,
        "error_bar": error_bar(lay),
    }
    if mixed is not None:
        step = mixed.chosen.step_s
        run = mixed.chosen.layout
        tokens = job.global_batch * job.seq_len
        peak = sum(cluster.profiles[d.gpu].gpu.peak_tflops.get(job.dtype, 0.0) for d in cluster.devices)
        doc.update(step_time_s=step, step_time_even_s=mixed.even.step_s,
                   step_time_uneven_s=mixed.uneven.step_s if mixed.uneven else None,
                   tokens_per_s_per_device=tokens / step / lay.world,
                   mfu=job.flops_per_token * tokens / step / (peak * 1e12) if peak else None,
                   dp_batch_split=mixed.chosen.dp_batch_split, pp_layers=mixed.chosen.pp_layers,
                   per_device=mixed.chosen.per_device, per_device_even=mixed.even.per_device,
                   bottleneck=mixed.bottleneck(), split_reasons=mixed.reasons,
                   reasons=doc["reasons"] + mixed.reasons, micro_batch=run.micro_batch, microbatches=run.microbatches,
                   command="paratrain train " + " ".join([*job.model_flags(),
                                                          *train_args(run, job.seq_len, job.global_batch),
                                                          *job.optimizer_flags()]))
    return doc


def rank_on_cluster(job: Job, cluster, feasible: list[Candidate], top: int) -> tuple[list[Candidate], dict]:
    """The search's best few, priced per device on the mixed cluster (uneven.py) and re-ranked by it."""
    from paratrain.plan.costing.uneven_cost import analyze

    pool = feasible[:top + 5]
    mixed = {id(c): analyze(job, cluster, c) for c in pool}
    return sorted(pool, key=lambda c: mixed[id(c)].chosen.step_s) + feasible[len(pool):], mixed


def plan_document(job: Job, hw: HardwareProfile, fixed: dict, top: int = 10, exhaustive: bool = False,
                  cluster=None) -> dict:
    with gc_paused():
        return _plan_document(job, hw, fixed, top, exhaustive, cluster)


def _plan_document(job: Job, hw: HardwareProfile, fixed: dict, top: int, exhaustive: bool, cluster) -> dict:
    from paratrain.models.presets import expert_params

    found = search_all(job, hw, fixed, exhaustive)
    # only a layout the runtime runs is ever recommended: refused ones come after, and only when none runs
    feasible = [c for c in found.feasible if c.runtime_unsupported is None]
    infeasible, examined = found.infeasible, found.examined
    mixed = {}
    if cluster is not None:
        feasible, mixed = rank_on_cluster(job, cluster, feasible, top)
    doc_candidates = [candidate_doc(job, hw, c, mixed.get(id(c)), cluster) for c in feasible[:top]]
    unsupported = [] if feasible else [c for c in found.feasible + found.unsupported if c.runtime_unsupported][:top]
    doc_candidates += [candidate_doc(job, hw, c) for c in unsupported]
    listed = infeasible[:max(0, top - len(doc_candidates)) or 3]
    for cand in listed:  # layouts that do not fit still say how fast they would run
        try:
            with_time(job, hw, cand)
        except (UserError, ValueError) as exc:
            cand.reasons.append(f"no step time: {exc}")
    doc_candidates += [candidate_doc(job, hw, c) for c in listed]
    gpu = hw.gpu
    nodes = math.ceil(job.gpus / gpu.gpus_per_node)
    doc = {
        "model": {"name": job.model_name, **model_counts(job),
                  "family": job.args.family, "layers": job.args.n_layers, "dim": job.args.dim,
                  "heads": job.args.n_heads, "kv_heads": job.args.kv_heads, "ffn_dim": job.args.ffn_dim,
                  "vocab_size": job.args.vocab_size, "flops_per_token": job.flops_per_token,
                  "flops_convention": "6*N + 12*layers*dim*seq_len per token; N excludes the input embedding"
                                      + ("; of an MoE layer N counts the top-k experts only" if job.args.moe else ""),
                  **(moe_fields(job.args, expert_params(job.args)) if job.args.moe else {}),
                  **({"lora": lora_fields(job.lora)} if job.lora else {})},
        "cluster": {"gpu": gpu.name, "gpus": job.gpus, "nodes": nodes, "gpus_per_node": gpu.gpus_per_node,
                    "mem_gib": gpu.mem_gib, "peak_tflops": gpu.peak_tflops.get(job.dtype),
                    "intra_node_gbs": gpu.intra_node_gbs, "inter_node_gbs": gpu.inter_node_gbs,
                    "mem_bw_gbs": gpu.mem_bw_gbs, "usable_mem_fraction": 1 - job.mem_reserve,
                    "source": gpu.source, "assumptions": gpu.assumptions, "profile": hw.source,
                    "calibrated": hw.calibrated, "profile_notes": hw.notes},
        "job": {"seq_len": job.seq_len, "global_batch": job.global_batch, "dtype": job.dtype,
                "compile": job.compile, "dist_optimizer": job.dist_optimizer, "async_tp": job.async_tp,
                "moe_routing": job.moe_routing, "half_weights": job.half_weights, "fixed": {k: v for k, v in fixed.items() if v is not None}},
        "recommended": 0 if feasible else None,
        "fits": bool(feasible),
        "layouts_examined": examined,
        "candidates": doc_candidates,
    }
    if cluster is not None:
        doc["cluster"].update(gpu=cluster.spec(), description=cluster.describe(), nodes=cluster.nodes, mixed=cluster.mixed,
                              source=cluster.source, gpu_types=sorted(cluster.profiles),
                              devices=[{"rank": d.rank, "node": d.node, "gpu": d.gpu, "speed": d.speed,
                                        "mem_gib": cluster.mem_gib(d)} for d in cluster.devices],
                              search_profile=f"{hw.gpu.name} at the slowest device's speed, {hw.gpu.mem_gib:g} GiB "
                                             "(the smallest memory in the cluster)")
    if not feasible:
        doc.update(why_no_fit(job, hw, fixed, found, unsupported, listed))
    return doc


def why_no_fit(job: Job, hw: HardwareProfile, fixed: dict, found, unsupported: list[Candidate],
               listed: list[Candidate]) -> dict:
    """The message when no layout the runtime runs fits: a runtime rule (the layouts it refuses are priced
    above), memory (the closest layout's memory by part, and the smallest GPU count that fits), or the
    model's shape (nothing could be priced: why)."""
    where = f"{job.gpus} x {hw.gpu.name}"
    if unsupported:
        rule = unsupported[0].runtime_unsupported
        return {"no_fit_reason": "runtime_unsupported", "runtime_unsupported": rule,
                "message": f"{job.model_name}: no layout paratrain's runtime can run fits on {where}; the ones that "
                           f"fit are priced below, marked runtime_unsupported: {rule}"}
    if listed:
        closest = listed[0]
        small = smallest_gpu_count(job, hw, fixed)
        more = (f"the smallest GPU count that fits is {small[0]} ({small[1].layout.label()}, "
                f"{_gib(small[1].memory.total)} per GPU)" if small else "no GPU count up to 65536 fits")
        rule = f" (and the runtime refuses it: {closest.runtime_unsupported})" if closest.runtime_unsupported else ""
        return {"no_fit_reason": "memory", "smallest_gpus_that_fit": small[0] if small else None,
                "message": f"{job.model_name} fits nowhere on {where}: memory; the closest, {closest.layout.label()}"
                           f"{rule}, needs {memory_by_part(closest)} of {_gib(usable_bytes(job, hw))} usable; {more}"}
    why = "; ".join(found.refusals) or "no layout of the fixed choices exists"
    return {"no_fit_reason": "shape", "smallest_gpus_that_fit": None,
            "message": f"{job.model_name} has no layout on {where} that can be priced: {why}"}


def usable_bytes(job: Job, hw: HardwareProfile) -> float:
    return hw.gpu.mem_gib * GIB * (1 - job.mem_reserve)


def memory_by_part(cand: Candidate) -> str:
    m = cand.memory
    parts = ", ".join(f"{name} {_gib(v)}" for name, v in (("params", m.params), ("grads", m.grads),
                                                          ("optimizer", m.optimizer),
                                                          ("activations", m.activations), ("other", m.other)) if v)
    return f"{_gib(m.total)} per GPU ({parts})"


def model_counts(job: Job) -> dict:
    """params, active_params and params_non_embedding: of the model transformers builds from a config
    (counted on the meta device), else of the preset's shape; `params_priced`: what the cost model traces."""
    from paratrain.models.presets import count_params

    traced = count_params(job.args)
    if job.counts is None:
        return {"params": traced, "active_params": count_params(job.args, active=True),
                "params_non_embedding": count_params(job.args, include_embedding=False), "params_priced": traced,
                "params_counted_by": "the preset's shape"}
    c = job.counts
    return {"params": c.params, "active_params": c.active, "params_non_embedding": c.non_embedding,
            "params_priced": traced, "params_counted_by": "transformers, built on the meta device"}


def moe_fields(args, experts: int) -> dict:
    """What `plan --json` says of a Mixture-of-Experts model beyond its total and active parameters."""
    return {"experts": args.n_experts, "top_k": args.top_k, "shared_experts": args.n_shared_experts,
            "expert_ffn_dim": args.expert_dim, "moe_layers": args.n_layers - args.n_dense_layers,
            "expert_params": experts, "router": args.router}


def lora_fields(lora) -> dict:
    """What `plan --json` says of the adapters a LoRA run trains (plan/inputs/lora_count.py LoraChoice)."""
    return {**lora.spec.to_dict(), "trainable_params": lora.params, "adapter_tensors": lora.tensors,
            "counted_by": "the adapters attached to the model built on the meta device"}
