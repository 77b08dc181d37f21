"""Start N local worker processes through torch elastic, or run inline when already launched.

Single-node runs host one TCPStore in this process on a socket bound to 127.0.0.1; the elastic agent
rendezvouses on it and the workers build their process group on it too, so nothing listens on an external
interface (c10d's TCPStore has no authentication, see docs/security.md).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from paratrain.errors import CheckFailed, UserError
from paratrain.train.rendezvous import STORE_ENV, in_launched_process, loopback_interface

log = logging.getLogger("paratrain")

PRELOAD = ("torch", "torch.distributed", "paratrain.train.trainer", "paratrain.train.worker")
_NO_ERROR_FILE = "<N/A>"  # torch elastic's ProcessFailure.error_file when the process wrote none


def _loopback_store(timeout_s: float):
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=sock.fileno(), wait_for_workers=False,
                          multi_tenant=True, timeout=timedelta(seconds=max(timeout_s, 30)))
    return store, sock, port


def _worker_env(port: int) -> dict[str, str | None]:
    """What each worker's environment must hold (None: unset), whatever the forkserver inherited."""
    env: dict[str, str | None] = {STORE_ENV: f"127.0.0.1:{port}"}
    lo = loopback_interface()
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env[var] = os.environ.get(var) or lo
    for var in [k for k in os.environ if k.startswith("PARATRAIN_")]:
        env.setdefault(var, os.environ.get(var))
    return env


def _run_with_env(env: dict, entry: Callable, *args):
    """Worker-side: apply `env`, name the process after its rank (`ps` would show the forkserver's name), then
    run the entry (a picklable stand-in for a closure)."""
    from paratrain.train.process_control import name_rank_process

    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    name_rank_process(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    return entry(*args)


def _forkserver_context():
    """Workers fork from one server that imported torch and paratrain once: a start, and every elastic
    restart, skips the multi-second import in each worker."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


@contextmanager
def _launch_env():
    """Environment for the elastic agent, restored afterwards."""
    # otherwise the agent starts a second store on all interfaces and reuses it across restarts
    wanted = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_workers(entry: Callable, args: tuple, nproc: int, max_restarts: int = 0, timeout_s: float = 60.0,
                hang_dir: str | None = None) -> dict:
    """Run entry(*args) on nproc local ranks; returns {rank: return value}.

    `hang_dir`: where the workers' flight recorders write (train/recovery/flight_recorder.py); on a failure the last
    line names the rank that stalled or died, read from there (train/recovery/hang_report.py), and the CheckFailed raised
    carries that rank and the last completed step. A restart (max_restarts) is announced in one line
    (train/recovery/restart_report.py); orphans of a dead rank and a rank stopped by SIGSTOP are killed
    (train/process_control.py).

    Already inside torchrun/srun (RANK and WORLD_SIZE set): run entry once, in this process.
    PARATRAIN_PLUGINS (train/hooks.py) is loaded here first, so a bad entry fails in this process, in one line,
    before any worker starts; each worker loads it again for itself.
    """
    from paratrain.train.hooks import default_hooks

    default_hooks()
    if in_launched_process():
        return {int(os.environ["RANK"]): entry(*args)}
    if nproc == 1 and max_restarts == 0:
        return {0: entry(*args)}
    from multiprocessing import forkserver

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from paratrain.train.process_control import LaunchWatch
    from paratrain.train.recovery import restart_report

    store, sock, port = _loopback_store(timeout_s)
    _forkserver_context()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:12],
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}",
                          rdzv_configs={"is_host": False, "timeout": int(max(timeout_s, 30))},
                          max_restarts=max_restarts, monitor_interval=0.1, start_method="forkserver",
                          local_addr="127.0.0.1")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    noisy = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn")]
    levels = [logger.level for logger in noisy]
    debug = bool(os.environ.get("PARATRAIN_DEBUG"))
    if not debug:
        # a failure report is a full traceback per rank; we print one line from it instead
        for logger in noisy:
            logger.setLevel(logging.CRITICAL)
    hang_path = Path(hang_dir) if hang_dir else None
    reporter = restart_report.RestartReporter(hang_path, max_restarts)
    routed = restart_report.attach(reporter, quiet_others=not debug)
    watch = LaunchWatch(hang_path)
    try:
        with _launch_env():
            # started here (the resource tracker with it), in the environment it always had, so LaunchWatch knows
            # both before it takes a new child of this process for an orphan
            forkserver.ensure_running()
            with watch:
                return elastic_launch(config, _run_with_env)(_worker_env(port), entry, *args)
    except ChildFailedError as exc:
        raise _run_failure(exc, hang_path, watch.stopped_ranks) from None
    finally:
        restart_report.detach(reporter, routed)
        for logger, level in zip(noisy, levels):
            logger.setLevel(level)
        del store, sock  # the store owns the listening socket's fd from here on


def _run_failure(exc, hang_dir: Path | None, stopped: set[int]) -> CheckFailed:
    """One line: the culprit first (who stalled or died, read from the flight recorders), then what the first
    failed rank saw; with the culprit's rank and the run's last completed step."""
    from paratrain.train.recovery.hang_report import hang_verdict

    summary = _summarise_failure(exc)
    # a rank the launcher killed because it was stopped did not die: its peers' records say where it stalled
    exits = {rank: None if rank in stopped else failure.exitcode for rank, failure in exc.failures.items()}
    culprit, rank, step = hang_verdict(hang_dir, exits)
    if rank is None:
        rank = exc.get_first_failure()[0]
    # "rank 1 died (SIGKILL; the others were in ...)" says all that "rank 1 died (SIGKILL)" would
    repeats = culprit is not None and culprit.startswith(summary.removesuffix(")"))
    line = f"{culprit} [{summary}]" if culprit and not repeats else culprit or summary
    return CheckFailed(line, rank=rank, step=step)


def _summarise_failure(exc) -> str:
    from paratrain.train.recovery.restart_report import exit_text

    rank, failure = exc.get_first_failure()
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", str(message))
    lines = [ln for ln in str(message).strip().splitlines() if ln.strip()]
    reason = lines[-1] if lines else ""
    kind, _, text = reason.partition(": ")
    if kind.endswith("UserError"):
        raise UserError(text) from None
    if kind.endswith("CollectiveFailure"):
        return text
    if failure.error_file == _NO_ERROR_FILE or not reason or "https://" in reason:
        # no exception recorded (torch's message is then a pointer to its docs): the exit is all we know
        if failure.exitcode is not None and failure.exitcode < 0:
            return f"rank {rank} died ({exit_text(failure.exitcode)})"
        reason = exit_text(failure.exitcode)
    return f"rank {rank} failed: {reason}"


def launched_run_name(strategy: str) -> str | None:
    """Under torchrun/srun, a run-dir name every rank (and every restart) derives alike; else None.

    A timestamp would differ between ranks that start a second apart, splitting one checkpoint across
    two directories, and a restart would not find the run it should resume.
    """
    if not in_launched_process():
        return None
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "none"
    if job == "none":
        job = os.environ.get("SLURM_JOB_ID") or "torchrun"
    return f"{job}-{strategy}"
