"""`paratrain bench --inference`: generation measured at 1 -> 2 -> 4 devices per layout, next to what
`plan --inference` predicts for exactly the layout that ran (plan/inference_cost.py).

Each world size runs in one process group (its layouts one after the other); one device runs once, the base of
every layout's efficiency. Each data-parallel replica generates --batch-size prompts of --prompt-len tokens
(drawn from --seed), --max-new-tokens each, after a short warm-up generation. Measured: tokens/s (every output
token over the slowest rank's loop), time to first token, time per output token, and peak memory per device: on
CPU the live-tensor bytes of a second, tracked generation (calibrate/generate_peak.py: what the planner
predicts), on CUDA the allocator's peak. A layout generate does not run is listed with the reason.
"""

from __future__ import annotations

import gc
import logging
import os

import torch

from paratrain.errors import CheckFailed, UserError

log = logging.getLogger("paratrain")
DEFAULT_PROMPT_LEN, DEFAULT_BATCH, WARMUP_TOKENS = 16, 8, 2


def cell_config(base, strategy: str, world: int):
    """The run config of one cell, checked as generate checks it; UserError names why it cannot run."""
    from paratrain.infer.generate_run import check_generate_layout
    from paratrain.train.validate import validate_run

    cfg = base.model_copy(update={"strategy": strategy, "nproc": world, "resume": "never", "ckpt_every": 0,
                                  "metrics": False, "out": None})
    check_generate_layout(cfg)
    return cfg, validate_run(cfg, world)


def bench_prompts(cfg, count: int, length: int) -> list:
    """`count` token-id prompts of `length` tokens, drawn from cfg's seed over the model's vocabulary."""
    from paratrain.infer.prompts import Prompt
    from paratrain.models.presets import model_args_for

    gen = torch.Generator().manual_seed(cfg.seed)
    vocab = model_args_for(cfg).vocab_size
    return [Prompt(i, tuple(torch.randint(vocab, (length,), generator=gen).tolist())) for i in range(count)]


def measure_inference_cells(cfg_dicts: list[dict], shape: dict, threads: int) -> list[dict] | None:
    """Every cell on every rank of one group; rank 0 returns their measurements."""
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.worker import setup_logging

    cfgs = [TrainConfig(**d) for d in cfg_dicts]
    setup_logging(int(os.environ.get("RANK", "0")))
    torch.set_num_threads(threads)
    rt = init_runtime(cfgs[0].device, cfgs[0].timeout_s)
    results = []
    try:
        for cfg in cfgs:
            results.append(measure_inference_cell(cfg, rt, shape))
            gc.collect()
    finally:
        shutdown()
    return results if rt.is_main else None


def measure_inference_cell(cfg, rt, shape: dict) -> dict | None:
    from paratrain.calibrate.generate_peak import generate_peak_bytes
    from paratrain.infer.generate import GenerateOptions
    from paratrain.infer.generate_run import gather_runs, generate_rank
    from paratrain.infer.source_loader import load_for_inference

    loaded = load_for_inference(cfg, rt)
    layout = loaded.layout
    prompts = [p.to_dict() for p in bench_prompts(cfg, shape["batch"] * layout.dp, shape["prompt_len"])]
    options = GenerateOptions(shape["new_tokens"], batch_size=shape["batch"])
    generate_rank(loaded, prompts, GenerateOptions(WARMUP_TOKENS, batch_size=shape["batch"]))  # warm-up
    cuda = rt.device_type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    timed = generate_rank(loaded, prompts, options)
    peak = torch.cuda.max_memory_allocated() if cuda else \
        generate_peak_bytes(loaded.model_parts, lambda: generate_rank(loaded, prompts, options))
    peaks = gather_runs((None, peak), layout, rt.is_main)
    loaded = None  # the model and its groups go before the next cell's
    if timed is None:
        return None
    return {**{k: timed[k] for k in ("tokens_per_s", "ttft_s", "tpot_s", "kv_cache")},
            "tokens": sum(len(o["tokens"]) for o in timed["outputs"]), "layout": timed["layout"],
            "peak_bytes": [p for _, p in peaks], "peak_rss_gib": timed["peak_mem_gib"]}


def run_group(cfgs: list, world: int, shape: dict) -> list[dict]:
    from paratrain.bench.scaling import run_fresh_group, threads_per_rank

    out = run_fresh_group(measure_inference_cells, ([c.model_dump() for c in cfgs], shape, threads_per_rank(world)),
                          world, cfgs[0].timeout_s, "bench --inference")
    if out is None:
        raise CheckFailed(f"bench --inference on {world} process(es): rank 0 returned nothing")
    return out


def predict_cell(cfg, layout_fields: dict, shape: dict) -> dict:
    """What plan --inference predicts for the layout that ran, on this machine's profile."""
    from paratrain.models.hf_files import is_hf_model
    from paratrain.models.presets import count_params, model_args_for
    from paratrain.parallel.layout import Layout
    from paratrain.plan.auto import auto_hardware
    from paratrain.plan.inference_cost import InferenceShape, price, roles_of
    from paratrain.plan.plan_cli import resolve_model

    profile, where = auto_hardware(cfg.device)
    args = model_args_for(cfg)
    # a transformers model's own count (plan's), a preset's from its shape
    params = resolve_model(cfg.model, None)[2].params if is_hf_model(cfg.model) else count_params(args)
    layout = Layout.from_dict(layout_fields)
    p = price(profile, args, params, layout, InferenceShape(shape["prompt_len"], shape["new_tokens"], shape["batch"]),
              cfg.dtype)
    new = shape["new_tokens"]
    tokens = shape["batch"] * roles_of(layout)["replicas"] * new
    return {"predicted_tokens_per_s": tokens / (p.ttft_s + (new - 1) * p.decode_step_s),
            "predicted_tpot_s": p.decode_step_s, "predicted_ttft_s": p.ttft_s,
            "predicted_mem_gib": p.memory_bytes / 2**30, "predicted_bound": p.bound, "hardware": where}


