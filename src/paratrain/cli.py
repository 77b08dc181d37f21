"""The paratrain command line. Thin: parse, call the library, print.

With --json a command prints exactly one JSON document on stdout; everything for humans goes to stderr.
Bad input: one line on stderr, exit 2. A failed check: exit 1.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from paratrain.cli_options import OptionSpec, run_options, shared_run_options, with_options
from paratrain.errors import CheckFailed, UserError, flag_of
from paratrain.lora_options import LORA_FIELDS
from paratrain.parallel.dims import all_dims
from paratrain.plan.passed_on import PASSED_ON

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Make the right parallel strategy easy, provable and fast.")
log = logging.getLogger("paratrain")


def emit_json(doc: dict) -> None:
    sys.stdout.write(json.dumps(_finite(doc), indent=1, default=str) + "\n")
    sys.stdout.flush()


def _finite(value):
    """JSON has no NaN or infinity: a figure that is not a number is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


# -- options, each declared once (cli_options.py): the run options come from the config's fields -------------------
RUN = run_options()  # by field name: every TrainConfig field that is a flag
CONFIG = OptionSpec("config", Optional[Path], "TOML run config (default: the embedded tiny-cpu)")
AS_JSON = OptionSpec("as_json", bool, "print the result as one JSON document on stdout", default=False,
                     flags=("--json",))
HTML = OptionSpec("html", Optional[Path], "write a self-contained HTML report")
MEASURED_STEPS = RUN["steps"].noting("measured, after --warmup").but(default=10)
WARMUP = OptionSpec("warmup", int, "unmeasured steps first: setup, caches")
NODES = OptionSpec("nodes", Optional[int], "machines")
MIG = OptionSpec("mig", Optional[str], "each device is this MIG slice of the GPU, e.g. 3g.40gb; docs/planner.md")

TRAIN_OPTIONS = [CONFIG.param(), *(spec.param() for spec in shared_run_options())]
with_train_options = with_options(TRAIN_OPTIONS, "train_opts")


def resolve_config(opts: dict, **forced):
    from paratrain.config import load_config

    overrides = {k: v for k, v in opts.items() if k != "config"}
    overrides.update({k: v for k, v in forced.items() if v is not None})
    return load_config(str(opts["config"]) if opts.get("config") else None, overrides)


def refuse_replica_healing(cfg, command: str, why: str) -> None:
    """--heal-replicas is a train option (train/recovery/replica_launch.py); the other commands that take the train options
    must not accept it and silently run without it."""
    if cfg.heal_replicas:
        raise UserError(f"--heal-replicas (or heal_replicas in the config) does not apply to `paratrain {command}`: "
                        f"{why}")


def setup_cli_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="paratrain: %(message)s", stream=sys.stderr, force=True)


# -- train ---------------------------------------------------------------------------------------------------------
@app.command()
@with_train_options
def train(print_config: bool = typer.Option(False, "--print-config", help="print the resolved config as TOML"),
          probe: Optional[int] = RUN["probe"](),
          script: Optional[str] = typer.Option(None, "--script", help="train your own nn.Module: FILE.py:FUNCTION "
                                                                      "(docs/api.md)"),
          as_json: bool = AS_JSON(),
          train_opts: dict = None):
    """Train a model on N devices with any strategy."""
    setup_cli_logging()
    cfg = resolve_config(train_opts, probe=probe)
    if cfg.probe and cfg.strategy != "auto":
        raise UserError(f"--probe {cfg.probe} needs --strategy auto (got --strategy {cfg.strategy})")
    if print_config:
        sys.stdout.write(cfg.to_toml())
        return
    from paratrain.train.launch import run_workers
    from paratrain.train.validate import validate_run, world_size_for
    from paratrain.train.worker import train_worker

    probed = None
    if cfg.strategy == "auto" and cfg.probe:
        from paratrain.bench.probe_layouts import resolve_by_probe

        cfg, probed = resolve_by_probe(cfg)
    elif cfg.strategy == "auto":
        from paratrain.plan.auto import resolve_auto_strategy

        cfg = resolve_auto_strategy(cfg)
    world = world_size_for(cfg)
    if cfg.heal_replicas:
        from paratrain.train.recovery.replica_launch import check_heal_run

        check_heal_run(cfg, world, script)
    if script:
        from paratrain.train.custom import check_custom_run, load_script

        check_custom_run(cfg, world, load_script(script))
        predicted_peak = None
    else:
        from paratrain.models.presets import model_args_for
        from paratrain.plan.memory_check import check_memory
        from paratrain.train.runtime import pick_device_type

        predicted_peak = check_memory(cfg, validate_run(cfg, world), model_args_for(cfg), pick_device_type(cfg.device))
    from paratrain.train.launch import launched_run_name

    name = launched_run_name(cfg.strategy) or f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.strategy}"
    run_dir = Path(cfg.out) if cfg.out else Path("runs") / name
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(cfg.to_toml())
    except OSError as exc:
        raise UserError(f"cannot create run directory {run_dir}: {exc.strerror or exc}") from None
    try:
        if cfg.heal_replicas:
            from paratrain.train.recovery.replica_launch import run_replicas

            results = {0: run_replicas(cfg, run_dir, world)}
        else:
            results = run_workers(train_worker, (cfg.model_dump(), str(run_dir), False, script, predicted_peak),
                                  world, cfg.max_restarts, cfg.timeout_s, hang_dir=str(run_dir / "hang"))
    except UserError:
        if created and _holds_nothing_new(run_dir):  # never a run dir a step or a save already wrote to
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    except CheckFailed as exc:  # a failed run still answers --json: what failed, on which rank, after which step
        if as_json:
            emit_json({"error": _one_line(exc), "rank": exc.rank, "step": exc.step, "run_dir": str(run_dir)})
        raise
    if 0 not in results:
        return  # a non-zero rank under torchrun/srun: rank 0 reports
    summary = results[0]
    if summary is None:
        raise CheckFailed("rank 0 returned no summary")
    floor = summary.get("loss_floor")
    vs = f" against a floor of {floor:.4f}" if floor is not None else ""
    mfu = f", MFU {summary['mfu']:.1%}" if summary.get("mfu") is not None else ", MFU n/a (no known peak for this device)"
    if summary.get("val_loss") is not None:
        vs += f", val loss {summary['val_loss']:.4f} (ppl {summary['val_ppl']:.2f})"
    loss = f"{summary['final_loss']:.4f}" if summary["final_loss"] is not None else "n/a (no step trained)"
    log.info("done: %d steps, loss %s%s, %.0f tokens/s%s; run dir %s", summary["steps"], loss, vs,
             summary["tokens_per_s"], mfu, run_dir)
    if as_json:
        emit_json({k: v for k, v in summary.items() if k != "losses"} | ({"probe": probed} if probed else {}))
    if summary.get("stopped"):  # preempted (train/recovery/preemption.py): its own exit status, the checkpoint saved
        from paratrain.train.recovery.preemption import exit_status

        return exit_status()


