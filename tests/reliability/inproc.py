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


def run_cli_inproc(argv: list[str], cwd=None) -> tuple[int, str, str]:
    """`paratrain ARGV` in this process (fast: no interpreter start): (exit code, stdout, stderr).

    os.environ and the working directory are restored afterwards (a lone run sets RANK/WORLD_SIZE). The
    CLI's logging is set up at call time on the sys.stderr of the moment, so it lands in the capture."""
    import contextlib
    import io

    from paratrain import cli

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
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
    return code, out.getvalue(), err.getvalue()
