"""The planner against published, measured training runs of large models.

    python benchmarks/planner_published.py [--cases ID,ID] [--json] [--write-error-bars]

Each case of benchmarks/published_runs.json (source, model shape, GPU type and count, layout, batch, precision,
recompute, compile) is predicted by `paratrain plan --json` itself, asked as a user asks it (plan_flags: the
model as the config.json a user hands --hf-config, every choice of the layout fixed, in process through the CLI's
own parsing: cli.main), on the catalog entry of its GPU type (datasheet peaks times the documented efficiencies;
nothing is tuned per case). Printed: predicted vs published step time (and tokens/s/GPU) and peak memory where
published, the error of each and the mean absolute error.

A case whose published scheme paratrain's runtime cannot run (`runtime_unsupported`: why) is still priced as
published, and marked `*`: a check of the cost model, not a plannable layout. Such schemes are `plan` flags the
time model prices for any layout: --dist-optimizer (ZeRO-1 as Megatron's distributed optimizer, overlapped),
--async-tp (TP collectives under the matmuls; with --compile), --half-weights (16-bit weights, fp32 masters and
gradients accumulated in the weight-gradient GEMMs, as Megatron runs), --moe-routing and a board's --mem-bw-gbs.
`framework` names the software the run used: memory errors are also printed per framework, since only
torchtitan holds memory as paratrain's runtime does.

A case whose source does not give the micro-batch (`micro_batch: null`) is predicted at the planner's own
choice for the fixed layout, as `paratrain plan` answers when the micro-batch is left open: every valid micro-batch
is priced and the fastest is kept (the same rule for every such case; the others are printed with it). Memory does
not filter that choice: the memory model prices paratrain's runtime, which is not what those runs used (see the
memory error per framework), and a published run fitted its GPUs by construction.

Error bars (plan/error_bars.py): each case belongs to a layout family (FSDP, DDP/ZeRO-1, tensor-parallel,
pipeline, ...). Printed per case: its error against the mean |error| of the other cases of its family (leave-one-out,
`bar`; a family with fewer than 3 other cases is pooled), and per family the bar `paratrain plan` shows.
`--write-error-bars` writes those bars to src/paratrain/plan/error_bars.json with a hash of this file's inputs
(the case list and the cost-model sources): tests/plan/test_error_bars.py fails when they change and the file
was not rewritten. `plan` column: what `paratrain plan` answered with every choice of the case fixed, at the row's
micro-batch (`ok`: a runnable candidate that fits; `unsupported`: it fits, priced and marked runtime_unsupported;
`over memory`: priced, it does not fit); --json's rows also hold the flags (`plan_flags`).

Mixture-of-Experts runs (a case whose model names "moe"; its layout may give "ep") are summed up apart from the dense
ones, and their layouts form their own error-bar family (expert-parallel). A case's `moe_routing` names the
routing its source ran where it was not a trained router (costs/expert_spread.py): NeMo AutoModel's
benchmark gate gives token t the k consecutive experts from t*k ("consecutive"), which reach one or two ranks,
and so sets the rows --ep's exchange sends per token. A published MoE run whose layout paratrain
cannot express (published_runs.json `not_expressible`: the reason, and the nearest layout paratrain runs) is
predicted on that nearest layout and printed last, in no mean and no bar.

A published TFLOP/s per GPU is turned into a step time with the source's own FLOP count per iteration:
  megatron:      72 B s L h^2 (1 + s/(6h) + V/(12 L h))   (Megatron-LM `num_floating_point_operations`)
  megatron-recompute: 96 B s L h^2 (1 + s/(6h) + V/(16 L h))  (Narayanan et al. 2021, with recomputation)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

RUNS = Path(__file__).with_name("published_runs.json")


def flops_per_iteration(formula: str, model: dict, batch: int) -> float:
    s, L, h, V = model["seq_len"], model["layers"], model["dim"], model["vocab_size"]
    if formula == "megatron":
        return 72 * batch * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    if formula == "megatron-recompute":
        return 96 * batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    raise ValueError(f"unknown flops_formula {formula!r}")


def published_step_time(case: dict) -> float:
    pub = case["published"]
    if "step_time_s" in pub:
        return pub["step_time_s"]
    if "tokens_per_s_per_gpu" in pub:
        # tokens per GPU per step: the global batch's tokens over all GPUs (torchtitan counts a data-parallel
        # rank's tokens over its tp x pp x cp GPUs, the same figure)
        return case["global_batch"] * case["model"]["seq_len"] / (pub["tokens_per_s_per_gpu"] * case["gpus"])
    flops = flops_per_iteration(pub["flops_formula"], case["model"], case["global_batch"])
    return flops / (pub["tflops_per_gpu"] * 1e12 * case["gpus"])


# the strategy name that fixes a data-parallel layout's ZeRO stage in `plan` (parallel/strategies.py)
STRATEGY_OF_ZERO_STAGE = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


def hf_config(case: dict) -> dict:
    """The config.json a user hands `plan --hf-config` for the case's model: the case's own (`hf_config`: the
    model's published config, e.g. an MoE's), else written from its shape (a GPT or a Llama)."""
    if case.get("hf_config"):
        return {**case["hf_config"], "max_position_embeddings": max(case["hf_config"].get("max_position_embeddings", 0),
                                                                    case["model"]["seq_len"])}
    m = case["model"]
    if m["family"] == "gpt2":
        return {"model_type": "gpt2", "n_layer": m["layers"], "n_embd": m["dim"], "n_head": m["heads"],
                "n_inner": m["ffn_dim"], "vocab_size": m["vocab_size"], "n_positions": m["seq_len"],
                "tie_word_embeddings": m.get("tie_embeddings", False)}
    if m["family"] != "llama" or m.get("moe"):
        raise ValueError(f"{case['id']}: give the model's config.json as `hf_config`")
    doc = {"model_type": "llama", "hidden_size": m["dim"], "intermediate_size": m["ffn_dim"],
           "num_hidden_layers": m["layers"], "num_attention_heads": m["heads"],
           "num_key_value_heads": m.get("kv_heads") or m["heads"], "vocab_size": m["vocab_size"],
           "max_position_embeddings": m["seq_len"], "tie_word_embeddings": m.get("tie_embeddings", False)}
    return {**doc, "head_dim": m["head_dim"]} if m.get("head_dim") else doc


def config_path(case: dict) -> Path:
    """The case's config.json, written where every run finds it again (the planner's traces are cached by shape)."""
    path = Path(tempfile.gettempdir()) / "paratrain-published-runs" / case["id"] / "config.json"
    text = json.dumps(hf_config(case), indent=1, sort_keys=True) + "\n"
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


def plan_flags(case: dict, micro_batch: int | None = None) -> list[str]:
    """`paratrain plan` as a user asks it for the case: its model, GPUs, batch, precision and every choice of its
    layout fixed (the micro-batch given here where the case leaves it open), its priced schemes as flags."""
    lay = case["layout"]
    flags = ["--hf-config", str(config_path(case)), "--gpu", case["gpu"], "--gpus", str(case["gpus"]),
             "--seq-len", str(case["model"]["seq_len"]), "--global-batch", str(case["global_batch"]),
             "--dtype", case.get("planner_precision", case["precision"]), "--ac", case["recompute"]]
    for dim in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"):
        flags += [f"--{dim.replace('_', '-')}", str(lay.get(dim, 1))]
    if lay["dp_replicate"] * lay["dp_shard"] > 1:
        flags += ["--strategy", STRATEGY_OF_ZERO_STAGE[lay["zero_stage"]]]
    flags.append("--sp" if lay["sp"] else "--no-sp")
    if lay["pp"] > 1:
        flags += ["--pp-schedule", lay["pp_schedule"], "--virtual-stages", str(lay["virtual_stages"])]
    mb = case["micro_batch"] or micro_batch
    flags += ["--micro-batch", str(mb)] if mb else []
    flags += ["--compile"] if case.get("compile") else []
    flags += ["--dist-optimizer"] if case.get("dist_optimizer") else []
    flags += ["--async-tp"] if case.get("async_tp") else []
    flags += ["--half-weights"] if case.get("half_weights") else []
    flags += ["--moe-routing", case["moe_routing"]] if case.get("moe_routing") else []
    # a board variant the source describes (torchtitan's 96 GB HBM2e H100s): its stated memory size and bandwidth
    flags += ["--mem-gib", str(case["gpu_mem_gib"])] if case.get("gpu_mem_gib") else []
    flags += ["--mem-bw-gbs", str(case["gpu_mem_bw_gbs"])] if case.get("gpu_mem_bw_gbs") else []
    return flags


def run_plan(flags: list[str]) -> dict:
    """`paratrain plan FLAGS --json` in this process (cli.main: the option parsing and the code path of the
    command); its JSON document. ValueError with plan's error line when it refuses."""
    from paratrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["plan", *flags, "--json"])
            code = 0
        except SystemExit as exc:
            code = exc.code
    logging.getLogger().handlers.clear()  # plan logged to the captured stream
    if code:
        lines = err.getvalue().strip().splitlines() or ["(no message)"]
        raise ValueError(f"paratrain plan {' '.join(flags)}: {lines[-1]}")
    return json.loads(out.getvalue())


