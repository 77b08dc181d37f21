"""The GPU suite's results: what each row's child left behind, read into numbers; the planner's prediction for
the same layout (plan/predict.py, as bench and doctor show it); results.json and table.md, rewritten after
every row so a cut-off run still leaves them."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from gpu_suite_rows import Row


def steady_train(metrics: Path, warmup: int) -> dict:
    """Step time, tokens/s and MFU over the steps after `warmup` (compilation and CUDA graph recording happen
    there), from the run's metrics.jsonl: one record per step."""
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steady = [r for r in recs if r["step"] > warmup] or recs[-1:]
    times = [r["step_time_s"] for r in steady]
    mean = sum(times) / len(times)
    tokens = steady[0]["tokens_per_s"] * steady[0]["step_time_s"]  # tokens per step
    mfus = [r["mfu"] for r in steady]
    # MFU of the mean step: flops per step over mean time over peak, i.e. mean(mfu_i * dt_i) / mean(dt_i)
    mfu = (sum(m * t for m, t in zip(mfus, times)) / len(times) / mean) if None not in mfus else None
    return {"step_time_s": mean, "step_time_median_s": statistics.median(times), "tokens_per_s": tokens / mean,
            "mfu": mfu, "measured_steps": len(times), "peak_mem_gib": max(r["mem_peak_gib"] or 0 for r in recs),
            "final_loss": recs[-1]["loss"]}


def read_row(row: Row, row_dir: Path, stdout: str) -> dict:
    """The numbers of one finished row (raises on a child that printed nothing usable)."""
    doc = json.loads(stdout) if stdout.strip() else {}
    if row.kind == "train":
        return {**steady_train(row_dir / "run" / "metrics.jsonl", row.warmup), "layout": doc.get("layout"),
                "summary_tokens_per_s": doc.get("tokens_per_s")}
    if row.kind == "plain":
        return {k: doc[k] for k in ("step_time_s", "tokens_per_s", "mfu", "peak_mem_gib", "final_loss")}
    if row.kind == "verify":
        keys = ("passed", "dtype", "max_loss_abs_diff", "max_grad_rel_diff", "max_param_abs_diff", "tolerance")
        return {k: doc.get(k) for k in keys}
    if row.kind == "doctor":
        trace = row_dir / "trace.json"
        return {"breakdown": doc.get("breakdown"), "step_time_s": doc.get("step_time_s"),
                "findings": [f.get("cause") for f in doc.get("findings", [])],
                "predicted": doc.get("predicted"), "peak_mem_gib": doc.get("peak_mem_gib"),
                "trace": gzip_file(trace) if trace.exists() else None}
    if row.kind == "inference":  # benchmarks/inference.py: per batch, paratrain's tokens/s over transformers'
        return {"rows": doc["rows"], "prompt_len": doc["prompt_len"], "new_tokens": doc["new_tokens"]}
    if row.kind == "calibrate":
        return {"hardware_profile": doc.get("hardware_profile"), "gpu": (doc.get("gpu") or {}).get("name"),
                "dtype_tflops": doc.get("dtype_tflops"), "compute_scale": doc.get("compute_scale"),
                "overhead_scale": doc.get("overhead_scale"), "notes": doc.get("notes"),
                "source": doc.get("source")}
    raise ValueError(row.kind)


def gzip_file(path: Path) -> str:
    """Traces are large and compress ~10x; Perfetto opens .json.gz."""
    import gzip
    import shutil

    out = path.with_suffix(path.suffix + ".gz")
    with path.open("rb") as src, gzip.open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return out.name