def _holds_nothing_new(run_dir: Path) -> bool:
    """True if the run dir holds only what `train` wrote before any step: config.toml (and an empty
    metrics.jsonl). A checkpoint, a metrics line or anything else keeps it."""
    try:
        entries = {p.name: p for p in run_dir.iterdir()}
    except OSError:
        return False
    metrics = entries.pop("metrics.jsonl", None)
    entries.pop("config.toml", None)
    return not entries and (metrics is None or (metrics.is_file() and metrics.stat().st_size == 0))


# -- generate options (generate, verify --generate) ----------------------------------------------------------------
PROMPT = OptionSpec("prompt", Optional[str], "one prompt, as text (needs the checkpoint's tokenizer)")
PROMPTS = OptionSpec("prompts", Optional[Path], 'a JSON Lines file, one prompt a line: {"text": ...} or {"ids": [...]}')
MAX_NEW_TOKENS = OptionSpec("max_new_tokens", int, "tokens to generate per prompt", default=32)
TEMPERATURE = OptionSpec("temperature", Optional[float], "sample at this temperature (default 0: greedy)")
TOP_K = OptionSpec("top_k", Optional[int], "sample among the K likeliest tokens (needs --temperature > 0)")
TOP_P = OptionSpec("top_p", Optional[float], "sample among the likeliest tokens that hold P of the probability "
                                            "(needs --temperature > 0)")
SAMPLING_SEED = OptionSpec("seed", Optional[int], "sampling seed: prompt i draws from its own stream of (seed, i)")
BATCH_SIZE = OptionSpec("batch_size", int, "prompts of one length per forward, on each data-parallel rank",
                        default=16)
KV_CACHE = OptionSpec("kv_cache", bool, "keep keys and values across steps (--no-kv-cache: the whole sequence "
                                        "each step)", default=True, flags=("--kv-cache/--no-kv-cache",))
GENERATE_OPTIONS = [PROMPT.param(), PROMPTS.param(), MAX_NEW_TOKENS.param(), TEMPERATURE.param(), TOP_K.param(),
                    TOP_P.param(), SAMPLING_SEED.param(), BATCH_SIZE.param(), KV_CACHE.param()]
SOURCE_HELP = "a checkpoint step-N/ directory, a --ckpt-dir (its newest complete step), or hf:DIR (a transformers " \
              "model directory)"
# verify --generate: the run's --seed also seeds the sampling
VERIFY_GENERATE_OPTIONS = [
    ("generate", bool, typer.Option(False, "--generate", help="compare generation instead of training: the same "
                                                              "prompts on one device and on this layout")),
    ("source", Optional[str], typer.Option(None, "--source", help=SOURCE_HELP + " (with --generate; default: the "
                                                                                "model at its --seed's initial weights)")),
    *(p for p in GENERATE_OPTIONS if p[0] != "seed")]


def generate_options(opts: dict):
    """(the GenerateOptions of generate's own flags, popped from `opts`; --prompt; --prompts)."""
    from paratrain.infer.generate import GenerateOptions
    from paratrain.infer.sampling import Sampling

    sampling = Sampling.of(opts.pop("temperature"), opts.pop("top_k"), opts.pop("top_p"), opts.pop("seed"))
    options = GenerateOptions(opts.pop("max_new_tokens"), sampling, opts.pop("batch_size"), opts.pop("kv_cache"))
    return options, opts.pop("prompt"), opts.pop("prompts")