def micro_batch_choices(case: dict) -> list[int]:
    """The published micro-batch, or (`micro_batch: null`, not in the source) every one the planner would try
    for the case's layout (search.micro_batch_options: divisors of the local batch; 1F1B keeps m >= pp)."""
    from paratrain.parallel.layout import Layout
    from paratrain.plan.search import Job, micro_batch_options

    if case["micro_batch"]:
        return [case["micro_batch"]]
    lay = {k: v for k, v in case["layout"].items() if k != "zero_stage"}
    job = Job(args=None, model_name=case["id"], gpus=case["gpus"], seq_len=case["model"]["seq_len"],
              global_batch=case["global_batch"])
    return micro_batch_options(job, Layout(**lay), {})


def plan_answer(doc: dict) -> str:
    """What `plan` answered for the case with every choice fixed: 'ok', 'unsupported' (priced and marked
    runtime_unsupported), 'over memory' (priced, does not fit) or 'none: why'."""
    if not doc["candidates"]:
        return "none: " + doc.get("message", "no layout")
    if doc["fits"]:
        return "ok"
    return "unsupported" if doc["candidates"][0]["feasible"] else "over memory"


def evaluate_case(case: dict) -> tuple[dict, dict, dict]:
    """(candidate, {micro-batch: step seconds}, plan's document) of `paratrain plan` with the case's flags: at the
    published micro-batch, or the planner's fastest where the source gives none."""
    priced = []
    for mb in micro_batch_choices(case):
        doc = run_plan(plan_flags(case, mb))
        if not doc["candidates"]:
            raise ValueError(f"{case['id']}: plan priced no layout: {doc.get('message')}")
        # a layout paratrain's runtime cannot run is priced all the same, and marked runtime_unsupported
        priced.append((doc["candidates"][0], doc))
    best, doc = min(priced, key=lambda c: c[0]["step_time_s"])
    return best, {c["micro_batch"]: c["step_time_s"] for c, _ in priced}, doc


