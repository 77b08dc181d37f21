"""Coverage of the transformers families: every causal-LM model type transformers registers, as a new user would
bring it (`--model hf:DIR` holding a config.json written by the family's own config class), run through
`paratrain verify`.

In scope: the decoder-only attention families (interop/hf_families.py lists the others out of scope, each with its
reason). Each in-scope family, as a tiny config (interop/hf_tiny_config.py: the family's structure, small sizes by
one rule), runs `paratrain verify --strategy single`; each one whose layers hold experts (models/hf_moe_layout.py)
also runs `paratrain verify --strategy ep --ep 2`, routing compared. Each run ends as

  pass     verify passed (for ep: routing compared and equal, expert_assignments_match true)
  refused  exit 2 with one line saying why (the line is kept)
  failed   anything else: a verify mismatch, a traceback, more than one line on a refusal

Usage: python benchmarks/hf_coverage.py [--json] [--only TYPE,TYPE] [--steps N] [--no-ep] [--work DIR]
The single-strategy runs go through the CLI in this process; each ep run is its own `paratrain verify`
process (its two ranks' output checked for tracebacks too). A full run takes ~15 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

RUN = ["--steps", "2", "--seq-len", "32", "--global-batch", "4", "--device", "cpu"]


def quiet_transformers() -> None:
    """transformers' notices about the tiny configs (special token ids, rope defaults) are not the run's output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore")


# Routing tables a family's initialisation leaves empty because its checkpoints carry them: DeepSeek-V4's hash
# routing (tid2eid, token id -> its experts) is all zeros, so every token would take expert 0 twice and the router's
# gradient would be rounding noise. The tiny checkpoint carries a random table, as a trained one carries a real one.
CHECKPOINT_TABLES = {"deepseek_v4": "tid2eid"}


def write_family(model_type: str, work: Path) -> Path:
    """hf:DIR of the family's tiny config (with a checkpoint where CHECKPOINT_TABLES names a table)."""
    import torch
    import transformers

    from paratrain.interop.hf_tiny_config import tiny_config

    folder = work / model_type
    config = tiny_config(model_type)
    table = CHECKPOINT_TABLES.get(model_type)
    if table is None:
        config.save_pretrained(folder)
        return folder
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    for name, buffer in model.named_buffers():
        if name.endswith(table):  # each token's k distinct experts
            experts = config.num_local_experts
            buffer.copy_(torch.rand(buffer.shape[0], experts).argsort(-1)[:, :buffer.shape[1]])
    model.save_pretrained(folder)
    return folder


def cli_here(argv: list[str]) -> tuple[int, str, str]:
    """`paratrain ARGV` in this process: (exit code, stdout, stderr); an escaped exception is its traceback on
    stderr with code 1."""
    from paratrain import cli

    out, err, code = io.StringIO(), io.StringIO(), 0
    saved = dict(os.environ)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return code, out.getvalue(), err.getvalue()


def cli_process(argv: list[str], timeout: float = 600) -> tuple[int, str, str]:
    """`paratrain ARGV` as its own process (its ranks' output included)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run([sys.executable, "-m", "paratrain.cli", *argv], capture_output=True, text=True,
                              timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout:.0f} s"
    return proc.returncode, proc.stdout, proc.stderr


def outcome(code: int, out: str, err: str, routing: bool = False) -> dict:
    """pass / refused / failed (module docstring) of one verify run, with the reason line."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if "Traceback (most recent call last)" in err:
        return {"result": "failed", "reason": f"traceback: {last}"}
    if code == 2:
        errors = [ln for ln in lines if ln.startswith("error:")]
        if len(errors) == 1 and errors[0] == last:
            return {"result": "refused", "reason": last.removeprefix("error: ")}
        return {"result": "failed", "reason": f"refused in {len(errors)} error lines: {last}"}
    try:
        doc = json.loads(out)
    except ValueError:
        return {"result": "failed", "reason": f"exit {code}: {last}"}
    if code == 0 and doc.get("passed") and (not routing or doc.get("expert_assignments_match") is True):
        return {"result": "pass", "reason": None}
    why = "routing not compared" if doc.get("passed") else (doc.get("first_divergence") or {}).get("differs")
    return {"result": "failed", "reason": f"exit {code}: verify {why}"}