# -- verify --------------------------------------------------------------------------------------------------------
@app.command()
@with_train_options
@with_options(VERIFY_GENERATE_OPTIONS, "gen_opts")
def verify(steps: int = RUN["steps"](default=5), as_json: bool = AS_JSON(), gen_opts: dict = None,
           train_opts: dict = None):
    """Prove a parallel run matches a single-device run, every step and every rank (loss, grad norm,
    gradients before clipping, parameters, activations); on a mismatch, say where it first diverges.
    With --generate: the same prompts generated on one device and on the layout, token for token."""
    setup_cli_logging()
    if gen_opts.pop("generate"):
        return verify_generation(gen_opts, train_opts, as_json)
    stray = [name for name, _, option in VERIFY_GENERATE_OPTIONS if gen_opts.get(name, option.default) != option.default]
    if stray:
        raise UserError(f"{flag_of(stray[0])} applies to verify --generate only")
    cfg = resolve_config(train_opts, steps=steps)
    refuse_replica_healing(cfg, "verify", "it compares one run with one device; drop the option")
    from paratrain.train.launch import run_workers
    from paratrain.train.validate import validate_run, world_size_for
    from paratrain.verify.parity import check_verifiable, describe_divergence, verify_worker

    world = world_size_for(cfg)
    check_verifiable(cfg, validate_run(cfg, world))
    results = run_workers(verify_worker, (cfg.model_dump(), None), world, 0, cfg.timeout_s)
    if 0 not in results:
        return  # a non-zero rank under torchrun/srun: rank 0 reports
    result = results[0]
    if result is None:
        raise CheckFailed("rank 0 returned no verify result")
    verdict = "PASSED" if result["passed"] else "FAILED"
    log.info("verify %s (%s, world %d, %d steps, %s): max loss diff %.2e, max grad rel diff %.2e, "
             "max param diff %.2e", verdict, result["strategy"], result["world_size"], result["steps"],
             result["dtype"], result["max_loss_abs_diff"], result["max_grad_rel_diff"], result["max_param_abs_diff"])
    where = describe_divergence(result.get("first_divergence"))
    if where:
        log.info("verify: %s", where)
    if as_json:
        emit_json(result)
    if not result["passed"]:
        raise typer.Exit(1)


def verify_generation(gen_opts: dict, train_opts: dict, as_json: bool):
    """verify --generate (verify/generate_parity.py): exit 1 on a real mismatch, near-ties reported."""
    from paratrain.infer.generate_run import default_prompts, prepare_job
    from paratrain.infer.prompts import read_prompts
    from paratrain.infer.source_loader import resolve_source
    from paratrain.verify.generate_parity import report_lines, run_verify_generate

    source = gen_opts.pop("source")
    options, prompt, prompts = generate_options({**gen_opts, "seed": train_opts.get("seed")})
    cfg = resolve_source(source, train_opts) if source else resolve_config(train_opts)
    refuse_replica_healing(cfg, "verify", "it compares one run with one device; drop the option")
    raw = read_prompts(prompt, prompts) if prompt is not None or prompts is not None else default_prompts(cfg)
    report = run_verify_generate(cfg, prepare_job(cfg, raw, options))
    if report is None:
        return  # a non-zero rank under torchrun/srun: rank 0 reports
    for line in report_lines(report):
        log.info("%s", line)
    if as_json:
        emit_json(report)
    if not report["passed"]:
        raise typer.Exit(1)


# -- eval ----------------------------------------------------------------------------------------------------------
@app.command("eval")
@with_train_options
def eval_source(source: str = typer.Argument(..., help=SOURCE_HELP),
                as_json: bool = AS_JSON(), train_opts: dict = None):
    """Loss and perplexity of a checkpoint (or hf:DIR) on held-out data, per source for mixtures, under any layout
    (default: the one it was saved under): --val-data V, --data D's --val-fraction F, or all of --data D
    (docs/inference.md)."""
    setup_cli_logging()
    from paratrain.infer.eval_run import eval_config, run_eval

    cfg = eval_config(source, train_opts)
    refuse_replica_healing(cfg, "eval", "it trains nothing; drop the option")
    doc = run_eval(cfg)
    if doc is None:
        return  # a non-zero rank under torchrun/srun: rank 0 reports
    mixed = len(doc["per_source"]) > 1
    sources = "".join(f"; {name}: {v['loss']:.4f}" for name, v in doc["per_source"].items() if mixed)
    log.info("eval %s: loss %.4f, perplexity %.3f over %s tokens%s", doc["checkpoint"], doc["loss"],
             doc["perplexity"], f"{doc['tokens']:,}", sources)
    if as_json:
        emit_json(doc)