def predict(case: dict) -> dict:
    t0 = time.perf_counter()
    cand, by_micro_batch, doc = evaluate_case(case)
    pub_step = published_step_time(case)
    step = cand["step_time_s"]
    tokens_per_gpu = case["global_batch"] * case["model"]["seq_len"] / case["gpus"]
    t = cand["time_breakdown_s"]
    row = {"id": case["id"] + ("*" if case.get("runtime_unsupported") else ""), "gpu": case["gpu"], "gpus": case["gpus"],
           "kind": case["kind"], "framework": case.get("framework", "?"), "family": cand["error_bar"]["layout_family"],
           "plan_answer": plan_answer(doc), "plan_flags": plan_flags(case, cand["micro_batch"]),
           "runtime_unsupported": cand["runtime_unsupported"],
           "predicted_step_s": step, "published_step_s": pub_step,
           "step_error": step / pub_step - 1,
           "predicted_tokens_per_s_per_gpu": tokens_per_gpu / step,
           "published_tokens_per_s_per_gpu": tokens_per_gpu / pub_step,
           "predicted_memory_gib": cand["memory_gib"]["total"], "fits": cand["feasible"],
           "micro_batch": cand["micro_batch"], "micro_batch_searched": not case["micro_batch"],
           "step_s_by_micro_batch": by_micro_batch,
           "breakdown_s": {"compute": t["compute"], "comm_exposed": t["communication_exposed"],
                           "bubble": t["bubble"], **({"ep_comm": t["ep_comm_s"]} if "ep_comm_s" in t else {})},
           "params": doc["model"]["params"], "moe": bool(case["model"].get("moe")),
           "seconds": time.perf_counter() - t0}
    mem = case["published"].get("memory_gib")
    if mem:
        row["published_memory_gib"] = mem
        row["memory_error"] = row["predicted_memory_gib"] / mem - 1
    return row


