"""`paratrain plan --inference`: every tp x pp x dp layout of --gpus priced for generation (inference_cost.py),
fastest per output token first among those that fit; the document and its human table. The model and the hardware
are read as plan reads them (plan_cli.py); docs/inference.md holds the JSON schema."""

from __future__ import annotations

from paratrain.errors import UserError
from paratrain.plan.inference_cost import InferenceShape, layout_problem, layouts_for, price

DEFAULT_PROMPT_LEN = 128


def inference_shape(request, prompt_len: int | None, new_tokens: int, batch: int | None, max_positions: int):
    """The request's shape, checked: the prompt (default: --seq-len, else 128) plus the new tokens must fit the
    model's positions."""
    prompt = prompt_len or request.seq_len or DEFAULT_PROMPT_LEN
    for flag, value in (("--prompt-len", prompt), ("--max-new-tokens", new_tokens)):
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if batch is not None and batch < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch}")
    if prompt + new_tokens > max_positions:
        raise UserError(f"--prompt-len {prompt} plus --max-new-tokens {new_tokens} exceeds the model's "
                        f"{max_positions} positions")
    return InferenceShape(prompt, new_tokens, batch)


def inference_document(request, prompt_len: int | None, new_tokens: int, batch: int | None) -> dict:
    """The plan --inference document for a PlanRequest (model, hardware, --gpus, --dtype, fixed degrees)."""
    from paratrain.models.presets import count_params
    from paratrain.plan.plan_cli import resolve_hardware, resolve_model

    if request.cluster or (request.gpu and "," in request.gpu):
        raise UserError("plan --inference prices one device type: give --gpu NAME, not a cluster")
    if request.gpus is None or request.gpus < 1:
        raise UserError("--gpus N (>= 1) is required")
    args, name, counts = resolve_model(request.model, request.hf_config)
    dtype = request.dtype or "bf16"
    if dtype == "fp8":
        raise UserError("plan --inference prices bf16, fp16 or fp32 generation; fp8 is a training scheme here")
    hw = resolve_hardware(request, dtype)
    shape = inference_shape(request, prompt_len, new_tokens, batch, args.max_seq_len)
    params = counts.params if counts is not None else count_params(args)
    fixed = {k: v for k, v in request.degrees.items() if v is not None}
    rows = []
    for layout in layouts_for(request.gpus, fixed):
        problem = layout_problem(args, layout)
        if problem:
            rows.append({"dims": layout.degrees(), "label": layout.describe(), "feasible": False, "reasons": [problem]})
            continue
        rows.append(price(hw, args, params, layout, shape, dtype).to_dict())
    if not rows:
        raise UserError(f"no layout of {request.gpus} device(s) has the fixed degrees (plan --inference splits heads, "
                        "stages and replicas: --tp, --pp, --dp-replicate)")
    rows.sort(key=lambda r: (not r["feasible"], -(r.get("tokens_per_s") or 0.0)))
    return {"mode": "inference", "model": {"name": name, "params": params, "layers": args.n_layers,
                                           "kv_heads": args.kv_heads, "head_dim": args.head_dim},
            "cluster": {"gpu": hw.gpu.name, "gpus": request.gpus, "mem_gib": hw.gpu.mem_gib,
                        "mem_bw_gbs": hw.mem_bw_gbs, "profile": hw.source},
            "job": {"prompt_len": shape.prompt_len, "max_new_tokens": shape.new_tokens, "batch_size": shape.batch,
                    "dtype": dtype, "weight_bytes_per_param": 4},
            "recommended": 0 if rows[0]["feasible"] else None, "layouts": rows}


def _gib(v) -> str:
    return "-" if v is None else f"{v / 2**30:.3g}"


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.3g}"


def format_inference_plan(doc: dict) -> str:
    """The human view (stderr): one line per layout."""
    job, c = doc["job"], doc["cluster"]
    lines = [f"plan --inference: {doc['model']['name']} ({doc['model']['params']:,} params) on {c['gpus']} x "
             f"{c['gpu']}, prompt {job['prompt_len']} + {job['max_new_tokens']} new tokens, {job['dtype']} "
             f"(weights fp32, as generate holds them)",
             f"  hardware: {c['profile']}",
             f"  {'#':>2} {'layout':<16} {'weights GiB':>11} {'KV MiB/seq':>10} {'max batch':>9} {'batch':>5} "
             f"{'mem GiB':>8} {'step ms':>8} {'bound':<7} {'comm ms':>8} {'TTFT ms':>8} {'tokens/s':>9}  fits"]
    for i, r in enumerate(doc["layouts"]):
        if "weights_bytes" not in r:
            lines.append(f"  {i:>2} {r['label']:<16} {'':>11} {'':>10} {'':>9} {'':>5} {'':>8} {'':>8} "
                         f"{'':<7} {'':>8} {'':>8} {'':>9}  no: {r['reasons'][0]}")
            continue
        fits = "yes" if r["feasible"] else f"no: {r['reasons'][0]}"
        lines.append(f"  {i:>2} {r['label']:<16} {_gib(r['weights_bytes']):>11} "
                     f"{r['kv_cache_bytes_per_seq'] / 2**20:>10.3g} {r['max_batch']:>9} {r['batch']:>5} "
                     f"{_gib(r['memory_bytes']):>8} {_ms(r['decode_step_s']):>8} {r['bound']:<7} "
                     f"{_ms(r['comm_s_per_token']):>8} {_ms(r['ttft_s']):>8} {r['tokens_per_s']:>9.4g}  {fits}")
    lines.append("  step: one output token of a row (memory, compute or host bound, plus the communication); "
                 "batch: sequences per data-parallel replica (--batch-size, else the largest that fits)")
    return "\n".join(lines) + "\n"
