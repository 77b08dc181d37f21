"""An in-process one-rank trainer for the reliability tests (fast: no process spawn)."""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def one_rank():
    """A world-1 process group in this process; os.environ is restored afterwards."""
    from paratrain.train.runtime import init_runtime, shutdown

    saved = dict(os.environ)
    try:
        yield init_runtime("cpu", 60)
    finally:
        shutdown()
        os.environ.clear()
        os.environ.update(saved)


def tiny_config(**overrides):
    from paratrain.config import TrainConfig

    base = dict(
        model="tiny",
        strategy="single",
        nproc=1,
        device="cpu",
        steps=4,
        seq_len=32,
        global_batch=4,
        metrics=False,
        timeout_s=60,
    )
    return TrainConfig(**{**base, **overrides})


def make_trainer(rt, **overrides):
    from paratrain.train.trainer import Trainer

    return Trainer(tiny_config(**overrides), rt, None, quiet=True)


# Imported once by the suite's forkserver besides the launcher's PRELOAD: a transformers model's modules take
# seconds to import, in every rank of every launch that builds one (tests/models, tests/interop, the hf cases of
# tests/moe and tests/data, the README tour); the other model families then import in milliseconds. Skipped
# where transformers is not installed (the forkserver ignores a preload that does not import).
SUITE_PRELOAD = ("transformers.models.llama.modeling_llama",)


def start_clean_forkserver() -> None:
    """Start this process's worker forkserver (if it is not running) from an environment without PARATRAIN_*
    variables, with SUITE_PRELOAD imported too. Workers fork from it and inherit its environment; the launcher
    passes the caller's PARATRAIN_* variables to each worker, but cannot unset one the server kept, so a server
    started under a test's plugin would load that plugin into every later in-process run."""
    import multiprocessing
    from multiprocessing import forkserver

    from paratrain.train.launch import PRELOAD

    saved = dict(os.environ)
    try:
        for var in [k for k in os.environ if k.startswith("PARATRAIN_")]:
            del os.environ[var]
        os.environ["OMP_NUM_THREADS"] = "1"  # as helpers.cli_env gives a subprocess
        multiprocessing.get_context("forkserver").set_forkserver_preload([*PRELOAD, *SUITE_PRELOAD])
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def launch_here(entry, args: tuple, nproc: int, timeout_s: float = 120.0):
    """entry(*args) on `nproc` ranks forked from this process's forkserver (train/launch.py's run_workers): the
    ranks skip the interpreter and torch start a torchrun launch pays per rank. Rank 0's return value. The entry
    must be importable by its module name (the ranks get this process's sys.path)."""
    from paratrain.train.launch import run_workers

    start_clean_forkserver()
    saved = dict(os.environ)
    try:
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(var, None)
        return run_workers(entry, args, nproc, 0, timeout_s)[0]
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_cli_inproc(argv: list[str], cwd=None, env: dict | None = None) -> tuple[int, str, str]:
    """`paratrain ARGV` in this process (fast: no interpreter start): (exit code, stdout, stderr).

    os.environ and the working directory are restored afterwards (a lone run sets RANK/WORLD_SIZE); `env` is
    added for the call (e.g. helpers.plugin_env's plugins and their settings). The CLI's logging is set up at
    call time on the sys.stderr of the moment, so it lands in the capture. Worker processes (--nproc > 1) fork
    from a forkserver that outlives the call: what they print is not captured, only what this process prints
    (the JSON summary, the last line of a failure)."""
    import contextlib
    import io

    from paratrain import cli

    start_clean_forkserver()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    os.environ.update(env or {})
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main([str(a) for a in argv])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        if env:  # drop the plugins this call loaded here: the next call loads its own, with its own settings
            from paratrain.train.hooks import default_hooks

            default_hooks()
    return code, out.getvalue(), err.getvalue()