# -- generate ------------------------------------------------------------------------------------------------------
@app.command()
@with_train_options
@with_options(GENERATE_OPTIONS, "gen_opts")  # inside: its --seed is the sampling seed, not train's
def generate(source: str = typer.Argument(..., help=SOURCE_HELP),
             out: Optional[Path] = typer.Option(None, "--out", help="write the outputs here as JSON Lines"),
             as_json: bool = AS_JSON(), gen_opts: dict = None, train_opts: dict = None):
    """Generate text (or token ids) from a checkpoint under any layout: prompts split over the data-parallel ranks,
    tensor and expert parallel, greedy or sampled (docs/inference.md)."""
    setup_cli_logging()
    from paratrain.infer.generate_run import prepare_job, run_generate, summary_line, write_outputs
    from paratrain.infer.prompts import read_prompts
    from paratrain.infer.source_loader import resolve_source

    options, prompt, prompts = generate_options(gen_opts)
    cfg = resolve_source(source, train_opts)
    refuse_replica_healing(cfg, "generate", "it trains nothing; drop the option")
    doc = run_generate(cfg, prepare_job(cfg, read_prompts(prompt, prompts), options))
    if doc is None:
        return  # a non-zero rank under torchrun/srun: rank 0 reports
    if out is not None:
        write_outputs(out, doc)
    log.info("%s", summary_line(doc))
    if as_json:
        emit_json(doc)


# -- export / data prepare -----------------------------------------------------------------------------------------
@app.command()
def export(ckpt: Path = typer.Argument(..., help="a checkpoint step-N/ directory, or a --ckpt-dir (newest complete)"),
           out: Path = typer.Option(..., "-o", "--out", help="the Hugging Face directory to write"),
           max_shard_size: str = typer.Option("2GB", "--max-shard-size", help="largest safetensors file, e.g. 500MB"),
           dtype: str = typer.Option("fp32", "--dtype", help="the written weights' dtype: fp32 | bf16 | fp16"),
           adapter_only: bool = typer.Option(False, "--adapter-only", help=(
               "a LoRA run's adapters alone, as PEFT's adapter_model.safetensors + adapter_config.json (without it a "
               "LoRA run is written merged: W + alpha/r B A)")),
           as_json: bool = AS_JSON()):
    """Write a checkpoint as safetensors: a Hugging Face directory that transformers loads (presets, and hf: models
    in their own format with their tokenizer), or a plain state dict (a custom --script model)."""
    setup_cli_logging()
    from paratrain.convert.hf_export import DTYPES, export_checkpoint, parse_size

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if adapter_only:
        from paratrain.convert.lora_export import export_adapter

        doc = export_adapter(ckpt, out, dtype)
    else:
        doc = export_checkpoint(ckpt, out, parse_size(max_shard_size), dtype)
    log.info("exported %s (step %d) to %s: %s, %d tensor(s) in %d shard(s), %.1f MB", doc["checkpoint"], doc["step"],
             doc["out"], doc["architecture"], doc["tensors"], doc["shards"], doc["bytes"] / 1e6)
    if as_json:
        emit_json(doc)


DOCUMENT_FILES = typer.Argument(..., help="text files (each one a document), or JSON Lines / Parquet / Arrow files "
                                          "(each record one)")
data_app = typer.Typer(no_args_is_help=True,
                       help="Prepare training data: train a tokenizer, tokenize text into a token file.")
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def data_prepare(files: list[Path] = DOCUMENT_FILES,
                 tokenizer: Path = RUN["tokenizer"](default=...),
                 out: Path = typer.Option(..., "-o", "--out", help="the token file to write (tokens.bin)"),
                 eot: Optional[str] = typer.Option(None, "--eot", help="end-of-text token after each document"),
                 text_field: str = RUN["text_field"](default="text"),
                 as_json: bool = AS_JSON()):
    """Tokenize text files into nanoGPT-style tokens (tokens.bin) plus a JSON sidecar (tokens.bin.json)."""
    setup_cli_logging()
    from paratrain.train.data.prepare_tokens import prepare_tokens, sidecar_path

    meta = prepare_tokens(tokenizer, files, out, eot, text_field=text_field)
    log.info("wrote %s: %s tokens (%s), %d document(s), vocab %d; sidecar %s", out, f"{meta['tokens']:,}",
             meta["dtype"], meta["documents"], meta["vocab_size"], sidecar_path(out))
    if as_json:
        emit_json(meta)


@data_app.command("tokenizer")
def data_tokenizer(files: list[Path] = DOCUMENT_FILES,
                   out: Path = typer.Option(..., "-o", "--out", help="directory for the tokenizer.json"),
                   vocab_size: int = typer.Option(8192, "--vocab-size",
                                                  help="the tokenizer's vocabulary: at most this many tokens"),
                   text_field: str = RUN["text_field"](default="text"),
                   as_json: bool = AS_JSON()):
    """Train a byte-level BPE tokenizer.json on your own documents, read as `train` reads them (for `data prepare
    --tokenizer DIR` or `train --tokenizer DIR`)."""
    setup_cli_logging()
    from paratrain.train.data.train_tokenizer import train_tokenizer

    doc = train_tokenizer(files, out, vocab_size, text_field)
    log.info("wrote %s: byte-level BPE, vocab %d, trained on %d document(s) of %d file(s) (%s bytes)",
             doc["tokenizer"], doc["vocab_size"], sum(s["documents"] for s in doc["sources"]), len(doc["sources"]),
             f"{sum(s['bytes'] for s in doc['sources']):,}")
    if as_json:
        emit_json(doc)


