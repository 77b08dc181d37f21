"""search(): enumerate every valid layout for the job, predict memory and step time, and rank them.

Degrees, ZeRO stage, SP, CP flavour, pipeline schedule, micro-batch size and activation checkpointing are
searched unless the user fixed them. Traces are shared: the data-parallel flavour and the pipeline schedule
do not change what one rank's model does, so they cost no new trace. Per layout, activation checkpointing
is tried from none to full and the micro-batch grows while it fits; the fastest setting that fits is kept.

The planner always answers: when nothing the runtime can run fits, the layouts the runtime refuses (a rule of
the runtime, not of the model's shape) are priced too and marked `runtime_unsupported` with that rule; they
are never among search()'s feasible list, which `train --strategy auto` takes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from paratrain.costs.hardware import HardwareProfile
from paratrain.errors import UserError
from paratrain.parallel.dims import all_dims, techniques
from paratrain.parallel.layout import DEGREE_DIMS, DIM_NAMES, Layout, subdivision_problem
from paratrain.parallel.options import AC_MODES, DEFAULT_PP_SCHEDULE
from paratrain.parallel.strategies import zero_stages
from paratrain.plan.costing.memory import GIB, MemoryEstimate, estimate_memory, model_state_bytes
from paratrain.plan.costing.time import TimeEstimate, estimate_time
from paratrain.plan.layout_rules import admitted, structural_problem, unpriceable
from paratrain.plan.priced_job import Job  # noqa: F401 - callers take Job from here too

SUBDIVIDING_DIMS = tuple(d for d in DEGREE_DIMS if not d.world_factor)


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryEstimate | None = None
    time: TimeEstimate | None = None
    feasible: bool = False
    reasons: list[str] = field(default_factory=list)
    tokens_per_s_per_device: float = 0.0
    mfu: float | None = None
    runtime_unsupported: str | None = None  # the runtime rule that refuses this layout (priced all the same)


@dataclass
class SearchResult:
    feasible: list[Candidate]  # runnable and fitting, fastest first
    unsupported: list[Candidate]  # fitting but refused by a runtime rule (only when nothing runnable fits)
    infeasible: list[Candidate]  # over memory, smallest first (some may be runtime_unsupported too)
    examined: int
    refusals: list[str] = field(default_factory=list)  # why layouts were not priced at all


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every way to write n as a product of k ordered factors (the last one takes what the others leave)."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in divisors(n) for rest in factorizations(n // d, k - 1)]


def base_layouts(job: Job, fixed: dict, gpus_per_node: int) -> list[Layout]:
    """Every (degrees, ZeRO stage, SP, CP flavour, schedule) the job allows; micro-batching and AC come later."""
    out = []
    for factors in factorizations(job.gpus, len(DIM_NAMES)):
        degrees = dict(zip(DIM_NAMES, factors))
        if any(fixed.get(k) is not None and fixed[k] != v for k, v in degrees.items()):
            continue
        if not worth_searching(job, degrees, fixed):
            continue
        for subdivided in subdivision_degrees(job, degrees, fixed):
            out += layouts_of_degrees(job, {**degrees, **subdivided}, fixed)
    return list(dict.fromkeys(out))


def worth_searching(job: Job, degrees: dict, fixed: dict) -> bool:
    """Whether each degree the user left open is one its technique tries (CP: long sequences only)."""
    return all(fixed.get(d.name) is not None or d.technique.worth_searching(degrees[d.name], job.seq_len)
               for d in DEGREE_DIMS if d.world_factor)


def subdivision_degrees(job: Job, degrees: dict, fixed: dict) -> list[dict[str, int]]:
    """The degrees of the dims that add no ranks (dims.py `within`): as fixed; else every divisor of the ranks they
    subdivide where the model has something to split that way (--ep: an MoE model's experts), else 1."""
    options = []
    for dim in SUBDIVIDING_DIMS:
        if fixed.get(dim.name) is not None:
            options.append([(dim.name, fixed[dim.name])])
            continue
        ranks = math.prod(degrees[d] for d in dim.within)
        # left open, each technique says which degrees are worth trying (--ep: those dividing an MoE model's
        # experts); a dimension without one stays at 1
        options.append([(dim.name, n) for n in divisors(ranks) if n == 1 or dim.technique.searched_degree(job.args, n)])
    out = [dict(combo) for combo in itertools.product(*options)]
    return [d for d in out if not subdivision_problem({**degrees, **d})]


def layouts_of_degrees(job: Job, degrees: dict, fixed: dict) -> list[Layout]:
    """Every combination of the techniques' searched options (ZeRO stage, SP, CP flavour, schedule, ...) of one
    set of degrees; of the ZeRO stages, those the layout's strategy name runs again (its command is right)."""
    options = [t.search_options(degrees, fixed, all_dims()) for t in sorted(techniques(), key=lambda t: t.search_order)]
    runnable = zero_stages(degrees)
    layouts = (Layout(**degrees, **{k: v for part in combo for k, v in part.items()}, **job.layout_options())
               for combo in itertools.product(*options))
    return [lay for lay in layouts if lay.zero_stage in runnable]


def model_states(job: Job, lay: Layout) -> dict[str, float]:
    """Bytes of parameters, gradients and AdamW state on one rank before any activation: fp32 master weights,
    fp32 gradients, two fp32 moments (16 bytes per parameter), sharded as the layout shards them. Under LoRA the
    frozen base keeps its fp32 weights alone; gradients and moments are the adapters'."""
    from paratrain.models.presets import count_params

    n = count_params(job.args) / lay.tp / lay.pp
    dp = lay.shard_degree if lay.fsdp else lay.dp
    # FSDP2 keeps parameters sharded between steps at both stages (ZeRO-2 only holds them gathered longer)
    stage = 3 if lay.fsdp else lay.zero_stage
    if job.lora is None:
        return model_state_bytes(n, dp, stage, k_optimizer=4 * job.optimizer_states, param_bytes=4, grad_bytes=4)
    base = model_state_bytes(n, dp, stage, k_optimizer=0, param_bytes=4, grad_bytes=0)
    adapters = model_state_bytes(job.lora.params / lay.tp / lay.pp, dp, stage, k_optimizer=4 * job.optimizer_states,
                                 param_bytes=4, grad_bytes=4)
    return {k: base[k] + adapters[k] for k in base}


def model_states_floor(job: Job, lay: Layout) -> float:
    return model_states(job, lay)["total"]


def evaluate(job: Job, hw: HardwareProfile, lay: Layout) -> Candidate:
    cand = Candidate(lay)
    budget = hw.gpu.mem_gib * GIB * (1 - job.mem_reserve)
    mem = estimate_memory(job.args, lay, job.seq_len, job.dtype, job.device_type, job.optimizer_states)
    cand.memory = mem
    cand.feasible = mem.total <= budget
    return with_time(job, hw, cand)


def with_time(job: Job, hw: HardwareProfile, cand: Candidate) -> Candidate:
    """Step time, tokens/s and MFU, for layouts that do not fit too (how fast it would be with more memory)."""
    if cand.time is None:
        lay = cand.layout
        cand.time = estimate_time(hw, job.args, lay, job.seq_len, job.dtype, job.device_type,
                                  async_tp=job.async_tp, dist_optimizer=job.dist_optimizer,
                                  moe_routing=job.moe_routing, half_weights=job.half_weights)
        tokens = job.global_batch * job.seq_len
        cand.tokens_per_s_per_device = tokens / cand.time.step_s / lay.world
        peak = hw.gpu.peak_tflops.get(job.dtype)
        cand.mfu = job.flops_per_token * tokens / cand.time.step_s / (lay.world * peak * 1e12) if peak else None
    return cand


def micro_batch_options(job: Job, lay: Layout, fixed: dict) -> list[int]:
    local = job.global_batch // lay.dp
    if fixed.get("micro_batch"):
        return [fixed["micro_batch"]] if local % fixed["micro_batch"] == 0 else []
    return [d for d in divisors(local) if all(t.allows_microbatches(lay, local // d) for t in techniques())]


def with_micro_batch(base: Layout, job: Job, ac: str, mb: int) -> Layout:
    return replace(base, ac=ac, micro_batch=mb, microbatches=(job.global_batch // base.dp) // mb)


def screen(job: Job, hw: HardwareProfile, base: Layout, fixed: dict) -> Candidate | None:
    """The layout at its smallest memory: the smallest valid micro-batch, full AC (or the fixed AC)."""
    ac = fixed.get("ac") or AC_MODES[-1]
    for mb in micro_batch_options(job, base, fixed):
        lay = with_micro_batch(base, job, ac, mb)
        if structural_problem(job, lay, hw.gpu.gpus_per_node) is None:
            return evaluate(job, hw, lay)
    return None


def screen_unsupported(job: Job, hw: HardwareProfile, base: Layout, fixed: dict,
                       refusals: dict[str, None]) -> Candidate | None:
    """As screen(), for a layout the runtime refuses at every micro-batch: priced and marked with the rule.
    None when some micro-batch runs (screen() has priced it) or none can be priced (the problem is kept)."""
    ac = fixed.get("ac") or AC_MODES[-1]
    for mb in micro_batch_options(job, base, fixed):
        lay = with_micro_batch(base, job, ac, mb)
        ok, rule = admitted(job, lay, hw.gpu.gpus_per_node, unsupported_ok=True)
        if ok and rule is None:
            return None
        if not ok:
            refusals[unpriceable(job, lay, hw.gpu.gpus_per_node) or rule] = None
            continue
        try:
            cand = evaluate(job, hw, lay)
        except (UserError, ValueError, ZeroDivisionError) as exc:
            refusals[f"{rule}; the cost model cannot price it either ({exc})"] = None
            continue
        cand.runtime_unsupported = rule
        return cand
    return None


def grow(job: Job, hw: HardwareProfile, cand: Candidate, fixed: dict) -> Candidate:
    """Double the micro-batch while it is predicted to fit and to run faster."""
    if fixed.get("micro_batch"):
        return cand
    budget = hw.gpu.mem_gib * GIB * (1 - job.mem_reserve)
    options = micro_batch_options(job, cand.layout, fixed)
    best = cand
    for mb in (m for m in options if m > best.layout.micro_batch):
        mem = best.memory
        lay = with_micro_batch(cand.layout, job, cand.layout.ac, mb)
        # activations and temporaries grow with the micro-batch: skip traces that cannot fit (unless the
        # accumulation ends, which frees the gradients held across micro-batches: then trace and see)
        guess = mem.total + (mem.activations + max(mem.other, 0.0)) * (mb / best.layout.micro_batch - 1)
        if guess > budget * 1.05 and not (lay.microbatches == 1 < best.layout.microbatches):
            break
        ok, rule = admitted(job, lay, hw.gpu.gpus_per_node, unsupported_ok=cand.runtime_unsupported is not None)
        if not ok:
            continue
        trial = evaluate(job, hw, lay)
        trial.runtime_unsupported = rule
        if not trial.feasible or trial.time.step_s > best.time.step_s * 0.99:
            break
        best = trial
    return best


# a layout without recomputation runs at >= ~3/4 of its full-AC time (full AC adds one forward to fwd + 2 fwd)
AC_SPEEDUP_BOUND = {"full": 0.72, "selective": 0.9, "none": 1.0}


def refine(job: Job, hw: HardwareProfile, screened: Candidate, fixed: dict) -> Candidate:
    """From the screening setting to the fastest that fits: less recomputation first, then bigger micro-batches."""
    best = screened
    if not fixed.get("ac"):
        for ac in AC_MODES[:AC_MODES.index(screened.layout.ac)]:
            lay = with_micro_batch(screened.layout, job, ac, screened.layout.micro_batch)
            trial = evaluate(job, hw, lay)
            trial.runtime_unsupported = screened.runtime_unsupported  # no runtime rule looks at the AC
            if trial.feasible:
                best = trial if trial.time.step_s < best.time.step_s else best
                break
    return grow(job, hw, best, fixed)


def search(job: Job, hw: HardwareProfile, fixed: dict,
           exhaustive: bool = False) -> tuple[list[Candidate], list[Candidate], int]:
    """(feasible candidates, fastest first; infeasible ones, smallest first; layouts examined): only layouts the
    runtime runs are feasible here (`train --strategy auto` takes the first); search_all() has the rest."""
    found = search_all(job, hw, fixed, exhaustive)
    return [c for c in found.feasible if c.runtime_unsupported is None], found.infeasible, found.examined


def search_all(job: Job, hw: HardwareProfile, fixed: dict, exhaustive: bool = False) -> SearchResult:
    """Every layout is first screened at its smallest memory (full AC, smallest micro-batch); only those whose
    screened time, minus what recomputation can cost at most, could still beat the best found are refined.
    Pipeline layouts join when the cluster has several nodes, when --pp is given, or when nothing else fits;
    context-parallel layouts (long sequences) when --cp is given or when nothing else fits.
    exhaustive: every layout is refined, pipeline and CP layouts always join (`plan --search full`).
    When nothing the runtime runs fits, the layouts it refuses are priced too (SearchResult.unsupported).
    """
    feasible, infeasible = [], []
    bases = base_layouts(job, fixed, hw.gpu.gpus_per_node)
    nodes = math.ceil(job.gpus / hw.gpu.gpus_per_node)
    first = [b for b in bases if exhaustive or not any(t.deferred_in_search(b, fixed, nodes) for t in techniques())]
    chosen = set(first)
    groups = [first, [b for b in bases if b not in chosen]]
    usable = hw.gpu.mem_gib * GIB * (1 - job.mem_reserve)
    examined = 0
    for group in groups:
        if not group or (feasible and group is groups[1]):
            continue
        screened = []
        for base in group:
            examined += 1
            floor = model_states_floor(job, base)
            if floor > usable:
                # no trace needed: parameters, gradients and optimizer state alone overflow the GPU
                mem = MemoryEstimate(phase="model states alone (activations not traced)",
                                     notes=["16 bytes per parameter: fp32 weights, fp32 gradients, AdamW moments"
                                            if job.lora is None else "4 bytes per frozen parameter (fp32 weights); "
                                            "the adapters' 16 (weights, gradients, AdamW moments)"])
                states = model_states(job, base)
                mem.params, mem.grads, mem.optimizer = states["params"], states["grads"], states["optimizer"]
                lay = with_micro_batch(base, job, fixed.get("ac") or AC_MODES[-1], fixed.get("micro_batch") or 1)
                infeasible.append(Candidate(lay, memory=mem, feasible=False))
                continue
            cand = screen(job, hw, base, fixed)
            if cand is None:
                continue
            (screened if cand.feasible else infeasible).append(cand)
        feasible += refine_all(job, hw, screened, fixed, exhaustive)
    unsupported, refusals = [], {}
    if not feasible:
        # nothing the runtime runs fits: price what it refuses as well, each marked with the rule that refuses it
        screened = []
        for base in bases:
            if model_states_floor(job, base) > usable:
                continue  # listed above, states alone
            cand = screen_unsupported(job, hw, base, fixed, refusals)
            if cand is not None:
                (screened if cand.feasible else infeasible).append(cand)
        unsupported = refine_all(job, hw, screened, fixed, exhaustive)
    feasible.sort(key=lambda c: c.time.step_s)
    unsupported.sort(key=lambda c: c.time.step_s)
    infeasible.sort(key=lambda c: c.memory.total)
    return SearchResult(feasible, unsupported, infeasible, examined, list(refusals))


def refine_all(job: Job, hw: HardwareProfile, screened: list[Candidate], fixed: dict,
               exhaustive: bool) -> list[Candidate]:
    """Refine the screened candidates, fastest first, skipping those that cannot beat the best refined one."""
    out = []
    best_time = math.inf
    for cand in sorted(screened, key=lambda c: c.time.step_s):
        bound = cand.time.step_s * AC_SPEEDUP_BOUND[cand.layout.ac]
        if exhaustive or bound < best_time:
            cand = refine(job, hw, cand, fixed)
        best_time = min(best_time, cand.time.step_s)
        out.append(cand)
    return out


def smallest_gpu_count(job: Job, hw: HardwareProfile, fixed: dict, limit: int = 65536,
                       max_evaluations: int = 24) -> tuple[int, Candidate] | None:
    """The fewest GPUs on which a memory-frugal layout fits (FSDP over the data-parallel ranks, full AC,
    micro-batch 1, TP/PP as needed). Degrees the user fixed stay fixed; CP only where it was fixed. Counts whose
    model states alone overflow are skipped without a trace; at most `max_evaluations` layouts are evaluated."""
    gpn = hw.gpu.gpus_per_node
    counts = sorted({2 ** i for i in range(17)} | {gpn * k for k in range(1, limit // max(gpn, 1) + 1)})
    usable = hw.gpu.mem_gib * GIB * (1 - job.mem_reserve)
    cp = fixed.get("cp") or 1
    evaluations = 0
    for n in (c for c in counts if job.gpus < c <= limit):
        trial = replace(job, gpus=n)
        tps = [fixed["tp"]] if fixed.get("tp") else [t for t in (1, 2, 4, 8) if t <= min(gpn, n)]
        pps = [fixed["pp"]] if fixed.get("pp") else [1, 2, 4, 8, 16, 32, 64]
        for tp, p in itertools.product(tps, pps):
            if n % (tp * p * cp):
                continue
            dp = n // (tp * p * cp)
            if job.global_batch % dp:
                continue
            degrees = {"pp": p, "dp_shard": dp, "cp": cp, "tp": tp}
            frugal = {k: v for t in techniques() for k, v in t.frugal_options(degrees).items()}
            lay = Layout(**degrees, **frugal, ac=AC_MODES[-1], micro_batch=1, microbatches=job.global_batch // dp,
                         pp_schedule=DEFAULT_PP_SCHEDULE, **job.layout_options())
            if model_states_floor(trial, lay) > usable or structural_problem(trial, lay, gpn):
                continue
            cand = evaluate(trial, hw, lay)
            evaluations += 1
            if cand.feasible:
                return n, cand
            if evaluations >= max_evaluations:
                return None
    return None
