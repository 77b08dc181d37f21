"""The causes of low utilization as rules (RULES, nine): each looks at this run and may return one finding.

A finding carries a severity, a score (the estimated fraction of step time at stake, used to rank
findings of equal severity), evidence built from this run's numbers, and a fix that is a paratrain flag
or config key wherever one exists. Findings are sorted: severity first, then score.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from paratrain.doctor.nvml import LIMITING_REASONS
from paratrain.doctor.shapes import misaligned_shapes, misaligned_share
from paratrain.models.hf_files import hf_location, is_hf_model, read_hf_config

SEVERITY_ORDER = {"high": 0, "medium": 1, "low": 2}
# every `cause` a finding may name (the doctor --json contract); RULES raise all but "hang" (doctor/hang.py)
CAUSES = ("small_compute", "data_loading", "shapes", "memory", "communication", "allocation", "monitoring",
          "straggler", "expert_imbalance", "hang")


@dataclass
class Finding:
    cause: str
    severity: str
    score: float
    evidence: str
    fix: str
    numbers: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cause not in CAUSES or self.severity not in SEVERITY_ORDER:
            raise ValueError(f"finding {self.cause!r}/{self.severity!r} is outside the doctor's contract")

    def to_dict(self) -> dict:
        return {"cause": self.cause, "severity": self.severity, "evidence": self.evidence, "fix": self.fix,
                "score": round(self.score, 4), "numbers": self.numbers}


@dataclass
class Context:
    cfg: object  # TrainConfig
    args: object  # ModelArgs
    layout: object  # the parallel Layout that ran
    device_type: str
    analysis: dict  # analyze.breakdown()
    captures: list[dict]
    mem_budget_gib: float | None = None
    predicted_mem_gib: float | None = None

    @property
    def fractions(self) -> dict:
        return self.analysis["fractions"]

    @property
    def step_ms(self) -> float:
        return self.analysis["step_time_s"] * 1e3

    def cost(self, cause: str) -> float | None:
        """The cause's counterfactual cost as a fraction of the step (None where no probe removed it)."""
        return (self.analysis.get("counterfactual") or {}).get("fractions", {}).get(cause)

    def cost_s(self, cause: str) -> float | None:
        return (self.analysis.get("counterfactual") or {}).get("seconds", {}).get(cause)

    def oversubscription(self) -> tuple[int, int, int] | None:
        """(threads per rank, local ranks, cores) when CPU ranks run more threads than there are cores."""
        cap = self.captures[0]
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or self.layout.world)
        threads, cores = cap["threads"], cap["cores"]
        return (threads, local, cores) if self.device_type == "cpu" and threads * local > cores else None


def by_threshold(value: float, high: float, medium: float, low: float | None = None) -> str | None:
    if value >= high:
        return "high"
    if value >= medium:
        return "medium"
    if low is not None and value >= low:
        return "low"
    return None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


# -- 1. too little parallel work -------------------------------------------------------------------------------
def check_small_compute(ctx: Context) -> Finding | None:
    share = ctx.fractions["host_overhead"]
    severity = by_threshold(share, 0.4, 0.25)
    if severity is None:
        return None
    cap = ctx.captures[0]
    rank0 = ctx.analysis["per_rank"][0]
    rate = cap["calibration"].get("matmul_flops_per_s") or 0.0
    math_ms = cap["flops_per_step"] / rate * 1e3 if rate else float("nan")
    micro = ctx.layout.micro_batch
    tokens = micro * ctx.cfg.seq_len
    if ctx.device_type == "cuda":
        how = f"the GPU sat idle between kernels {share:.0%} of the step"
        nvml = cap.get("nvml") or {}
        if "sm_util_mean" in nvml:
            how += f" (NVML SM utilization {nvml['sm_util_mean']:.0f}%)"
    else:
        how = (f"fixed per-op overhead is ~{share:.0%} of the step: {rank0['ops_per_step']:.0f} ops per step at "
               f"~{(rank0['op_cost_s'] or 0) * 1e6:.1f} us each")
    evidence = (f"{how}; the model's math is {cap['flops_per_step'] / 1e9:.3g} GFLOP per rank per step, "
                f"{math_ms:.2f} ms at this device's measured {rate / 1e9:.0f} GFLOP/s, in a {ctx.step_ms:.1f} ms "
                f"step; {tokens} tokens per micro-batch per rank")
    bigger = max(8, micro * 4)
    fix = (f"give each op more work: raise --micro-batch {micro} -> {bigger} (and --global-batch to match) or "
           f"--seq-len; --compile fuses elementwise ops into fewer kernels; with fewer processes (--nproc) each "
           f"rank gets a larger share of the batch")
    return Finding("small_compute", severity, share, evidence, fix,
                   {"host_overhead_fraction": share, "ops_per_step": rank0["ops_per_step"],
                    "op_cost_us": (rank0["op_cost_s"] or 0) * 1e6, "math_ms": math_ms,
                    "tokens_per_micro_batch": tokens})