def moe_facts(folder: Path) -> list[dict]:
    """The family's MoE layers as models/hf_moe_layout.py reads them from the model on the meta device."""
    from paratrain.models.hf_model import hf_config_object, meta_model
    from paratrain.models.hf_moe_layout import moe_layers

    doc = json.loads((folder / "config.json").read_text())
    return [layer.to_dict() for layer in moe_layers(meta_model(hf_config_object(doc, str(folder))))]


def check_family(model_type: str, work: Path, steps: int, ep: bool) -> dict:
    row: dict = {"model_type": model_type}
    start = time.perf_counter()
    try:
        folder = write_family(model_type, work)
        layers = moe_facts(folder)
    except Exception as exc:  # the tiny config or its meta model cannot be made
        row["single"] = {"result": "failed", "reason": f"tiny config: {type(exc).__name__}: {exc}".splitlines()[0]}
        return row
    row["moe_layers"] = len(layers)
    if layers:
        first = layers[0]
        row["moe"] = {k: first[k] for k in ("layout", "n_experts", "top_k", "router", "shared_experts")}
    argv = ["verify", "--model", f"hf:{folder}", *RUN, "--steps", str(steps), "--json"]
    row["single"] = outcome(*cli_here([*argv, "--strategy", "single"]))
    if layers and ep:
        row["ep"] = outcome(*cli_process([*argv, "--strategy", "ep", "--ep", "2"]), routing=True)
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def summary(rows: list[dict], out_of_scope: list[dict]) -> dict:
    def counts(key: str) -> dict:
        ran = [r[key]["result"] for r in rows if key in r]
        return {k: ran.count(k) for k in ("pass", "refused", "failed")}

    single = counts("single")
    return {"families": len(rows) + len(out_of_scope), "in_scope": len(rows), "out_of_scope": out_of_scope,
            "single": single, "single_pass_fraction": single["pass"] / max(1, len(rows)),
            "moe_families": sum(1 for r in rows if r.get("moe_layers")), "ep": counts("ep"),
            "refusals": [{"model_type": r["model_type"], "strategy": key, "reason": r[key]["reason"]}
                         for r in rows for key in ("single", "ep") if r.get(key, {}).get("result") == "refused"],
            "failures": [{"model_type": r["model_type"], "strategy": key, "reason": r[key]["reason"]}
                         for r in rows for key in ("single", "ep") if r.get(key, {}).get("result") == "failed"],
            "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--only", help="comma-separated model types (default: every registered one)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-ep", action="store_true", help="skip the --strategy ep runs")
    parser.add_argument("--work", help="where the tiny configs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    quiet_transformers()
    from paratrain.interop.hf_families import causal_lm_families

    families = causal_lm_families()
    if args.only:
        wanted = set(args.only.split(","))
        families = [f for f in families if f.model_type in wanted]
    out_of_scope = [{"model_type": f.model_type, "reason": f.out_of_scope} for f in families if f.out_of_scope]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        rows = []
        for family in (f for f in families if not f.out_of_scope):
            row = check_family(family.model_type, work, args.steps, not args.no_ep)
            rows.append(row)
            print(f"{row['model_type']:28s} single: {row['single']['result']:8s}"
                  f"{' ep: ' + row['ep']['result'] if 'ep' in row else '':14s}"
                  f" {row['single']['reason'] or (row.get('ep') or {}).get('reason') or ''}", file=sys.stderr,
                  flush=True)
    doc = summary(rows, out_of_scope)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"{doc['in_scope']} in-scope families of {doc['families']}: single {doc['single']}, "
              f"{doc['moe_families']} MoE families under ep 2: {doc['ep']}")
        for r in doc["refusals"]:
            print(f"refused  {r['model_type']} ({r['strategy']}): {r['reason']}")
        for r in doc["failures"]:
            print(f"failed   {r['model_type']} ({r['strategy']}): {r['reason']}")
    return doc


if __name__ == "__main__":
    main()
