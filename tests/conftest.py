"""Shared fixtures. Helpers live in tests/helpers.py (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# One intra-op thread per process, as CI exports and as helpers.cli_env gives a subprocess: set before torch is
# imported. Two workers share two cores; a second thread per process only spins against the other worker
# (measured: the suite on two workers took 555 s so, 595 to 625 s with torch's default of one thread per core).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from groups import APPROX_RUNS, APPROX_STEPS, VERIFY, launch
from helpers import CLIResult, run_cli

__all__ = ["CLIResult", "run_cli"]


@pytest.fixture
def cli(tmp_path):
    """run_cli with the working directory set to a fresh temporary folder."""

    def _run(*args: str, timeout: float = 240, env: dict | None = None) -> CLIResult:
        return run_cli(*args, timeout=timeout, cwd=str(tmp_path), env=env)

    return _run


@dataclass
class RanksResult(CLIResult):
    """A cli_here(..., ranks=True) call's result: stderr holds each rank's output (rank by rank) before this
    process's own; rank_pids: every rank process the run started."""

    rank_pids: list[int] = field(default_factory=list)


@pytest.fixture
def cli_here(tmp_path):
    """The `cli` fixture's calls in this process (reliability/inproc.py's run_cli_inproc, cwd = tmp_path, `env` added
    for the call): no interpreter or torch start, and --nproc > 1 workers fork from the session's warm
    forkserver. A --nproc 1 run runs here, so its log is in stderr; a worker process's own output is not, unless
    ranks=True (support/rank_output.py): then a RanksResult, with the ranks' output ahead of this process's."""
    from reliability.inproc import run_cli_inproc
    from support import rank_output

    def _run(*args: str, timeout: float | None = None, env: dict | None = None, ranks: bool = False) -> CLIResult:
        if not ranks:
            return CLIResult(*run_cli_inproc(list(args), cwd=tmp_path, env=env))  # the test's own timeout bounds it
        with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
            plugins = ",".join(filter(None, [(env or {}).get("PARATRAIN_PLUGINS"), "support.rank_output:plugin"]))
            env = {**(env or {}), "PARATRAIN_PLUGINS": plugins, rank_output.OUTPUT_ENV: folder}
            code, out, err = run_cli_inproc(list(args), cwd=tmp_path, env=env)
            return RanksResult(code, out, rank_output.rank_logs(Path(folder)) + err,
                               rank_output.rank_pids(Path(folder)))

    return _run


@pytest.fixture
def cli_inproc(tmp_path, monkeypatch, capsys):
    """paratrain's main() in this process, cwd = tmp_path: no interpreter start, so fast. Only for inputs
    refused before any worker starts (a valid `train` would run here)."""
    from paratrain.cli import main

    monkeypatch.chdir(tmp_path)
    # as a user's shell: no launcher's variables (an in-process run earlier in the session may leave RANK /
    # WORLD_SIZE set, and then the CLI would take itself for one rank of a torchrun job)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)

    def _run(*args: str) -> CLIResult:
        with pytest.raises(SystemExit) as exc:
            main(list(args))
        out = capsys.readouterr()
        return CLIResult(exc.value.code, out.out, out.err)

    return _run


# -- the shared process groups of groups.py --------------------------------------------------------------------
@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zero1-ckpt")


@pytest.fixture(scope="session")
def eval_ckpts(tmp_path_factory):
    """tests/infer/eval_worker.py's checkpoints: saved by the 2-rank group, evaluated by both groups."""
    return tmp_path_factory.mktemp("eval-ckpts")