def summarize(strategy: str, world: int, cfg, raw: dict, shape: dict) -> dict:
    from paratrain.parallel.layout import DEGREE_NAMES

    predicted = predict_cell(cfg, raw["layout"], shape)
    # step_time_s / predicted_step_time_s / comm_bytes_per_step: bench --json's contract (DESIGN.md), a decode step
    return {"strategy": strategy, "world_size": world, "tokens_per_s": raw["tokens_per_s"],
            "tpot_s": raw["tpot_s"], "ttft_s": raw["ttft_s"], "scaling_efficiency": None,
            "step_time_s": raw["tpot_s"], "predicted_step_time_s": predicted["predicted_tpot_s"],
            "comm_bytes_per_step": None,
            "peak_mem_gib": max(raw["peak_bytes"]) / 2**30, "peak_rss_gib": raw["peak_rss_gib"],
            "tokens": raw["tokens"], "kv_cache": raw["kv_cache"],
            "dims": {n: raw["layout"][n] for n in DEGREE_NAMES}, "layout": raw["layout"], **predicted}


def add_inference_efficiency(runs: list[dict]) -> None:
    """tokens/s(N) / (N x tokens/s of one device); the one-device row is every layout's base."""
    base = next((r for r in runs if r["world_size"] == 1 and r.get("tokens_per_s")), None)
    for r in runs:
        if base is None or not r.get("tokens_per_s"):
            continue
        r["ideal_tokens_per_s"] = base["tokens_per_s"] * r["world_size"]
        r["scaling_efficiency"] = r["tokens_per_s"] / r["ideal_tokens_per_s"]


def run_inference_bench(base, strategies: list[str], worlds: list[int], prompt_len: int | None, new_tokens: int,
                        batch: int | None) -> dict:
    from paratrain.train.runtime import in_launched_process, pick_device_type

    if in_launched_process():
        raise UserError("bench starts its own process groups; run it directly, not under torchrun/srun")
    shape = {"prompt_len": prompt_len or DEFAULT_PROMPT_LEN, "new_tokens": new_tokens,
             "batch": batch or DEFAULT_BATCH}
    for flag, value in (("--prompt-len", shape["prompt_len"]), ("--max-new-tokens", new_tokens),
                        ("--batch-size", shape["batch"])):
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    runs = []
    for world in sorted(set(worlds)):
        cells, refused = [], []
        for strategy in (["single"] if world == 1 else strategies):
            try:
                cells.append((strategy, cell_config(base, strategy, world)[0]))
            except UserError as exc:
                refused.append({"strategy": strategy, "world_size": world, "refused": str(exc)})
        if cells:
            log.info("bench --inference: %s on %d process(es), batch %d per replica, prompt %d + %d new tokens",
                     ", ".join(s for s, _ in cells), world, shape["batch"], shape["prompt_len"], new_tokens)
            for (strategy, cfg), raw in zip(cells, run_group([c for _, c in cells], world, shape)):
                runs.append(summarize(strategy, world, cfg, raw, shape))
        runs += refused
    add_inference_efficiency(runs)
    on_cpu = pick_device_type(base.device) == "cpu"
    hardware = next((r["hardware"] for r in runs if r.get("hardware")), None)
    return {"mode": "inference", "runs": runs, "plot": None, "model": base.model, "dtype": base.dtype,
            "prompt_len": shape["prompt_len"], "max_new_tokens": new_tokens, "batch_per_replica": shape["batch"],
            "prediction_hardware": hardware,
            "prediction_calibrated": None if hardware is None else "placeholder" not in hardware,
            "memory_measure": ("peak live tensor bytes per device (calibrate/generate_peak.py), as plan "
                               "--inference predicts them" if on_cpu else "allocator peak")}


def inference_table(doc: dict) -> str:
    """The markdown table (stderr): measured next to predicted, refused layouts with their reason."""
    head = ("| layout | N | tokens/s | pred. tokens/s | efficiency | ms/token | pred. ms/token | TTFT ms "
            "| pred. TTFT ms | peak MiB | pred. MiB |\n|---|---|---|---|---|---|---|---|---|---|---|\n")

    def fmt(v, scale=1.0, spec=".1f"):
        return "-" if v is None else format(v * scale, spec)

    rows = []
    for r in doc["runs"]:
        if "refused" in r:
            rows.append(f"| {r['strategy']} | {r['world_size']} | refused: {r['refused']} |" + " |" * 8)
            continue
        rows.append(f"| {r['strategy']} | {r['world_size']} | {fmt(r['tokens_per_s'], 1, '.0f')} "
                    f"| {fmt(r['predicted_tokens_per_s'], 1, '.0f')} | {fmt(r['scaling_efficiency'], 100, '.0f')}% "
                    f"| {fmt(r['tpot_s'], 1e3, '.2f')} | {fmt(r['predicted_tpot_s'], 1e3, '.2f')} "
                    f"| {fmt(r['ttft_s'], 1e3, '.2f')} | {fmt(r['predicted_ttft_s'], 1e3, '.2f')} "
                    f"| {fmt(r['peak_mem_gib'], 1024, '.2f')} | {fmt(r['predicted_mem_gib'], 1024, '.2f')} |")
    notes = [f"peak MiB: {doc['memory_measure']}"]
    if doc.get("prediction_calibrated") is False:
        notes.append(f"predictions: {doc['prediction_hardware']} -- `paratrain plan --calibrate` measures this machine")
    return head + "\n".join(rows) + "\n" + "".join(f"{n}\n" for n in notes)