# -- env -----------------------------------------------------------------------------------------------------------
@app.command()
def env(as_json: bool = AS_JSON()):
    """Versions, devices, backends and topology, for bug reports (on stdout: `paratrain env > env.txt`)."""
    from paratrain.env_report import collect_env

    report = collect_env()
    if as_json:
        emit_json(report)
    else:
        sys.stdout.write("".join(f"{key:>18}: {value}\n" for key, value in report.items()))


# -- doctor --------------------------------------------------------------------------------------------------------
@app.command()
@with_train_options
def doctor(steps: int = MEASURED_STEPS(), warmup: int = WARMUP(default=2),
           trace: Optional[Path] = typer.Option(None, "--trace", help="write a Chrome trace (opens in Perfetto)"),
           mem_budget_gib: Optional[float] = RUN["mem_budget_gib"](),  # the report's budget; the run's own check never sees it
           probe_rounds: int = typer.Option(3, "--probe-rounds",
                                            help="rounds of counterfactual probe steps (0: exposure only)"),
           html: Optional[Path] = HTML(),
           hang: Optional[Path] = typer.Option(None, "--hang", help="read a hung run's flight-recorder files "
                                               "(RUNDIR/hang/) and name the rank that stalled or died"),
           as_json: bool = AS_JSON(),
           train_opts: dict = None):
    """Why is my utilization low? Measure a few steps of this run and name the causes, with fixes."""
    setup_cli_logging()
    if hang is not None:
        from paratrain.doctor.hang import format_hang, hang_report

        report = hang_report(hang)
        sys.stderr.write(format_hang(report))
        if as_json:
            emit_json(report)
        return
    cfg = resolve_config(train_opts)
    refuse_replica_healing(cfg, "doctor", "it measures a plain run; drop the option")
    if cfg.strategy == "auto":
        from paratrain.plan.auto import resolve_auto_strategy

        cfg = resolve_auto_strategy(cfg)
    from paratrain.doctor.doctor_report import format_report
    from paratrain.doctor.run_doctor import run_doctor

    report = run_doctor(cfg, steps, warmup, str(trace) if trace else None, mem_budget_gib, probe_rounds)
    if report is None:
        return  # a non-zero rank under torchrun/srun: rank 0 reports
    if html:
        from paratrain.doctor.doctor_html import write_doctor_html

        report["html"] = write_doctor_html(report, str(html))
    sys.stderr.write(format_report(report))
    if as_json:
        emit_json(report)


# -- bench ---------------------------------------------------------------------------------------------------------
# plan --inference and bench --inference (docs/inference.md)
INFERENCE_OPTIONS = [
    ("inference", bool, typer.Option(False, "--inference", help="generation instead of training: per layout the "
                                                                "weights, KV cache, largest batch, time per token")),
    ("prompt_len", Optional[int], typer.Option(None, "--prompt-len", help="with --inference: prompt tokens per "
                                                                          "sequence (plan: default --seq-len, else "
                                                                          "128; bench: 16)")),
    MAX_NEW_TOKENS.noting("with --inference").param(),
    BATCH_SIZE.noting("with --inference; plan: default the largest that fits; bench: 8").param(
        annotation=Optional[int], default=None),
]


def inference_options(opts: dict) -> dict | None:
    """The --inference options popped from `opts`: None without --inference (then none may be given)."""
    values = {name: opts.pop(name) for name, _, _ in INFERENCE_OPTIONS}
    if values["inference"]:
        return values
    stray = [name for name, _, option in INFERENCE_OPTIONS if values[name] != option.default]
    if stray:
        raise UserError(f"{flag_of(stray[0])} applies with --inference only")
    return None


BENCH_RUN_OPTIONS = ("model", "seq_len", "micro_batch", "global_batch", "dtype", "device", "timeout_s")
BENCH_STRATEGIES, BENCH_INFERENCE_STRATEGIES = "ddp,zero2,zero3", "tp,pp,ddp"