def memory_by_framework(rows: list[dict]) -> dict[str, float]:
    out: dict[str, list[float]] = {}
    for r in rows:
        if "memory_error" in r:
            out.setdefault(r["framework"], []).append(abs(r["memory_error"]))
    return {k: statistics.mean(v) for k, v in sorted(out.items())}


def mean_line(rows: list[dict], what: str, target: str) -> str:
    errors = [abs(r["step_error"]) for r in rows]
    return (f"{what}: mean |step error| {statistics.mean(errors):.1%} over {len(rows)} cases ({target}), "
            f"max {max(errors):.1%}, {sum(e <= 0.30 for e in errors)} within 30%\n")


def print_row(r: dict, out) -> None:
    mem = (f"{r['published_memory_gib']:>6.1f} {r['memory_error']:>+6.0%}" if "published_memory_gib" in r
           else f"{'-':>6} {'-':>6}")
    mb = f"{r['micro_batch']}{'~' if r['micro_batch_searched'] else ''}"
    out.write(f"{r['id']:<46} {r['gpu']:<9} {r['gpus']:>5} {r['kind']:<11} {mb:>3} {r['predicted_step_s']:>8.3g} "
              f"{r['published_step_s']:>8.3g} {r['step_error']:>+7.1%} {r['predicted_tokens_per_s_per_gpu']:>14.4g} "
              f"{r['published_tokens_per_s_per_gpu']:>8.4g} {r['predicted_memory_gib']:>8.1f} {mem}  {r['plan_answer']}\n")
    out.flush()


def print_not_expressible(cases: list[dict], out) -> list[dict]:
    """The published MoE runs paratrain cannot lay out as published: predicted on the nearest layout it runs."""
    rows = []
    if cases:
        out.write("published MoE runs whose layout paratrain cannot express (nearest layout; in no mean, no bar):\n")
    for case in cases:
        r = predict(case)
        r["not_expressible"] = case["not_expressible"]
        rows.append(r)
        print_row(r, out)
        b = r["breakdown_s"]
        out.write(f"    compute {b['compute']:.3g} s, exposed comm {b['comm_exposed']:.3g} s (all-to-all "
                  f"{b.get('ep_comm', 0):.3g} s): {case['not_expressible']}\n")
    return rows


def write_error_bars(rows: list[dict], out) -> dict:
    """Leave-one-out bars per case, the bars `plan` shows per family; written to plan/error_bars.json."""
    from paratrain.plan.error_bars import BARS_FILE, compute_bars, inputs_digest

    doc = compute_bars({r["id"].rstrip("*"): (r["family"], r["step_error"]) for r in rows})
    doc["inputs_sha256"] = inputs_digest(RUNS)
    doc["frozen_cases"] = json.loads(RUNS.read_text())["frozen_before_tuning"]["ids"]
    BARS_FILE.write_text(json.dumps(doc, indent=1) + "\n")
    out.write(f"wrote {BARS_FILE}\n")
    return doc