# -- 2. data loading ---------------------------------------------------------------------------------------------
def check_data_loading(ctx: Context) -> Finding | None:
    share = ctx.fractions["data_wait"]
    cost = ctx.cost("data_loading")
    # the exposed wait is measured directly; the counterfactual (real loop minus the step on staged data)
    # also carries the loader's competition for cores, but a loader that only waits costs nothing
    severity = by_threshold(share, 0.3, 0.1, 0.05)
    if severity is None:
        return None
    wait = ctx.analysis["seconds"]["data_wait"]
    worst = max(ctx.analysis["per_rank"], key=lambda r: r["seconds"]["data_wait"])
    evidence = (f"each step waited {_ms(wait)} for its batch ({share:.0%} of the {ctx.step_ms:.1f} ms step; worst "
                f"rank {worst['rank']}: {_ms(worst['seconds']['data_wait'])}); the prefetcher builds 2 steps ahead, "
                f"so the loader itself is slower than training")
    if cost is not None:
        evidence += f"; the same step on pre-staged data is {_ms(ctx.cost_s('data_loading'))} shorter ({cost:.0%})"
    source = "synthetic data" if ctx.cfg.data == "synthetic" else f"--data {ctx.cfg.data}"
    if getattr(ctx.cfg, "tokenizer", None):  # documents tokenized on the fly in the loader's worker process
        fix = (f"the loader tokenizes documents on the fly ({source}): give it more worker processes with "
               f"--data-workers N (now {getattr(ctx.cfg, 'data_workers', 1)}), or tokenize once ahead with "
               f"`paratrain data prepare --tokenizer DIR FILES -o tokens.bin` and train on --data tokens.bin "
               f"(memory-mapped, no tokenizing per step)")
    else:
        fix = (f"make loading cheaper than a step: pre-tokenize into a flat uint16/uint32 .bin and pass --data "
               f"FILE.bin (memory-mapped, read on the prefetch thread) instead of decoding per batch ({source} now); "
               f"when the cost is per batch rather than per token, a larger --micro-batch/--global-batch amortizes it")
    return Finding("data_loading", severity, share, evidence, fix,
                   {"data_wait_fraction": share, "data_wait_ms": wait * 1e3, "counterfactual_fraction": cost,
                    "counterfactual_ms": None if cost is None else ctx.cost_s("data_loading") * 1e3})


# -- 3. shapes ---------------------------------------------------------------------------------------------------
def check_shapes(ctx: Context) -> Finding | None:
    issues = misaligned_shapes(ctx.args, ctx.layout.tp)
    if not issues:
        return None
    share = misaligned_share(issues)
    severity = by_threshold(share, 0.3, 0.05) or "low"
    evidence = "; ".join(f"{i['name']} {i['value']} is not a multiple of {i['multiple']} ({i['where']}, "
                         f"{i['flops_share']:.0%} of model FLOPs)" for i in issues)
    if is_hf_model(ctx.cfg.model):
        fix = hf_shape_fix(ctx.cfg, issues)
    else:
        keys = [f"{i['key']} = {i['padded']}" for i in issues if i.get("key")]
        fix = (f"pad to aligned sizes: {', '.join(keys)} in the run's --config TOML (extra vocabulary rows are never "
               f"targets; they cost memory only)" if keys else "choose aligned sizes")
    extra = [f"{i['name']} -> {i['padded']}" for i in issues if not i.get("key")]
    if extra:
        fix += "; " + ", ".join(extra)
    return Finding("shapes", severity, 0.3 * share, evidence, fix,
                   {"misaligned": issues, "padded": {i["name"]: i["padded"] for i in issues}})