@app.command()
@with_options([CONFIG.param(), *(RUN[name].param() for name in BENCH_RUN_OPTIONS)], "train_opts")
@with_options(INFERENCE_OPTIONS, "infer_opts")
def bench(strategies: str = typer.Option(BENCH_STRATEGIES, "--strategies", help="comma-separated strategies "
                                         f"(with --inference the default is {BENCH_INFERENCE_STRATEGIES})"),
          nproc: str = RUN["nproc"].noting("comma-separated: one run each")(default="1,2,4"),
          steps: int = MEASURED_STEPS(),
          warmup: int = WARMUP.noting("at least 2")(default=3),
          scaling: str = typer.Option("weak", "--scaling", help="weak (--micro-batch per device fixed) | strong "
                                                                "(--global-batch fixed)"),
          plot: Optional[Path] = typer.Option(None, "--plot", help="write a 3-panel PNG (needs matplotlib)"),
          html: Optional[Path] = HTML(),
          as_json: bool = AS_JSON(),
          infer_opts: dict = None, train_opts: dict = None):
    """Measure scaling 1 -> 2 -> 4 for several strategies: table, JSON and plots (--inference: generation)."""
    setup_cli_logging()
    from paratrain.bench.scaling import markdown_table, parse_list, run_bench

    cfg = resolve_config(train_opts)
    inference = inference_options(infer_opts)
    if inference is not None:
        layouts = BENCH_INFERENCE_STRATEGIES if strategies == BENCH_STRATEGIES else strategies
        return bench_inference(cfg, inference, parse_list(layouts, "strategies"), parse_list(nproc, "nproc", int),
                               plot, html, as_json)
    doc = run_bench(cfg, parse_list(strategies, "strategies"), parse_list(nproc, "nproc", int), steps, warmup,
                    scaling)
    from paratrain.bench.bench_html import write_bench_html
    from paratrain.bench.plot import plot_bench

    report_bench(doc, markdown_table, plot_bench, write_bench_html, plot, html, as_json)


def bench_inference(cfg, inference: dict, strategies: list[str], worlds: list[int], plot, html, as_json: bool):
    """bench --inference: generation per layout and world size, measured next to plan --inference."""
    from paratrain.bench.inference_bench import inference_table, run_inference_bench
    from paratrain.bench.inference_plot import plot_inference_bench, write_inference_html

    doc = run_inference_bench(cfg, strategies, worlds, inference["prompt_len"], inference["max_new_tokens"],
                              inference["batch_size"])
    report_bench(doc, inference_table, plot_inference_bench, write_inference_html, plot, html, as_json)


def report_bench(doc: dict, table, draw, page, plot, html, as_json: bool) -> None:
    """A bench document's PNG (--plot), page (--html), table (stderr) and JSON (stdout)."""
    if plot is not None:
        doc["plot"] = str(draw(doc, plot))
    if html is not None:
        doc["html"] = page(doc, str(html))
    sys.stderr.write(table(doc))
    if doc["plot"]:
        sys.stderr.write(f"plot: {doc['plot']}\n")
    if as_json:
        emit_json(doc)


# -- plan ----------------------------------------------------------------------------------------------------------
def fixed(spec: OptionSpec) -> tuple[str, object, object]:
    """A run option in `plan`: given, it is fixed; left out, the planner searches it."""
    return spec.but(help=f"fix: {spec.help}").param()


PLAN_OPTIONS: list[tuple[str, object, object]] = [
    RUN["model"].param(),
    ("hf_config", Optional[Path], typer.Option(None, "--hf-config", help="a Hugging Face config.json or its directory (any decoder-only causal LM)")),
    ("gpu", Optional[str], typer.Option(None, "--gpu", help="a100-40, a100-80, h100-sxm, h100-pcie, h200, a6000, "
                                                             "rtx4090, l4, l40s, cpu; or a list per node in rank "
                                                             "order for a mixed cluster: h100-sxm:8,a100-80:8")),
    MIG.param(),
    ("cluster", Optional[Path], typer.Option(None, "--cluster", help="mixed cluster JSON: nodes with GPU type, "
                                                                     "count, links, speed (docs/mixed-clusters.md)")),
    ("gpus", Optional[int], typer.Option(None, "--gpus", help="total GPUs (devices)")),
    NODES.noting("default: ceil(gpus / 8)").param(),
    RUN["seq_len"].noting("default: the model's").param(),
    RUN["global_batch"].noting("default 16").param(),
    RUN["dtype"].param(annotation=str, default="bf16"),
    RUN["compile"].param(annotation=bool, default=False, flags=("--compile",)),
    RUN["optimizer"].noting("sizes its state").param(annotation=Optional[str]),
    RUN["momentum"].noting("sgd with momentum keeps one state per parameter, without none").param(),
    *[RUN[name].noting("prices nothing; passed on to the candidates' train commands").param()
      for name in PASSED_ON],
    *[RUN[name].noting("priced: the base frozen, the adapters' gradients and optimizer state").param()
      for name in LORA_FIELDS],
    ("top", int, typer.Option(10, "--top", help="candidates to list")),
    ("search", str, typer.Option("fast", "--search", help="fast (prune layouts that cannot win) | full (refine "
                                                          "every layout)")),
    fixed(RUN["strategy"]),
    *[RUN[d.name].but(help=d.plan_help).param() for d in all_dims()],  # the degrees' "fix:" help (dims.py)
    *[fixed(RUN[name]) for name in ("micro_batch", "ac", "sp", "cp_impl", "pp_schedule", "virtual_stages")],
    ("hardware", Optional[Path], typer.Option(None, "--hardware", help="hardware profile JSON (from --calibrate)")),
    ("calibrate", bool, typer.Option(False, "--calibrate", help="measure this machine; save to --hardware FILE "
                                                                "(default ~/.cache/paratrain/hardware-profile.json)")),
    RUN["nproc"].noting("for --calibrate").param(annotation=int, default=2),
    ("calibrate_rounds", int, typer.Option(9, "--calibrate-rounds", min=1, max=100,
                                           help="--calibrate: timed rounds of each reference step (fewer: "
                                                "faster, noisier fit; 1 also warms up once, not twice)")),
    ("peak_tflops", Optional[float], typer.Option(None, "--peak-tflops", help="custom GPU: dense TFLOP/s")),
    ("mem_gib", Optional[float], typer.Option(None, "--mem-gib", help="custom GPU (or override): memory GiB")),
    ("intra_node_gbs", Optional[float], typer.Option(None, "--intra-node-gbs", help="GB/s per GPU, one way")),
    ("inter_node_gbs", Optional[float], typer.Option(None, "--inter-node-gbs", help="GB/s per GPU, one way")),
    ("mem_bw_gbs", Optional[float], typer.Option(None, "--mem-bw-gbs", help="the GPU's memory bandwidth, GB/s, "
                                                                           "where the board differs from the catalog")),
    # schemes the cost model prices that paratrain's runtime does not run (docs/planner.md)
    ("dist_optimizer", bool, typer.Option(False, "--dist-optimizer", help="price ZeRO-1 as a distributed optimizer "
                                                                          "(Megatron-Core's, overlapped)")),
    ("async_tp", bool, typer.Option(False, "--async-tp", help="price TP collectives overlapped with the matmuls "
                                                              "(torch's async TP; needs --compile and SP)")),
    ("half_weights", bool, typer.Option(False, "--half-weights", help="price weights held in the compute dtype "
                                        "with fp32 masters in the optimizer and gradients accumulated by the "
                                        "weight-gradient GEMMs (Megatron's): no per-micro-batch casts")),
    ("moe_routing", str, typer.Option("random", "--moe-routing", help="random (a trained router) | consecutive "
                                                                      "(NeMo's balanced benchmark gate): --ep's "
                                                                      "exchange")),
    *INFERENCE_OPTIONS,
    AS_JSON.param(),
]


