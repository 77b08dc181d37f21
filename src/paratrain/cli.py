"""The paratrain command line. Thin: parse, call the library, print.

With --json a command prints exactly one JSON document on stdout; everything for humans goes to stderr.
Bad input: one line on stderr, exit 2. A failed check: exit 1.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from paratrain.errors import CheckFailed, UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Make the right parallel strategy easy, provable and fast.")
log = logging.getLogger("paratrain")


def emit_json(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc, indent=1, default=str) + "\n")
    sys.stdout.flush()


# -- train options shared by train / verify / doctor / launch ------------------------------------------------
def _opt(default, *names, help: str):  # noqa: A002 - mirrors typer's keyword
    return typer.Option(default, *names, help=help, show_default=default is not None)


TRAIN_OPTIONS: list[tuple[str, object, object]] = [
    ("config", Optional[Path], _opt(None, "--config", help="TOML run config (default: the embedded tiny-cpu)")),
    ("model", Optional[str], _opt(None, "--model", help="model preset: tiny, small, gpt2-124m, llama3-8b, llama2-70b")),
    ("strategy", Optional[str], _opt(None, "--strategy", help="single, ddp, zero1, zero2, zero3, fsdp, hsdp, model, "
                                                                "tp, tp-sp, pp, cp-ring, cp-ulysses, auto")),
    ("nproc", Optional[int], _opt(None, "--nproc", help="processes (devices) on this machine")),
    ("device", Optional[str], _opt(None, "--device", help="auto | cpu | cuda")),
    ("steps", Optional[int], _opt(None, "--steps", help="optimizer steps")),
    ("global_batch", Optional[int], _opt(None, "--global-batch", help="sequences per optimizer step, all ranks")),
    ("micro_batch", Optional[int], _opt(None, "--micro-batch", help="sequences per forward pass per rank")),
    ("seq_len", Optional[int], _opt(None, "--seq-len", help="tokens per sequence")),
    ("dtype", Optional[str], _opt(None, "--dtype", help="fp32 | bf16 | fp16")),
    ("ac", Optional[str], _opt(None, "--ac", help="activation checkpointing: none | selective | full")),
    ("compile", Optional[bool], _opt(None, "--compile/--no-compile", help="torch.compile each block")),
    ("dp_replicate", Optional[int], _opt(None, "--dp-replicate", help="data-parallel replicas")),
    ("dp_shard", Optional[int], _opt(None, "--dp-shard", help="data-parallel shards (FSDP / ZeRO)")),
    ("tp", Optional[int], _opt(None, "--tp", help="tensor-parallel degree")),
    ("pp", Optional[int], _opt(None, "--pp", help="pipeline-parallel degree")),
    ("cp", Optional[int], _opt(None, "--cp", help="context-parallel degree")),
    ("sp", Optional[bool], _opt(None, "--sp/--no-sp", help="sequence parallel (with tp)")),
    ("cp_impl", Optional[str], _opt(None, "--cp-impl", help="ring | ulysses")),
    ("pp_schedule", Optional[str], _opt(None, "--pp-schedule", help="gpipe | 1f1b | interleaved-1f1b | zero-bubble")),
    ("microbatches", Optional[int], _opt(None, "--microbatches", help="pipeline micro-batches per step")),
    ("virtual_stages", Optional[int], _opt(None, "--virtual-stages", help="pipeline stages per rank")),
    ("ddp_comm_hook", Optional[str], _opt(None, "--ddp-comm-hook", help="none | bf16 | fp16 | powersgd")),
    ("local_sgd_period", Optional[int], _opt(None, "--local-sgd-period", help="average models every N steps")),
    ("cpu_offload", Optional[bool], _opt(None, "--cpu-offload/--no-cpu-offload", help="FSDP CPU offload")),
    ("lr", Optional[float], _opt(None, "--lr", help="peak learning rate")),
    ("ckpt_dir", Optional[str], _opt(None, "--ckpt-dir", help="checkpoint directory (default RUNDIR/checkpoints)")),
    ("ckpt_every", Optional[int], _opt(None, "--ckpt-every", help="save every N steps (0: never)")),
    ("resume", Optional[str], _opt(None, "--resume", help="auto | never | PATH")),
    ("out", Optional[str], _opt(None, "--out", help="run directory (default runs/TIME-STRATEGY)")),
    ("seed", Optional[int], _opt(None, "--seed", help="seed for weights and data")),
    ("data", Optional[str], _opt(None, "--data", help="synthetic | PATH (.bin tokens or a text file)")),
    ("timeout_s", Optional[float], _opt(None, "--timeout-s", help="collective timeout in seconds")),
    ("max_restarts", Optional[int], _opt(None, "--max-restarts", help="elastic restarts after a failure")),
    ("metrics", Optional[bool], _opt(None, "--metrics/--no-metrics", help="write RUNDIR/metrics.jsonl")),
]
TRAIN_KEYS = [name for name, _, _ in TRAIN_OPTIONS]


def with_train_options(func):
    """Give a command every train option; they arrive as one dict in the `train_opts` argument."""
    sig = inspect.signature(func)
    own = [p for p in sig.parameters.values() if p.name != "train_opts"]
    taken = {p.name for p in own}
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a)
             for n, a, d in TRAIN_OPTIONS if n not in taken]

    @functools.wraps(func)
    def wrapper(**kwargs):
        opts = {k: kwargs.pop(k) for k in TRAIN_KEYS if k in kwargs and k not in taken}
        return func(**kwargs, train_opts=opts)

    wrapper.__signature__ = sig.replace(parameters=own + extra)
    return wrapper


def resolve_config(opts: dict, **forced):
    from paratrain.config import load_config

    overrides = {k: v for k, v in opts.items() if k != "config"}
    overrides.update({k: v for k, v in forced.items() if v is not None})
    return load_config(str(opts["config"]) if opts.get("config") else None, overrides)


def setup_cli_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="paratrain: %(message)s", stream=sys.stderr, force=True)


# -- train ---------------------------------------------------------------------------------------------------------
@app.command()
@with_train_options
def train(print_config: bool = typer.Option(False, "--print-config", help="print the resolved config as TOML"),
          as_json: bool = typer.Option(False, "--json", help="print a JSON summary on stdout"),
          train_opts: dict = None):
    """Train a model on N devices with any strategy."""
    setup_cli_logging()
    cfg = resolve_config(train_opts)
    if print_config:
        sys.stdout.write(cfg.to_toml())
        return
    from paratrain.train.launch import run_workers
    from paratrain.train.validate import validate_run, world_size_for
    from paratrain.train.worker import train_worker

    if cfg.strategy == "auto":
        from paratrain.plan.auto import resolve_auto_strategy

        cfg = resolve_auto_strategy(cfg)
    world = world_size_for(cfg)
    validate_run(cfg, world)
    run_dir = Path(cfg.out) if cfg.out else Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.strategy}"
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(cfg.to_toml())
    except OSError as exc:
        raise UserError(f"cannot create run directory {run_dir}: {exc.strerror or exc}") from None
    try:
        results = run_workers(train_worker, (cfg.model_dump(), str(run_dir), False), world, cfg.max_restarts,
                              cfg.timeout_s)
    except UserError:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    summary = results.get(0)
    if summary is None:
        raise CheckFailed("rank 0 returned no summary")
    floor = summary.get("loss_floor")
    vs = f" against a floor of {floor:.4f}" if floor is not None else ""
    mfu = f", MFU {summary['mfu']:.1%}" if summary.get("mfu") is not None else ", MFU n/a (no known peak for this device)"
    log.info("done: %d steps, loss %.4f%s, %.0f tokens/s%s; run dir %s", summary["steps"], summary["final_loss"], vs,
             summary["tokens_per_s"], mfu, run_dir)
    if as_json:
        emit_json({k: v for k, v in summary.items() if k != "losses"})


# -- verify --------------------------------------------------------------------------------------------------------
@app.command()
@with_train_options
def verify(steps: int = typer.Option(5, "--steps", help="optimizer steps to compare"),
           as_json: bool = typer.Option(False, "--json", help="print the JSON report on stdout"),
           train_opts: dict = None):
    """Prove a parallel run matches a single-device run (loss, gradients, parameters)."""
    setup_cli_logging()
    cfg = resolve_config(train_opts, steps=steps)
    from paratrain.bench.verify import verify_worker
    from paratrain.train.launch import run_workers
    from paratrain.train.validate import validate_run, world_size_for

    world = world_size_for(cfg)
    validate_run(cfg, world)
    result = run_workers(verify_worker, (cfg.model_dump(), None), world, 0, cfg.timeout_s).get(0)
    if result is None:
        raise CheckFailed("rank 0 returned no verify result")
    verdict = "PASSED" if result["passed"] else "FAILED"
    log.info("verify %s (%s, world %d, %d steps, %s): max loss diff %.2e, max grad rel diff %.2e, "
             "max param diff %.2e", verdict, result["strategy"], result["world_size"], result["steps"],
             result["dtype"], result["max_loss_abs_diff"], result["max_grad_rel_diff"], result["max_param_abs_diff"])
    if as_json:
        emit_json(result)
    if not result["passed"]:
        raise typer.Exit(1)


# -- env -----------------------------------------------------------------------------------------------------------
@app.command()
def env(as_json: bool = typer.Option(False, "--json", help="print JSON on stdout")):
    """Versions, devices, backends and topology, for bug reports."""
    from paratrain.env_report import collect_env

    report = collect_env()
    if as_json:
        emit_json(report)
    else:
        for key, value in report.items():
            sys.stderr.write(f"{key:>18}: {value}\n")


# -- entry point ---------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="paratrain", standalone_mode=False)
    except UserError as exc:
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(2)
    except CheckFailed as exc:
        sys.stderr.write(f"failed: {exc}\n")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except Exception as exc:
        # click/typer usage errors (vendored or not) carry format_message() and exit_code
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            sys.stderr.write(f"error: {exc.format_message()}\n")
            sys.exit(exc.exit_code if exc.exit_code else 2)
        if type(exc).__name__ in ("Exit", "Abort") and hasattr(exc, "exit_code"):
            sys.exit(exc.exit_code)
        raise
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