# a transformers model's sizes live in its config.json, under that architecture's names
HF_SHAPE_KEYS = {"gpt2": {"vocab_size": "vocab_size", "dim": "n_embd", "ffn_dim": "n_inner"}}
HF_COMMON_KEYS = {"vocab_size": "vocab_size", "dim": "hidden_size", "ffn_dim": "intermediate_size"}


def hf_shape_fix(cfg, issues: list[dict]) -> str:
    """The fix for `--model hf:PATH`, whose shape is not a paratrain setting: its config.json's own keys for a
    from-scratch run; with pretrained weights (--init-from) the sizes are fixed, so a larger micro-batch."""
    bigger = "a larger --micro-batch makes each matmul bigger and the ragged tile a smaller part of it"
    if cfg.init_from:
        return f"these sizes are the pretrained weights' own (--init-from {cfg.init_from}): keep them; {bigger}"
    config_path, _ = hf_location(cfg.model)
    names = HF_SHAPE_KEYS.get(read_hf_config(cfg.model)["model_type"], HF_COMMON_KEYS)
    keys = [f"{names[i['key']]} = {i['padded']}" for i in issues if i.get("key") in names]
    if not keys:
        return f"these sizes are the model's own; {bigger}"
    return (f"this model's shape comes from its config.json: for a run from scratch set {', '.join(keys)} in "
            f"{config_path} (extra vocabulary rows are never targets); to keep the model as it is, {bigger}")


# -- 4. memory ---------------------------------------------------------------------------------------------------
def memory_budget_gib(ctx: Context) -> float | None:
    if ctx.mem_budget_gib:
        return ctx.mem_budget_gib
    nvml = (ctx.captures[0].get("nvml") or {}) if ctx.captures else {}
    if nvml.get("mem_total_gib"):
        return nvml["mem_total_gib"]
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None
    return ram / max(1, ctx.layout.world)


def check_memory(ctx: Context) -> Finding | None:
    budget = memory_budget_gib(ctx)
    if not budget:
        return None
    measured = max(c.get("memory_reserved_gib") or c["memory_gib"] for c in ctx.captures)
    predicted = ctx.predicted_mem_gib
    peak = max(measured, predicted or 0.0)
    ratio = peak / budget
    severity = "high" if ratio >= 0.9 else ("low" if ratio >= 0.75 else None)
    if severity is None:
        return None
    states = ctx.captures[0].get("model_state_bytes") or {}
    parts = ", ".join(f"{k} {states[k] / 2**30:.3f}" for k in ("params", "grads", "optimizer") if k in states)
    what = "peak resident set size (includes the Python/torch runtime)" if ctx.device_type == "cpu" else \
        "peak reserved device memory"
    pred = f", planner predicts {predicted:.2f} GiB" if predicted else ""
    evidence = (f"{what} {measured:.2f} GiB per rank{pred} = {ratio:.0%} of the {budget:.2f} GiB budget "
                f"(> 90% leaves no headroom for fragmentation or longer batches)")
    if parts:
        evidence += f"; model states on rank 0 (GiB): {parts}"
    micro = ctx.layout.micro_batch
    fixes = []
    if not (ctx.layout.fsdp and ctx.layout.zero_stage == 3):
        fixes.append("--strategy zero3 (shards params, grads and optimizer state over the data-parallel ranks)")
    if ctx.cfg.ac != "full":
        fixes.append("--ac full (keeps one activation per block, recomputes the rest in backward)")
    if micro > 1:
        fixes.append(f"--micro-batch {max(1, micro // 2)} to accumulate gradients over smaller micro-batches")
    if ctx.cfg.dtype == "fp32":
        fixes.append("--dtype bf16")
    fix = "; ".join(fixes) or "use more devices (--nproc) or a smaller --seq-len"
    return Finding("memory", severity, max(ratio, 0.9) if severity == "high" else 0.05, evidence, fix,
                   {"peak_gib": measured, "predicted_gib": predicted, "budget_gib": budget, "ratio": ratio})