@app.command()
@with_options(PLAN_OPTIONS, "plan_opts")
def plan(plan_opts: dict = None):
    """Predict memory and step time of every strategy for a model on a cluster, rank them, say why."""
    setup_cli_logging()
    from paratrain.plan.passed_on import passed_on_flags
    from paratrain.plan.plan_cli import build_plan_inputs, format_plan
    from paratrain.plan.request import PlanRequest

    as_json = plan_opts.pop("as_json")
    passed = {name: plan_opts.pop(name) for name in PASSED_ON}
    inference = inference_options(plan_opts)
    request = PlanRequest.of(plan_opts)
    request = request.replace(train_flags=passed_on_flags(passed, request.dtype, request.optimizer, request.momentum))
    if request.calibrate:
        from paratrain.calibrate.save_profile import (
            calibrate_and_save,  # only here: it imports the training stack
        )

        profile, path = calibrate_and_save(request)
        log.info("calibrated (%s); saved %s", profile.source, path)
        for note in profile.notes:
            log.info("  %s", note)
        request = request.replace(hardware=path, gpu=None)
        if not (request.model or request.hf_config):
            if as_json:
                emit_json({"hardware_profile": path, **profile.to_dict()})
            return
    if inference is not None:
        from paratrain.plan.inference_plan import format_inference_plan, inference_document

        doc = inference_document(request, inference["prompt_len"], inference["max_new_tokens"],
                                 inference["batch_size"])
        sys.stderr.write(format_inference_plan(doc))
        if as_json:
            emit_json(doc)
        return
    from paratrain.plan.inputs.cluster import is_gpu_list

    if request.gpus is None and not (request.cluster or is_gpu_list(request.gpu)):
        raise UserError("--gpus N is required")
    from paratrain.plan.plan_report import plan_document

    job, hw, fixed, mixed = build_plan_inputs(request)
    if request.search not in ("fast", "full"):
        raise UserError(f"--search must be fast or full, got {request.search!r}")
    doc = plan_document(job, hw, fixed, top=request.top, exhaustive=request.search == "full", cluster=mixed)
    sys.stderr.write(format_plan(doc))
    if as_json:
        emit_json(doc)
    _skip_teardown["ok"] = not request.calibrate  # calibration's launcher may leave cleanup to atexit