def print_bars(rows: list[dict], out) -> None:
    from paratrain.plan.error_bars import compute_bars

    doc = compute_bars({r["id"].rstrip("*"): (r["family"], r["step_error"]) for r in rows})
    out.write("leave-one-out: each case's |error| against its family's bar without it: "
              f"{doc['leave_one_out_within_bar']} within\n")
    for r in rows:
        c = doc["cases"][r["id"].rstrip("*")]
        bar = c["leave_one_out"]
        if bar["step_time_rel"] is None:
            out.write(f"  {r['id']:<46} {r['family']:<16} err {r['step_error']:>+7.1%}  no other {bar['family']} run\n")
            continue
        out.write(f"  {r['id']:<46} {r['family']:<16} err {r['step_error']:>+7.1%}  bar ±{bar['step_time_rel']:.1%} "
                  f"on {bar['cases']} other {bar['family']} runs  {'ok' if abs(r['step_error']) <= bar['step_time_rel'] else 'OUTSIDE'}\n")
    out.write("bars `paratrain plan` shows (mean |step error| of the family's runs):\n")
    for fam, bar in doc["families"].items():
        if bar["step_time_rel"] is None:
            continue
        via = "" if bar["family"] == fam else f" (pooled: {bar['family']})"
        out.write(f"  {fam:<17} ±{bar['step_time_rel']:.1%} on {bar['cases']} runs{via}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", help="comma-separated case ids (default: all)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    parser.add_argument("--write-error-bars", action="store_true",
                        help="write src/paratrain/plan/error_bars.json (every case must be run)")
    opts = parser.parse_args()
    doc = json.loads(RUNS.read_text())
    cases, apart = doc["cases"], doc.get("not_expressible", [])
    if opts.cases:
        wanted = opts.cases.split(",")
        unknown = set(wanted) - {c["id"] for c in cases + apart}
        if unknown:
            sys.stderr.write(f"unknown case(s): {', '.join(sorted(unknown))}\n")
            return 2
        cases = [c for c in cases if c["id"] in wanted]
        apart = [c for c in apart if c["id"] in wanted]
    if opts.write_error_bars and opts.cases:
        sys.stderr.write("--write-error-bars needs every case (drop --cases)\n")
        return 2
    out = sys.stderr if opts.json else sys.stdout
    out.write(f"{'case':<46} {'gpu':<9} {'GPUs':>5} {'layout':<11} {'mb':>3} {'pred s':>8} {'pub s':>8} {'err':>7} "
              f"{'pred tok/s/GPU':>14} {'pub':>8} {'mem pred':>8} {'pub':>6} {'err':>6}  plan\n")
    rows = []
    for case in cases:
        r = predict(case)
        rows.append(r)
        print_row(r, out)
    dense = [r for r in rows if not r["moe"]] or rows
    moe = [r for r in rows if r["moe"]]
    errors = [abs(r["step_error"]) for r in dense]
    mem_errors = [abs(r["memory_error"]) for r in rows if "memory_error" in r]
    # the dense summary keeps its keys; the MoE runs are summed up apart
    summary = {"cases": len(dense), "mean_abs_step_error": statistics.mean(errors), "max_abs_step_error": max(errors),
               "within_30_percent": sum(e <= 0.30 for e in errors),
               "mean_abs_memory_error": statistics.mean(mem_errors) if mem_errors else None,
               "mean_abs_memory_error_by_framework": memory_by_framework(rows)}
    if moe:
        moe_errors = [abs(r["step_error"]) for r in moe]
        summary["moe"] = {"cases": len(moe), "mean_abs_step_error": statistics.mean(moe_errors),
                          "max_abs_step_error": max(moe_errors), "within_20_percent": sum(e <= 0.20 for e in moe_errors)}
    out.write(mean_line(dense, "dense", "target <= 12%, max <= 30%").rstrip("\n")
              + (f"; mean |memory error| {summary['mean_abs_memory_error']:.1%} over {len(mem_errors)}"
                 if mem_errors else "") + "\n")
    if moe:
        out.write(mean_line(moe, "MoE", "target <= 15%"))
    if summary["mean_abs_memory_error_by_framework"]:
        out.write("mean |memory error| by framework (only torchtitan holds memory as paratrain's runtime does): "
                  + ", ".join(f"{k} {v:.1%}" for k, v in summary["mean_abs_memory_error_by_framework"].items()) + "\n")
    searched = [r for r in rows if r["micro_batch_searched"]]
    if searched:
        out.write("~ micro-batch not in the source: the planner's fastest for the layout; all tried (micro-batch: "
                  "predicted s):\n")
        for r in searched:
            out.write(f"  {r['id']:<44} " + ", ".join(f"{k}: {v:.3g}" for k, v in r["step_s_by_micro_batch"].items())
                      + "\n")
    if any(r["id"].endswith("*") for r in rows):
        out.write("* a published scheme paratrain's runtime cannot run (the case's runtime_unsupported says why), priced as run\n")
    print_bars(rows, out)
    apart_rows = print_not_expressible(apart, out)
    if opts.write_error_bars:
        write_error_bars(rows, out)
    if opts.json:
        print(json.dumps({"rows": rows, "not_expressible": apart_rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