# -- 5. communication --------------------------------------------------------------------------------------------
def check_communication(ctx: Context) -> Finding | None:
    share = ctx.fractions["communication_exposed"]
    cost, cost_s = ctx.cost("communication"), ctx.cost_s("communication")
    split = (ctx.analysis.get("counterfactual") or {}).get("communication_split") or {}
    contended = cost is not None and split.get("distributed_s") is not None and ctx.oversubscription()
    if contended:
        # peer-rank contention on oversubscribed cores is the allocation finding's cause, not communication's:
        # rank by the gradient sync alone
        cost_s, split = split["sync_s"], {"sync_s": split["sync_s"]}
        cost = cost_s / (ctx.step_ms / 1e3)
    # ranked by what removing the gradient sync saves where a probe measured it: collectives that share the
    # cores (or memory bandwidth) with compute slow it down without showing as exposed waits. On oversubscribed
    # cores the exposed waits are mostly a descheduled peer, so the sync's own cost alone ranks it there.
    at_stake = cost if contended else max(share, cost) if cost is not None else share
    severity = by_threshold(at_stake, 0.3, 0.1, 0.03)
    if severity is None:
        return None
    exposed = ctx.analysis["seconds"]["communication_exposed"]
    comm = ctx.captures[0].get("comm") or {}
    nbytes = comm.get("total_bytes")
    by_op = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in (comm.get("bytes_by_op") or {}).items() if v >= 2**10)
    evidence = f"collectives left the step waiting {_ms(exposed)} ({share:.0%} of the {ctx.step_ms:.1f} ms step)"
    if cost is not None and split.get("distributed_s") is not None:
        evidence += (f"; the same step on one rank alone (the peers waiting) is {_ms(split['distributed_s'])} "
                     f"shorter: running distributed costs {cost:.0%} of the step, the gradient sync itself "
                     f"{_ms(split['sync_s'])} (skipping it with DDP no_sync) plus {_ms(split['contention_s'])} "
                     f"of peer-rank contention (ranks computing at once on shared cores or memory bandwidth)")
    elif cost is not None:
        evidence += (f"; skipping the gradient sync (DDP no_sync) makes the step {_ms(cost_s)} "
                     f"shorter: communication costs {cost:.0%} of the step")
    if nbytes:
        evidence += f"; {nbytes / 2**20:.1f} MiB per rank per step ({by_op})"
        if exposed > 0:
            evidence += f", {nbytes / exposed / 1e9:.2f} GB/s over the exposed time"
    layout = ctx.layout
    micro = layout.micro_batch
    accumulate = (f"accumulate: keep --micro-batch {micro} and raise --global-batch to "
                  f"{ctx.cfg.global_batch * 4} (one gradient sync per 4 micro-batches)")
    if layout.data_parallel_only:
        fix = (f"--ddp-comm-hook bf16 (halves all-reduce bytes); {accumulate}; --strategy zero2 (reduce-scatter, "
               f"overlaps with backward); bigger DDP buckets (bucket_cap_mb) if many small all-reduces; "
               f"--local-sgd-period 8 to average every 8 steps")
    elif layout.fsdp:
        fix = (f"{'--strategy zero2 (no parameter re-gather in backward); ' if layout.zero_stage != 2 else ''}"
               f"{accumulate}; across nodes use hsdp (--dp-replicate nodes) so shards stay on fast links")
    elif layout.splits_within_layers:
        fix = "keep --tp within one node (fast links); use --sp; give the rest of the devices to --dp-shard"
    else:
        fix = f"{accumulate}; fewer ranks per collective (lower the degree of the communicating dimension)"
    return Finding("communication", severity, at_stake, evidence, fix,
                   {"exposed_fraction": share, "exposed_ms": exposed * 1e3, "bytes_per_step": nbytes,
                    "counterfactual_fraction": cost,
                    "counterfactual_ms": None if cost is None else cost_s * 1e3,
                    **{f"{k[:-2]}_ms": (None if v is None else v * 1e3) for k, v in split.items()}})