# -- launch --------------------------------------------------------------------------------------------------------
@app.command()
@with_train_options
def launch(target: str = typer.Argument(..., help="slurm | k8s | skypilot"),
           nodes: int = NODES(default=1),
           gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs (ranks) per machine"),
           output: Optional[Path] = typer.Option(None, "-o", "--output", help="write the job here, not to stdout"),
           job_name: Optional[str] = typer.Option(None, "--job-name", help="default: paratrain-STRATEGY"),
           port: int = typer.Option(29500, "--port", help="rendezvous port on the head node"),
           image: str = typer.Option("paratrain:latest", "--image", help="k8s: container image with paratrain"),
           k8s_api: str = typer.Option("trainjob", "--k8s-api", help="k8s: trainjob (Trainer v2) | pytorchjob (v1)"),
           namespace: Optional[str] = typer.Option(None, "--namespace", help="k8s: namespace"),
           partition: Optional[str] = typer.Option(None, "--partition", help="slurm: partition"),
           account: Optional[str] = typer.Option(None, "--account", help="slurm: account"),
           time_limit: str = typer.Option("24:00:00", "--time", help="slurm: time limit"),
           accelerator: str = typer.Option("H100", "--accelerator", help="skypilot: GPU name"),
           cloud: Optional[str] = typer.Option(None, "--cloud", help="skypilot: cloud"),
           cpus_per_task: Optional[int] = typer.Option(None, "--cpus-per-task",
                                                       help="CPUs per node for its ranks (default: 1 per rank with "
                                                            "--device cpu, else slurm 8 per GPU); OMP_NUM_THREADS "
                                                            "= CPUs / ranks"),
           mig: Optional[str] = MIG.noting("slurm and k8s jobs")(),
           gpu_share: Optional[str] = typer.Option(None, "--gpu-share", help="k8s (HAMi): each rank a shared GPU, "
                                                                              "MEM_MIB:CORES_PCT, e.g. 20000:50"),
           queue: Optional[str] = typer.Option(None, "--queue", help="k8s only: Kueue LocalQueue (label "
                                                                     "kueue.x-k8s.io/queue-name)"),
           train_opts: dict = None):
    """Write a Slurm, Kubernetes or SkyPilot job that runs this training on a cluster."""
    from paratrain.launchers.render_job import LaunchOptions, render_launch

    setup_cli_logging()
    restarts = train_opts.get("max_restarts")
    cfg = resolve_config(train_opts)
    refuse_replica_healing(cfg, "launch", "replicas heal as processes on one machine; a cluster job restarts "
                                          "through --max-restarts (docs/reliability.md)")
    opts = LaunchOptions(nodes=nodes, gpus_per_node=gpus_per_node, job_name=job_name,
                         max_restarts=3 if restarts is None else restarts, port=port, image=image, k8s_api=k8s_api,
                         namespace=namespace, partition=partition, account=account, time_limit=time_limit,
                         accelerator=accelerator, cloud=cloud, cpus_per_task=cpus_per_task, mig=mig,
                         gpu_share=gpu_share, queue=queue)
    from paratrain.config import read_toml

    batch_given = train_opts.get("global_batch") is not None or bool(cfg.deepspeed) or bool(
        train_opts.get("config") and "global_batch" in read_toml(train_opts["config"]))
    text = render_launch(target, cfg, opts, batch_given)
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.write_text(text)
    except OSError as exc:
        raise UserError(f"cannot write {output}: {exc.strerror or exc}") from None
    log.info("wrote %s (%s, %d node(s) x %d rank(s))", output, target, nodes, gpus_per_node)


def _one_line(exc: object) -> str:
    """The message on one line: a value echoed from the input may hold a newline or another control."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(exc))


# -- entry point ---------------------------------------------------------------------------------------------------
# Set by a command whose work is all written (nothing left for atexit handlers). Tearing down an interpreter that
# imported torch frees millions of objects: ~0.7 s measured on a 2-core machine, a seventh of a cold `plan`.
_skip_teardown = {"ok": False}


def _exit_without_teardown() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


# a path the user gave that the OS refuses to look up or open (a name too long, missing, not a directory, ...): bad
# input, one line and exit 2, from whichever file check met it first
PATH_ERRNOS = {errno.ENAMETOOLONG, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.ELOOP}


def _short_path(name) -> str:
    name = os.fsdecode(name) if isinstance(name, bytes) else str(name)
    return name if len(name) <= 120 else f"{name[:60]}...{name[-40:]} ({len(name)} characters)"


def main(argv: list[str] | None = None) -> None:
    command = typer.main.get_command(app)
    try:
        for i, arg in enumerate(sys.argv[1:] if argv is None else argv):
            if "\x00" in str(arg):  # only an in-process caller can pass one (a C argv cannot)
                raise UserError(f"argument {i + 1} contains a NUL byte")
        code = command.main(args=argv, prog_name="paratrain", standalone_mode=False)
    except UserError as exc:
        sys.stderr.write(f"error: {_one_line(exc)}\n")
        sys.exit(2)
    except CheckFailed as exc:
        sys.stderr.write(f"failed: {_one_line(exc)}\n")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except OSError as exc:
        if exc.filename is None or exc.errno not in PATH_ERRNOS:
            raise
        sys.stderr.write(f"error: {_short_path(exc.filename)}: {exc.strerror}\n")
        sys.exit(2)
    except Exception as exc:
        # click/typer usage errors (vendored or not) carry format_message() and exit_code
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            sys.stderr.write(f"error: {_one_line(exc.format_message())}\n")
            sys.exit(exc.exit_code if exc.exit_code else 2)
        if type(exc).__name__ in ("Exit", "Abort") and hasattr(exc, "exit_code"):
            sys.exit(exc.exit_code)
        raise
    if argv is None and _skip_teardown["ok"] and not code:  # the `paratrain` process itself, not an in-process caller
        _exit_without_teardown()
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
