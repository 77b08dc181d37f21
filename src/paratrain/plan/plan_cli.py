"""The `paratrain plan` command behind the CLI: resolve model, hardware and fixed choices; plan; format."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping

from paratrain.costs.hardware import (
    HardwareProfile,
    load_profile,
    profile_from_spec,
    with_cluster_overrides,
)
from paratrain.errors import UserError
from paratrain.gpu_catalog import custom_gpu, get_gpu, mig_slice
from paratrain.parallel.dims import mesh_dims
from paratrain.parallel.options import AC_MODES, CP_IMPLS, PP_SCHEDULES
from paratrain.plan.error_bars import describe
from paratrain.plan.inputs.cluster import Cluster, reference_profile, resolve_cluster
from paratrain.plan.request import PlanRequest
from paratrain.plan.search import Job
from paratrain.train.readable_numbers import readable_count

log = logging.getLogger("paratrain")
DTYPES = ("bf16", "fp16", "fp32", "fp8")


def resolve_model(model: str | None, hf_config: str | None):
    """(ModelArgs, name, counts): a transformers config's counts are those of the model transformers builds
    (inputs/hf_count.py); a preset's (None) are its ModelArgs' own."""
    if bool(model) == bool(hf_config):
        raise UserError("give exactly one of --model PRESET or --hf-config config.json")
    from paratrain.plan.inputs.hf_config import load_hf_model, plans_hf_model

    if hf_config:
        args, counts = load_hf_model(hf_config)
        return args, args.name, counts
    from paratrain.models.presets import get_preset

    if plans_hf_model(model):  # --model hf:PATH: a transformers config.json, as --hf-config reads it
        args, counts = load_hf_model(model)
        return args, model, counts
    return get_preset(model), model, None


def _catalog_profile(spec, base: str) -> HardwareProfile:
    """profile_from_spec with the efficiencies of the catalog GPU `base` (a MIG slice runs its GPU's kernels)."""
    if spec.name == base:
        return profile_from_spec(spec)
    return dataclasses.replace(profile_from_spec(dataclasses.replace(spec, name=base)), gpu=spec)


def resolve_hardware(r: PlanRequest, dtype: str) -> HardwareProfile:
    """--hardware FILE, else --gpu NAME (catalog), else custom figures; cluster overrides on top."""
    custom = (r.peak_tflops, r.mem_gib, r.intra_node_gbs, r.inter_node_gbs)
    if r.mem_bw_gbs is not None and r.mem_bw_gbs <= 0:
        raise UserError(f"--mem-bw-gbs must be > 0 (GB/s), got {r.mem_bw_gbs:g}")
    if r.mig and (r.hardware or not r.gpu):
        raise UserError("--mig slices a catalog GPU: give --gpu NAME with it (e.g. --gpu h100-sxm --mig 3g.40gb)")
    if r.hardware:
        profile = load_profile(r.hardware)
    elif r.gpu:
        spec = get_gpu(r.gpu)
        base = spec.name
        if r.mig:
            spec = mig_slice(spec, r.mig)
        if r.mem_gib:
            spec = dataclasses.replace(spec, mem_gib=float(r.mem_gib))
        profile = _catalog_profile(spec, base)
    elif any(v is not None for v in custom):
        profile = profile_from_spec(custom_gpu(*custom, dtype, mem_bw_gbs=r.mem_bw_gbs))
    else:
        raise UserError("give --gpu NAME (see --help), --hardware PROFILE.json, or custom hardware "
                        "(--peak-tflops --mem-gib --intra-node-gbs --inter-node-gbs)")
    per_node = None
    if r.nodes:
        if r.gpus % r.nodes:
            raise UserError(f"--gpus {r.gpus} is not divisible by --nodes {r.nodes}")
        per_node = r.gpus // r.nodes
    named = r.gpu or r.hardware  # the links of a named or measured GPU may be overridden
    if r.mem_bw_gbs is not None and profile.calibrated:
        raise UserError(f"--mem-bw-gbs states a board's memory bandwidth; the --hardware profile {r.hardware} "
                        "measured its own: drop one of them")
    spec = with_cluster_overrides(profile.gpu, gpus_per_node=per_node, intra=r.intra_node_gbs if named else None,
                                  inter=r.inter_node_gbs if named else None,
                                  mem_bw_gbs=r.mem_bw_gbs if named else None)
    if spec is not profile.gpu:
        profile = dataclasses.replace(profile, gpu=spec)
        if not profile.calibrated:
            profile = dataclasses.replace(_catalog_profile(spec, spec.extra.get("mig_of", spec.name)),
                                          notes=profile.notes)
    if dtype not in profile.gpu.peak_tflops:
        raise UserError(f"{profile.gpu.name} has no {dtype} peak (known: {', '.join(profile.gpu.peak_tflops)})")
    return profile


def fixed_choices(r: PlanRequest) -> dict:
    """The choices the request fixes (None: searched), the strategy's own on top; UserError for a bad one."""
    if r.ac is not None and r.ac not in AC_MODES:
        raise UserError(f"--ac must be one of {', '.join(AC_MODES)}, got {r.ac!r}")
    if r.pp_schedule is not None and r.pp_schedule not in PP_SCHEDULES:
        raise UserError(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}, got {r.pp_schedule!r}")
    if r.cp_impl not in (None, *CP_IMPLS):
        raise UserError(f"--cp-impl must be {' or '.join(CP_IMPLS)}, got {r.cp_impl!r}")
    counts = {**r.degrees, "micro_batch": r.micro_batch, "virtual_stages": r.virtual_stages}
    for k, v in counts.items():
        if v is not None and v < 1:
            raise UserError(f"--{k.replace('_', '-')} must be >= 1, got {v}")
    fixed = {**r.degrees, "micro_batch": r.micro_batch, "ac": r.ac, "sp": r.sp, "pp_schedule": r.pp_schedule,
             "virtual_stages": r.virtual_stages, "cp_impl": r.cp_impl}
    if r.strategy:
        from paratrain.parallel.strategies import fixed_by_strategy

        for key, value in fixed_by_strategy(r.strategy).items():
            if fixed.get(key) is None:
                fixed[key] = value
    product = math.prod(fixed[d.name] or 1 for d in mesh_dims())
    if r.gpus % product:
        raise UserError(f"the fixed degrees multiply to {product}, which does not divide --gpus {r.gpus}")
    return fixed


def build_job(r: PlanRequest | Mapping) -> tuple[Job, HardwareProfile, dict]:
    return build_plan_inputs(r)[:3]


def build_plan_inputs(r: PlanRequest | Mapping) -> tuple[Job, HardwareProfile, dict, Cluster | None]:
    """Job, the search's hardware profile, fixed choices, and the cluster when it mixes devices (--cluster FILE
    or --gpu as a list: then the search runs on the slowest device type with the smallest memory, cluster.py).
    A script may hand the request's fields as a dict."""
    if not isinstance(r, PlanRequest):
        r = PlanRequest.of(r)
    args, name, counts = resolve_model(r.model, r.hf_config)
    dtype = r.dtype or "bf16"
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be {', '.join(DTYPES[:-1])} or {DTYPES[-1]}, got {dtype!r}")
    cluster = resolve_cluster({"cluster": r.cluster, "gpu": r.gpu, "gpus": r.gpus},
                              load_profile(r.hardware) if r.hardware else None)
    if cluster is not None:
        if r.nodes or r.mig or any(v is not None for v in (r.peak_tflops, r.mem_gib, r.mem_bw_gbs, r.intra_node_gbs,
                                                             r.inter_node_gbs)):
            raise UserError("a cluster list or file describes the nodes and links itself: drop --nodes, --mig, "
                            "--mem-gib, --mem-bw-gbs, --peak-tflops and the --*-node-gbs options")
        r = r.replace(gpus=len(cluster.devices))
    if r.gpus is None or r.gpus < 1:
        raise UserError("--gpus N (>= 1) is required")
    hw = reference_profile(cluster, dtype) if cluster is not None else resolve_hardware(r, dtype)
    seq = r.seq_len or args.max_seq_len
    if seq > args.max_seq_len:
        if args.family == "gpt2":
            raise UserError(f"--seq-len {seq} exceeds the model's {args.max_seq_len} learned positions")
        args = dataclasses.replace(args, max_seq_len=seq)
    batch = r.global_batch or max(16, r.gpus)
    device = "cpu" if hw.gpu.name == "cpu" else "cuda"
    lora = lora_request(r, dtype, args)
    job = Job(args=args, model_name=name, gpus=r.gpus, seq_len=seq, global_batch=batch, dtype=dtype,
              hf_config=r.hf_config, compile=bool(r.compile), device_type=device, counts=counts, **priced_schemes(r),
              train_flags=r.train_flags + (lora.flags if lora else ()), lora=lora, **optimizer_choice(r))
    return job, hw, fixed_choices(r), cluster


def lora_request(r: PlanRequest, dtype: str, args):
    """--lora-r and its options, checked and the adapters counted on the model (inputs/lora_count.py); None
    without --lora-r."""
    from paratrain.lora_options import LORA_FIELDS
    from paratrain.plan.inputs.hf_config import plans_hf_model
    from paratrain.plan.inputs.lora_count import lora_choice

    hf_source = r.hf_config or (r.model if plans_hf_model(r.model) else None)
    return lora_choice({k: getattr(r, k) for k in LORA_FIELDS}, dtype, hf_source, args)


def optimizer_choice(r: PlanRequest) -> dict:
    """--optimizer and --momentum as the Job takes them (the memory of its state)."""
    from paratrain.training_options import OPTIMIZERS

    optimizer, momentum = r.optimizer or "adamw", r.momentum or 0.0
    if optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer must be {', '.join(OPTIMIZERS[:-1])} or {OPTIMIZERS[-1]}, got {optimizer!r}")
    if momentum and optimizer != "sgd":
        raise UserError(f"--momentum applies to --optimizer sgd; {optimizer} keeps its two moments whatever --betas")
    if not 0 <= momentum < 1:
        raise UserError(f"--momentum must be in [0, 1), got {momentum:g}")
    return {"optimizer": optimizer, "momentum": momentum}


def priced_schemes(r: PlanRequest) -> dict:
    """The Job options for schemes the cost model prices and paratrain's runtime does not run (priced_job.py)."""
    from paratrain.costs.expert_spread import ROUTINGS

    if r.moe_routing not in ROUTINGS:
        raise UserError(f"--moe-routing must be {' or '.join(ROUTINGS)}, got {r.moe_routing!r}")
    if r.async_tp and not r.compile:
        raise UserError("--async-tp prices torch's micro-pipelined TP, which runs compiled: add --compile")
    return {"dist_optimizer": bool(r.dist_optimizer), "async_tp": bool(r.async_tp), "moe_routing": r.moe_routing,
            "half_weights": bool(r.half_weights)}


def format_devices(cand: dict) -> list[str]:
    """#0 on a mixed cluster: each device's share, busy time and memory, even split beside the chosen one."""
    lines = [f"  per device (#0, {'uneven' if cand['dp_batch_split'] or cand['pp_layers'] else 'even'} split; "
             f"even: {cand['step_time_even_s']:.3g} s per step):",
             f"    {'rank':>4} {'node':>4} {'gpu':<10} {'speed':>5} {'share':>8} {'busy s':>8} {'even s':>8} "
             f"{'mem GiB':>8} {'of':>6}"]
    for d, e in zip(cand["per_device"], cand["per_device_even"]):
        share = f"{d['batch']} seq" if "batch" in d else f"{d['layers']} blk" if "layers" in d else "-"
        lines.append(f"    {d['rank']:>4} {d['node']:>4} {d['gpu']:<10} {d['speed']:>5.3g} {share:>8} "
                     f"{d['busy_s']:>8.3g} {e['busy_s']:>8.3g} {d['memory_gib']:>8.3g} {d['mem_capacity_gib']:>6g}")
    return lines


def _short(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def format_error_bars(candidates: list[dict]) -> list[str]:
    """What the ± column means, once per layout family shown."""
    bars = {}
    for cand in candidates:
        bar = cand.get("error_bar")
        if bar and cand["step_time_s"]:
            bars.setdefault(bar.get("layout_family", bar["family"]), bar)
    if not bars:
        return []
    return ["  ±: the planner's mean step-time error on published runs of the layout's kind (docs/planner.md): "
            + "; ".join(f"{fam} {describe(bar)}" for fam, bar in bars.items())]


def format_plan(doc: dict) -> str:
    """The human view (stderr): one line per candidate, then the first candidate's reasons."""
    c = doc["cluster"]
    lines = [f"plan: {doc['model']['name']} ({active_note(doc['model'])} params) on {c['gpus']} x {c['gpu']} "
             f"({c['nodes']} node(s) x {c['gpus_per_node']}), seq {doc['job']['seq_len']}, global batch "
             f"{doc['job']['global_batch']}, {doc['job']['dtype']}",
             f"  hardware: {c['profile']}", f"  cluster: {c['assumptions']}"]
    if not doc["fits"]:
        lines.append("  " + doc["message"])
    header = (f"  {'#':>2} {'strategy':<10} {'dims':<30} {'mb x n':>7} {'ac':<9} {'mem GiB':>7} "
              f"{'= par':>6} {'grad':>5} {'opt':>5} {'act':>5} {'oth':>5} {'step s':>8} {'±':>4} {'= comp':>7} {'tp':>6} "
              f"{'cp':>6} {'dp':>6} {'pp':>6} {'bubble':>6} {'tok/s/dev':>9} {'MFU':>6}  fits")
    lines.append(header)
    for i, cand in enumerate(doc["candidates"]):
        dims = " ".join(f"{k}={v}" for k, v in cand["dims"].items() if v > 1) or "-"
        if cand.get("cp_impl"):
            dims += f" {cand['cp_impl']}"
        if cand.get("pp_schedule"):
            dims += f" {cand['pp_schedule']}"
        mem = cand["memory_gib"] or {}
        parts = " ".join(f"{mem.get(k, math.nan):>5.1f}" for k in ("params", "grads", "optimizer", "activations",
                                                                   "other"))
        t = cand.get("time_breakdown_s") or {}
        times = " ".join(f"{_short(t.get(k)):>6}" for k in ("tp_comm_s", "cp_comm_exposed_s", "dp_comm_exposed_s",
                                                            "pp_comm_exposed_s", "bubble"))
        step = f"{cand['step_time_s']:.3g}" if cand["step_time_s"] else "-"
        tps = f"{cand['tokens_per_s_per_device']:.4g}" if cand["tokens_per_s_per_device"] else "-"
        mfu = f"{cand['mfu']:.1%}" if cand.get("mfu") is not None else "-"
        bar = (cand.get("error_bar") or {}).get("step_time_rel")
        pm = f"{bar:.0%}" if bar is not None and cand["step_time_s"] else "-"
        fits = ("yes" if cand["feasible"] else "no") + (" (runtime_unsupported)" if cand.get("runtime_unsupported") else "")
        lines.append(f"  {i:>2} {cand['strategy']:<10} {dims:<30} {cand['micro_batch']:>3}x{cand['microbatches']:<3} "
                     f"{cand['activation_checkpointing']:<9} {mem.get('total', math.nan):>7.2f} {parts} {step:>8} {pm:>4} "
                     f"{_short(t.get('compute')):>7} {times} {tps:>9} {mfu:>6}  {fits}")
    lines.append("  memory: params / grads / optimizer / activations / other at the peak; time: compute, then the "
                 "exposed TP, CP, DP and pipeline communication and the bubble, in seconds per step")
    lines += format_error_bars(doc["candidates"])
    rules = dict.fromkeys(c["runtime_unsupported"] for c in doc["candidates"] if c.get("runtime_unsupported"))
    lines += [f"  runtime_unsupported: priced, but paratrain's runtime refuses it: {r}" for r in rules]
    if doc["candidates"]:
        first = doc["candidates"][0]
        lines.append("  why #0:" if doc["fits"] else "  closest (#0):")
        if first["step_time_s"]:
            lines.append(f"    - step {first['step_time_s']:.3g} s ({describe(first.get('error_bar'))})")
        lines += [f"    - {r}" for r in first["reasons"]]
        if first.get("per_device"):
            lines += format_devices(first)
        if first.get("runtime_unsupported"):
            lines.append(f"  would run as (paratrain's runtime refuses it today): {first['command']}")
        else:
            lines.append(f"  run it: {first['command']}")
    return "\n".join(lines) + "\n"


def active_note(model: dict) -> str:
    """'30.5 B' for a dense model; '30.5 B total, 3.35 B active' for a Mixture of Experts."""
    total = readable_count(model["params"])
    active = model.get("active_params", model["params"])
    return total if active == model["params"] else f"{total} total, {readable_count(active)} active"