# -- 6. resource allocation and scheduling ---------------------------------------------------------------------------
def check_allocation(ctx: Context) -> Finding | None:
    candidates: list[Finding] = []
    if over := ctx.oversubscription():
        threads, local, cores = over
        lost = 1.0 - cores / (threads * local)
        switches = statistics_mean(c["involuntary_switches_per_step"] for c in ctx.captures)
        candidates.append(Finding(
            "allocation", "high" if lost >= 0.3 else "medium", lost,
            f"{local} ranks x {threads} intra-op threads = {threads * local} threads on {cores} cores "
            f"({threads * local / cores:.1f}x oversubscribed); {switches:.0f} involuntary context switches per "
            f"step per rank",
            f"run with OMP_NUM_THREADS={max(1, cores // local)} (cores / ranks; paratrain only sets it when unset), "
            f"or fewer processes (--nproc {max(1, cores // max(1, threads))})",
            {"threads_per_rank": threads, "ranks": local, "cores": cores}))
    if ctx.layout.splits_stages:
        stages = ctx.layout.pp * ctx.layout.virtual_stages
        layers = ctx.args.n_layers
        per = [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]
        imbalance = max(per) / (layers / stages) - 1
        if imbalance > 0.1:
            good = [p for p in range(2, layers + 1) if layers % p == 0]
            candidates.append(Finding(
                "allocation", "high" if imbalance >= 0.25 else "medium", imbalance / (1 + imbalance),
                f"{layers} layers over {stages} pipeline stages gives stages of {per} layers: the slowest stage "
                f"is {imbalance:.0%} above the mean and every other stage waits for it",
                f"choose --pp (x --virtual-stages) dividing {layers} layers, e.g. --pp {good[0] if good else 1}",
                {"layers_per_stage": per}))
        if ctx.fractions["bubble"] >= 0.1:
            candidates.append(Finding(
                "allocation", by_threshold(ctx.fractions["bubble"], 0.3, 0.1) or "low", ctx.fractions["bubble"],
                f"pipeline bubble {ctx.fractions['bubble']:.0%} of the step ({ctx.layout.pp_schedule}, pp={ctx.layout.pp})",
                "raise --microbatches (>= 4 x pp) or use --pp-schedule interleaved-1f1b with --virtual-stages 2",
                {"bubble_fraction": ctx.fractions["bubble"]}))
    computes = [r["seconds"]["compute"] for r in ctx.analysis["per_rank"]]
    # under --dp-batch-split the ranks are loaded unevenly on purpose: compare compute per sequence instead
    shares = _sequences_per_rank(ctx)
    per_unit = [c / n for c, n in zip(computes, shares)] if shares else computes
    if len(per_unit) > 1 and min(per_unit) > 0 and max(per_unit) / min(per_unit) > 1.5:
        spread = 1 - min(per_unit) / max(per_unit)
        slow = ctx.analysis["per_rank"][per_unit.index(max(per_unit))]["rank"]
        what = (f"compute per sequence ranges {_ms(min(per_unit))} .. {_ms(max(per_unit))} under the configured "
                f"--dp-batch-split (sequences per rank {shares})" if shares else
                f"compute per step ranges {_ms(min(computes))} .. {_ms(max(computes))}")
        candidates.append(Finding(
            "allocation", "medium", spread * 0.5,
            f"ranks are unevenly loaded: {what} (rank {slow} slowest); the others wait for it in every collective",
            "check for other jobs on the straggler's cores/GPU, and give every rank the same share of devices "
            "and threads (OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES)" + (
                "; or re-weight --dp-batch-split by each rank's speed" if shares else ""),
            {"compute_s_per_rank": computes, **({"sequences_per_rank": shares} if shares else {})}))
    candidates.extend(_gpu_allocation(ctx))
    candidates.extend(_cpus_given_against_asked(ctx))
    return sort_findings(candidates)[0] if candidates else None