@pytest.fixture(scope="session")
def generate_ckpts(tmp_path_factory):
    """tests/infer/generate_worker.py's checkpoints: trained by the 2-rank group, generated from by both groups."""
    return tmp_path_factory.mktemp("generate-ckpts")


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory, ckpt_dir, eval_ckpts, generate_ckpts):
    spec = {"verify": VERIFY[2], "comm": True, "ckpt_save": str(ckpt_dir),
            "approx": {"steps": APPROX_STEPS, "runs": APPROX_RUNS},
            # the 2-rank checks of tests/parallel's pipeline_checks.py, uneven_worker.py, tp_parity_worker.py and
            # tests/train's val_worker.py, reshard_worker.py
            "pipeline": {"ckpt_dir": str(tmp_path_factory.mktemp("pp-ckpt"))}, "uneven": True, "tp_parity": True,
            "validation": True, "reshard": str(tmp_path_factory.mktemp("reshard")),
            "kv_cache": True,  # tests/infer/kv_cache_worker.py's
            "infer_eval": str(eval_ckpts),  # tests/infer/eval_worker.py's
            "generate": str(generate_ckpts)}  # tests/infer/generate_worker.py's
    return launch(2, spec, tmp_path_factory.mktemp("dp2"), timeout=500)


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory, two_ranks, ckpt_dir, eval_ckpts, generate_ckpts):
    spec = {"verify": VERIFY[4], "ckpt_load": str(ckpt_dir), "pipeline": {"ckpt_dir": None}, "cp_parity": True,
            "moe": True,  # tests/moe/moe_worker.py's checks
            "semi_sync": str(tmp_path_factory.mktemp("semi-sync")),  # tests/parallel/semi_sync_worker.py's
            "infer_eval": str(eval_ckpts),  # tests/infer/eval_worker.py's (the 2-rank group's checkpoint)
            "generate": str(generate_ckpts)}  # tests/infer/generate_worker.py's (the 2-rank group's checkpoints)
    return launch(4, spec, tmp_path_factory.mktemp("dp4"), timeout=500)



@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test starts from the session's environment: an in-process run (cli_here, a one-rank runtime) may leave a
    launcher's RANK / WORLD_SIZE behind, and with two workers the next test on that worker is anyone's."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


# -- two pytest workers (pytest-xdist; pyproject's addopts: -n 2) ---------------------------------------------------
# a test file that names one of these reads the shared 2- and 4-rank groups (groups.py)
SHARED_GROUP_FIXTURES = re.compile(r"\b(two_ranks|four_ranks|eval_ckpts|generate_ckpts)\b")


@functools.cache
def reads_shared_groups(path: Path) -> bool:
    return path.suffix == ".py" and bool(SHARED_GROUP_FIXTURES.search(path.read_text()))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole files to a worker (a file's module fixtures built once), and every file that reads the shared groups
    to one worker, as one unit scheduled first (the largest): the groups launch once on each worker that asks for
    them, and they are the suite's longest setup. (xdist's --dist loadgroup marks are lost under pytest 9.2, which
    no longer reads the node id xdist rewrites.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SharedGroupsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "shared-groups" if reads_shared_groups(config.rootpath / path) else path

    return SharedGroupsTogether(config, log)


# -- tests that measure shares of a step run alone: nothing else of this suite beside them ------------------------
# Under -n 2 every test holds a shared lock while it runs (setup, call, teardown: a shared group's launch too) and
# an `alone` test an exclusive one, so the doctor's and the monitor's findings are taken on a machine that this
# suite does not load with a second worker (they must still hold beside other programs: two `yes` in the README's
# check). A turnstile stops the other worker's next test from slipping in ahead of a waiting alone test.
def _suite_lock_paths() -> list[Path]:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = Path(tempfile.gettempdir()) / f"paratrain-suite-{run}"
    return [Path(f"{base}.{name}") for name in ("turnstile", "lock")] if run else []


@functools.cache
def _suite_locks() -> tuple[int, int] | None:
    paths = _suite_lock_paths()
    return tuple(os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in paths) if paths else None


def pytest_sessionfinish(session):
    """A worker done with its tests removes the lock files (the other worker keeps the ones it holds open)."""
    for path in _suite_lock_paths():
        path.unlink(missing_ok=True)


def _alone(item) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


_exclusive_held = False  # kept from one alone test to the next on this worker: one wait per run of them, not each


@contextlib.contextmanager
def _suite_lock(item, nextitem):
    global _exclusive_held
    locks = _suite_locks()
    if locks is None:
        yield
        return
    turnstile, lock = locks
    if not _exclusive_held:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if _alone(item) else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        _exclusive_held = _alone(item)
    try:
        yield
    finally:
        if not (_exclusive_held and _alone(nextitem)):
            fcntl.flock(lock, fcntl.LOCK_UN)
            _exclusive_held = False


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Outside pytest-timeout's timer (tryfirst: the outer wrapper): a wait for the other worker is not the test's."""
    with _suite_lock(item, nextitem):
        yield