def predict(row: Row, layout: dict | None, device: str, profile: Path | None) -> dict | None:
    """The planner's step time and memory for exactly the layout the row ran, on `profile` (None: the catalog
    entry of this device, or the CPU placeholder): plan/predict.py, as bench and doctor call it."""
    from paratrain.config import load_config
    from paratrain.models.presets import model_args_for
    from paratrain.parallel.layout import Layout
    from paratrain.parallel.strategies import resolve_layout
    from paratrain.plan.predict import predict_layout

    cfg = load_config(None, {"model": row.model, "strategy": "single", "nproc": 1, "device": device,
                             "dtype": row.dtype, "compile": row.compile, "seq_len": row.seq_len,
                             "global_batch": row.micro_batch, **dict(row.shape)})
    lay = Layout.from_dict(layout) if layout else resolve_layout(cfg, 1)
    saved = os.environ.get("PARATRAIN_HARDWARE")
    # auto_hardware reads this variable first; a path that does not exist selects the catalog
    os.environ["PARATRAIN_HARDWARE"] = str(profile) if profile else os.devnull + ".no-profile"
    try:
        return predict_layout(lay, model_args_for(cfg), cfg.seq_len, device)
    finally:
        if saved is None:
            os.environ.pop("PARATRAIN_HARDWARE", None)
        else:
            os.environ["PARATRAIN_HARDWARE"] = saved


def add_predictions(entry: dict, row: Row, device: str, profile: Path | None) -> None:
    """predicted_catalog / predicted_calibrated: {"step_time_s", "mem_gib", "hardware", "ratio"} (ratio:
    predicted over measured step time) for the train and plain rows that measured a step."""
    if row.kind not in ("train", "plain") or "step_time_s" not in entry.get("result", {}):
        return
    measured = entry["result"]["step_time_s"]
    for key, prof in (("predicted_catalog", None), ("predicted_calibrated", profile)):
        if prof is None and key == "predicted_calibrated":
            entry.pop(key, None)
            continue
        p = predict(row, entry["result"].get("layout"), device, prof)
        entry[key] = p and {"step_time_s": p["step_time_s"], "mem_gib": p["mem_gib"], "hardware": p["hardware"],
                            "ratio": p["step_time_s"] / measured}


def write_outputs(out: Path, doc: dict) -> None:
    """results.json and table.md, each written whole then renamed: a kill never leaves half a file."""
    texts = {"results.json": json.dumps(doc, indent=1, default=str) + "\n", "table.md": markdown(doc)}
    for name, text in texts.items():
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


def _f(v, scale=1.0, spec=".1f") -> str:
    return "-" if v is None else format(v * scale, spec)


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def bf16_equivalent_mfu(mfu: float | None, dtype: str, peaks: dict | None) -> float | None:
    """A row's MFU against the bf16 peak: paratrain divides an fp8 run's FLOP/s by the fp8 peak (twice the bf16
    one on Hopper), so only this figure compares an fp8 row with a bf16 one. Other dtypes: their own MFU."""
    if mfu is None or dtype != "fp8":
        return mfu
    if not peaks or not peaks.get("fp8") or not peaks.get("bf16"):
        return None
    return mfu * peaks["fp8"] / peaks["bf16"]


def _speedup(r: dict, base: dict) -> float | None:
    """tokens/s over the baseline row's (the same call's)."""
    return r["tokens_per_s"] / base["tokens_per_s"] if base.get("tokens_per_s") else None