def _cpus_given_against_asked(ctx: Context) -> list[Finding]:
    """What the job asked for (Slurm's CPUs per task) against what a rank was given: the cores its CPU affinity
    lets it run on (what srun, cgroups or a Kubernetes CPU manager set)."""
    asked = os.environ.get("SLURM_CPUS_PER_TASK", "")
    cores = ctx.captures[0]["cores"] if ctx.captures else None
    if not asked.isdigit() or cores is None or int(asked) <= cores:
        return []
    asked_n = int(asked)
    return [Finding(
        "allocation", "high" if 2 * cores <= asked_n else "medium", 1 - cores / asked_n,
        f"the job asked for {asked_n} CPUs per task (SLURM_CPUS_PER_TASK) but this rank may run on {cores} "
        f"(its CPU affinity): its {ctx.captures[0]['threads']} threads share those",
        "give the step the job's CPUs: srun --cpus-per-task=\"$SLURM_CPUS_PER_TASK\" (from Slurm 22.05 srun does "
        "not inherit it; `paratrain launch slurm` writes it), and check the site's binding (--cpu-bind, TaskPlugin)",
        {"cpus_asked": asked_n, "cores_given": cores})]


def _sequences_per_rank(ctx: Context) -> list[int] | None:
    """Each captured rank's sequences per step under --dp-batch-split; None when the split is even."""
    from paratrain.parallel.uneven_split import dp_shares

    shares = dp_shares(ctx.layout) if getattr(ctx.layout, "dp_micro_batches", None) else ()
    if not shares:
        return None
    return [shares[ctx.layout.dp_rank(r["rank"])] for r in ctx.analysis["per_rank"]]


def _gpu_allocation(ctx: Context) -> list[Finding]:
    out = []
    nvml = (ctx.captures[0].get("nvml") or {}) if ctx.captures else {}
    limiting = {k: v for k, v in (nvml.get("throttle_reasons") or {}).items()
                if k in LIMITING_REASONS}
    if limiting and max(limiting.values()) >= 0.2:
        reasons = ", ".join(f"{k} {v:.0%} of samples" for k, v in limiting.items())
        out.append(Finding("allocation", "medium", 0.1, f"the GPU throttled its clocks: {reasons}",
                           "check cooling and power limits (nvidia-smi -q -d PERFORMANCE); avoid sharing the GPU",
                           {"throttle_reasons": limiting}))
    if nvml.get("pcie_gen") and nvml.get("pcie_gen_max") and (
            nvml["pcie_gen"] < nvml["pcie_gen_max"] or nvml.get("pcie_width", 0) < nvml.get("pcie_width_max", 0)):
        out.append(Finding("allocation", "medium", 0.05,
                           f"PCIe link runs at gen{nvml['pcie_gen']} x{nvml.get('pcie_width')} of "
                           f"gen{nvml['pcie_gen_max']} x{nvml.get('pcie_width_max')}",
                           "reseat the card or use a full-width slot; check BIOS PCIe settings",
                           {"pcie": {k: nvml.get(k) for k in ("pcie_gen", "pcie_width", "pcie_gen_max",
                                                              "pcie_width_max")}}))
    return out


def statistics_mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


# -- 7. monitoring -----------------------------------------------------------------------------------------------
def check_monitoring(ctx: Context) -> Finding | None:
    cost = ctx.captures[0]["calibration"].get("metrics_record_s") or 0.0
    step = ctx.analysis["step_time_s"] or math.inf
    every = max(1, ctx.cfg.log_every)
    if not ctx.cfg.metrics:
        # flying blind is worth about as much as a 5% slowdown: it outranks smaller low findings
        return Finding("monitoring", "low", 0.05,
                       f"per-step metrics are off (--no-metrics): no RUNDIR/metrics.jsonl, so slowdowns, stalls and "
                       f"loss spikes go unseen; logging a step costs {cost * 1e6:.0f} us here, "
                       f"{cost / every / step:.2%} of the {step * 1e3:.1f} ms step",
                       "drop --no-metrics (metrics = true is the default); run `paratrain doctor` on changes",
                       {"metrics_record_us": cost * 1e6, "overhead_fraction": cost / every / step})
    share = cost / every / step
    if share > 0.02:
        return Finding("monitoring", "medium" if share >= 0.1 else "low", share,
                       f"logging one step's metrics costs {cost * 1e6:.0f} us, {share:.1%} of the {step * 1e3:.1f} ms "
                       f"step (budget: 2%)", f"log_every = {max(10, every * 10)} in the config",
                       {"metrics_record_us": cost * 1e6, "overhead_fraction": share})
    return None


