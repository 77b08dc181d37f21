"""Issue 37: the job `paratrain launch slurm --device cpu` writes runs under a real Slurm (Debian's slurm-wlm).

A one-node cluster on this machine, started as root by the fixture: munged (its own key and socket), slurmctld
and slurmd with a minimal slurm.conf, every state file in tmp. The test submits the generated job with
`sbatch --wait` and checks that training finished (metrics to step 5, the trainer's closing line). Every process of the cluster (the daemons, and any job step
left over) is ended when the test ends, pass or fail. Without Slurm the test says so and skips, except under
CI=true, where .ci/run installs Slurm and a missing one is a failure."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reliability.inproc import run_cli_inproc

DAEMONS = ("munged", "slurmctld", "slurmd")
SEARCH = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"  # the daemons live in sbin


def _tool(name: str) -> str:
    return shutil.which(name, path=SEARCH) or name


def _need_slurm() -> None:
    missing = [d for d in (*DAEMONS, "sbatch", "sinfo", "scancel") if shutil.which(d, path=SEARCH) is None]
    if not missing:
        if os.geteuid() != 0:
            pytest.skip("the one-node Slurm cluster is started as root (SlurmUser=root)")
        return
    reason = f"Slurm not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    assert os.environ.get("CI") != "true", f"under CI the real-Slurm test must run: {reason}"
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(root: Path, munge_socket: Path, cpus: int) -> str:
    return "\n".join([
        "ClusterName=paratrain-test",
        "SlurmctldHost=localhost",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",  # the node's CPUs as written, even on a smaller machine
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def _ours(conf: Path) -> list[int]:
    """Every process started with this cluster's SLURM_CONF in its environment: the daemons, the job steps
    slurmd forked, and what the job ran."""
    mark = f"SLURM_CONF={conf}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _end(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_for(check, timeout: float, what: str, logs) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout:g} s\n{logs()}")


@pytest.fixture
def slurm_cluster(tmp_path):
    """A running one-node cluster: yields the environment for its client commands (SLURM_CONF set)."""
    _need_slurm()
    root = tmp_path / "slurm"
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir(parents=True)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    munge_socket = root / "munge" / "munge.socket"
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, munge_socket, max(2, os.cpu_count() or 1)))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID"):
        env.pop(var, None)

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(root.glob("*.log")))

    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen(
            [_tool("munged"), "-F", "--force", f"--key-file={key}", f"--socket={munge_socket}",
             f"--pid-file={root / 'munge' / 'munged.pid'}", f"--seed-file={root / 'munge' / 'seed'}",
             f"--log-file={root / 'munged.log'}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_for(munge_socket.exists, 10, "munged did not open its socket", logs)
        procs.append(subprocess.Popen([_tool("slurmctld"), "-D", "-c", "-i", "-f", str(conf)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen([_tool("slurmd"), "-D", "-N", "localhost", "-f", str(conf)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def node_idle() -> bool:
            done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
            return done.returncode == 0 and done.stdout.strip() == "idle"

        _wait_for(node_idle, 30, "the Slurm node did not come up idle", logs)
        yield SimpleCluster(env, logs)
    finally:
        try:
            subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass  # the daemons are ended below all the same
        for sig in (signal.SIGTERM, signal.SIGKILL):
            _end([p.pid for p in procs if p.poll() is None] + _ours(conf), sig)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (any(p.poll() is None for p in procs) or _ours(conf)):
                time.sleep(0.1)
        left = [p.pid for p in procs if p.poll() is None] + _ours(conf)
        assert not left, f"Slurm processes still running after the test: {left}"


class SimpleCluster:
    def __init__(self, env: dict, logs):
        self.env, self.logs = env, logs


@pytest.mark.timeout(150)
def test_generated_cpu_job_trains_under_real_slurm(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    code, _out, err = run_cli_inproc(
        ["launch", "slurm", "--nodes", "1", "--gpus-per-node", "2", "--device", "cpu", "--model", "tiny",
         "--steps", "5", "-o", str(tmp_path / "job.sh"),  # docs/launch.md's command; then a private port and dir
         "--timeout-s", "60", "--port", str(_free_port()), "--out", str(run_dir)], cwd=tmp_path)
    assert code == 0, err
    # the job's `python` is this interpreter (sbatch passes the submitter's environment on)
    env = {**slurm_cluster.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["sbatch", "--wait", "job.sh"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    outputs = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("paratrain-ddp-*.out"))
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{outputs}\n{slurm_cluster.logs()}"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps][-1] == 5, steps
    assert "done: 5 steps" in outputs, outputs