def markdown(doc: dict) -> str:
    rows = {e["id"]: e for e in doc["rows"]}
    s = doc["suite"]
    lines = [f"# GPU suite: {s['device']} ({s['state']})", "",
             f"torch {s['torch']}, torchao {s['torchao'] or 'absent'}, paratrain {s['paratrain']}; "
             f"{'DRY RUN on CPU (tiny models: the numbers mean nothing); ' if s['dry_run'] else ''}"
             f"{s['elapsed_s']:.0f} s of a {s['budget_s']:.0f} s budget; prewarm {s.get('prewarm') or '-'}", "",
             "| run | dtype | mode | flags | mb x seq | tokens/s | ms/step | MFU | MFU vs bf16 peak | "
             "tokens/s vs baseline | peak GiB | plain tokens/s | plain MFU | paratrain / plain | pred. ms (catalog) "
             "| pred. ms (calibrated) | calibrated pred. / measured |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in doc["rows"]:
        if e["kind"] != "train" or "result" not in e:
            continue
        r, plain = e["result"], rows.get(e.get("pair") or "", {}).get("result") or {}
        base = rows.get(e.get("baseline") or "", {}).get("result") or {}
        cat, cal = e.get("predicted_catalog") or {}, e.get("predicted_calibrated") or {}
        ratio = r["tokens_per_s"] / plain["tokens_per_s"] if plain.get("tokens_per_s") else None
        mfu = f"{_pct(r['mfu'])} (fp8 peak)" if e["dtype"] == "fp8" and r["mfu"] is not None else _pct(r["mfu"])
        lines.append(f"| {e['model']} | {e['dtype']} | {e['mode']} | {' '.join(e.get('flags') or []) or '-'} "
                     f"| {e['micro_batch']} x {e.get('seq_len', '?')} "
                     f"| {_f(r['tokens_per_s'], 1, ',.0f')} | {_f(r['step_time_s'], 1e3)} | {mfu} "
                     f"| {_pct(bf16_equivalent_mfu(r['mfu'], e['dtype'], s.get('peak_tflops')))} "
                     f"| {_f(_speedup(r, base), 1, '.3f')} "
                     f"| {_f(r['peak_mem_gib'], 1, '.2f')} | {_f(plain.get('tokens_per_s'), 1, ',.0f')} "
                     f"| {_pct(plain.get('mfu'))} | {_f(ratio, 1, '.3f')} "
                     f"| {_f(cat.get('step_time_s'), 1e3)} | {_f(cal.get('step_time_s'), 1e3)} "
                     f"| {_f(cal.get('ratio'), 1, '.2f')} |")
    lines += ["", "| check | result |", "|---|---|"]
    for e in doc["rows"]:
        r = e.get("result")
        if r is None:
            continue
        if e["kind"] == "verify":
            lines.append(f"| {e['id']} | {'PASSED' if r['passed'] else 'FAILED'}: "
                         f"loss {_f(r['max_loss_abs_diff'], 1, '.1e')}, "
                         f"grad rel {_f(r['max_grad_rel_diff'], 1, '.1e')}, "
                         f"param {_f(r['max_param_abs_diff'], 1, '.1e')} |")
        elif e["kind"] == "calibrate":
            tf = ", ".join(f"{k} {v:.3g}" for k, v in (r.get("dtype_tflops") or {}).items())
            notes = "; ".join(r.get("notes") or [])
            lines.append(f"| calibration ({r.get('gpu')}) | matmul TFLOP/s: {tf}; {notes} |")
        elif e["kind"] == "inference":
            ratios = ", ".join(f"batch {b['batch']}: {b['paratrain_tokens_per_s']:,.0f} / "
                               f"{b['transformers_tokens_per_s']:,.0f} tokens/s = {b['ratio']:.2f}x" for b in r["rows"])
            lines.append(f"| {e['id']} | paratrain / transformers generate (greedy, KV cache): {ratios} |")
        elif e["kind"] == "doctor":
            b = ", ".join(f"{k} {v:.0%}" for k, v in (r.get("breakdown") or {}).items())
            lines.append(f"| {e['id']} | {_f(r.get('step_time_s'), 1e3)} ms/step; {b}; findings: "
                         f"{', '.join(r.get('findings') or []) or 'none'}; trace {r.get('trace')} |")
    failed = [e for e in doc["rows"] if e.get("error")]
    skipped = [e for e in doc["rows"] if e.get("skipped")]
    if failed:
        lines += ["", "Failed:"] + [f"- {e['id']}: {e['error']}" for e in failed]
    if skipped:
        lines += ["", "Skipped:"] + [f"- {e['id']}: {e['skipped']}" for e in skipped]
    return "\n".join(lines) + "\n"


def last_line(path: Path) -> str:
    try:
        return last_line_of(path.read_text(errors="replace"))
    except OSError:
        return "(no log)"


def last_line_of(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def summary(e: dict) -> str:
    r = e.get("result")
    if r is None:
        return e.get("skipped") or e.get("error") or "?"
    if "tokens_per_s" in r:
        mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ""
        pred = e.get("predicted_calibrated") or e.get("predicted_catalog")
        p = f", predicted {pred['step_time_s'] * 1e3:.1f} ms ({pred['hardware']})" if pred else ""
        return f"{r['tokens_per_s']:,.0f} tokens/s, {r['step_time_s'] * 1e3:.1f} ms/step{mfu}{p}"
    if "passed" in r:
        return "PASSED" if r["passed"] else "FAILED"
    if e["kind"] == "inference":
        return ", ".join(f"batch {b['batch']} paratrain / transformers {b['ratio']:.2f}x" for b in r["rows"])
    return "done"