# -- expert imbalance (MoE) -------------------------------------------------------------------------------------
def check_expert_imbalance(ctx: Context) -> Finding | None:
    """An MoE layer whose busiest expert takes far more than the mean: under --ep its rank sets every step's
    pace, and the idle experts learn nothing. Read from the per-layer expert load of the measured steps."""
    steps = [row for row in ctx.captures[0].get("steps", []) if row.get("expert_load")]
    if not steps:
        return None
    layers = steps[-1]["expert_load"]
    worst = max(layers, key=lambda layer: layer["max_over_mean"] or 0.0)
    ratio = worst["max_over_mean"] or 0.0
    experts = len(worst["tokens_per_expert"])
    severity = by_threshold(ratio, 2.0, 1.6, 1.4)
    if severity is None:
        return None
    busiest = max(range(experts), key=lambda e: worst["tokens_per_expert"][e])
    idle = sum(1 for t in worst["tokens_per_expert"] if t == 0)
    return Finding("expert_imbalance", severity, min(1.0, (ratio - 1.0) / max(1.0, experts - 1.0)),
                   f"{worst['layer']}: expert {busiest} takes {ratio:.2f}x the mean load "
                   f"({worst['tokens_per_expert'][busiest]} of {sum(worst['tokens_per_expert'])} routed copies, "
                   f"{idle} of {experts} experts idle); its rank paces each step under --ep",
                   "raise the load-balancing loss (aux_loss_coeff), or turn on the auxiliary-loss-free bias "
                   "update (bias_update_rate, as DeepSeek-V3); check the router's initialisation",
                   {"layer": worst["layer"], "max_over_mean": ratio, "tokens_per_expert": worst["tokens_per_expert"]})


def check_straggler(ctx: Context) -> Finding | None:
    """One rank arrives late at the step's loss all-reduce, by the same phase: the measure `train --monitor`
    uses (train/monitor.py straggler): each rank's own work is its time before that all-reduce, not its wait."""
    from paratrain.train.monitor import THRESHOLDS, straggler

    per_rank = ctx.analysis["per_rank"]
    computes = [r["seconds"]["compute"] for r in per_rank]
    if _sequences_per_rank(ctx) or (min(computes) > 0 and max(computes) / min(computes) > 1.5):
        return None  # a configured uneven split, or uneven compute: check_allocation's finding says it
    rows = [{"forward_backward": r["phases_s"]["forward"] + r["phases_s"]["backward"],
             "optimizer": r["phases_s"]["optimizer"], "loss_sync": r["phases_s"]["loss_sync"]} for r in per_rank]
    own = [row["forward_backward"] + row["optimizer"] for row in rows]
    found = straggler(own, rows, ctx.analysis["step_time_s"])
    if found is None or found["excess"] <= THRESHOLDS["straggler"]:
        return None
    slow, others = found["rank"], [v for i, v in enumerate(own) if i != found["rank"]]
    return Finding(
        # medium at most: a doctor run measures a few steps, where a busy host can make one rank late by chance
        "straggler", "medium", 0.5 * found["excess"] / (1 + found["excess"]),
        f"rank {per_rank[slow]['rank']} works {_ms(own[slow])} per step before the loss all-reduce against "
        f"{_ms(statistics_mean(others))} for the others, most of the difference in {found['phase']}; the others "
        "wait for it in every collective",
        "check for other jobs or throttling on that rank's cores/GPU, and what that rank alone does in that phase",
        {"own_s_per_rank": own, "rank": per_rank[slow]["rank"], "phase": found["phase"]})


RULES = (check_small_compute, check_data_loading, check_shapes, check_memory, check_communication,
         check_allocation, check_monitoring, check_expert_imbalance, check_straggler)


def sort_findings(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (SEVERITY_ORDER[f.severity], -f.score))


def diagnose(ctx: Context) -> list[Finding]:
    return sort_findings([f for rule in RULES if (f := rule(ctx)) is not None])
