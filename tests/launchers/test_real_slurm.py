"""Issue 37: the jobs `paratrain launch slurm --device cpu` writes run under a real Slurm (Debian's slurm-wlm).

A one-node cluster on this machine, started as root by a module fixture shared by two tests: munged (its own
key and socket), slurmctld and slurmd with a minimal slurm.conf, every state file in tmp. One test submits the
generated job with `sbatch`, waits for its end (polling its state) and checks that training finished; another signals a job mid-run
(`scancel --signal=USR1 --batch`, what --signal=B:USR1@120 sends before the time limit) and checks that it
checkpoints, requeues itself and resumes to the uninterrupted run's losses. A two-node cluster (one slurmd in
each of two network namespaces) runs a `--nodes 2` job, one rank per node, to the one-node job's losses. Every process of a cluster (the
daemons, and any job step left over) is ended when its tests end, pass or fail. Without Slurm the tests say so
and skip, except under CI=true, where .ci/run installs Slurm and a missing one is a failure."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import plugin_env
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


def _slurm_conf(root: Path, munge_socket: Path, nodes: list[tuple[str, str, int]], controller: str = "localhost",
                ports: tuple[int, int] | None = None) -> str:
    """`nodes`: (name, address, CPUs) each; `controller`: SlurmctldHost's value."""
    ctl_port, node_port = ports or (_free_port(), _free_port())
    return "\n".join([
        "ClusterName=paratrain-test",
        f"SlurmctldHost={controller}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"SlurmctldPort={ctl_port}",
        f"SlurmdPort={node_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket},cred_expire=5",  # a requeued job waits this long (default 120 s)
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=1,bf_interval=1",  # a requeued job starts once eligible
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",  # the node's CPUs as written, even on a smaller machine
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        *[f"NodeName={name} NodeAddr={addr} CPUs={cpus} State=UNKNOWN" for name, addr, cpus in nodes],
        f"PartitionName=debug Nodes={','.join(n[0] for n in nodes)} Default=YES MaxTime=INFINITE State=UP",
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


def _cluster(root: Path, nodes: list[tuple[str, str, int]], controller: str = "localhost",
             inside=lambda node: [], ports=None):
    """Start munged, slurmctld (on the first node) and one slurmd per node; yield a SimpleCluster; end them all.
    `inside(node)`: the command prefix that runs a program on that node (its network namespace)."""
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    munge_socket = root / "munge" / "munge.socket"
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, munge_socket, nodes, controller, ports))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID"):
        env.pop(var, None)

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(root.glob("*.log")))

    def start(cmd: list[str]) -> None:
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    procs: list[subprocess.Popen] = []
    cluster = SimpleCluster(env, logs, inside(nodes[0][0]))
    try:
        start([_tool("munged"), "-F", "--force", f"--key-file={key}", f"--socket={munge_socket}",
               f"--pid-file={root / 'munge' / 'munged.pid'}", f"--seed-file={root / 'munge' / 'seed'}",
               f"--log-file={root / 'munged.log'}"])
        _wait_for(munge_socket.exists, 10, "munged did not open its socket", logs)
        start([*inside(nodes[0][0]), _tool("slurmctld"), "-D", "-c", "-i", "-f", str(conf)])
        for name, _, _ in nodes:
            start([*inside(name), _tool("slurmd"), "-D", "-N", name, "-f", str(conf)])

        def nodes_idle() -> bool:
            done = subprocess.run(cluster.cmd("sinfo", "-h", "-N", "-o", "%T"), env=env, capture_output=True,
                                  text=True)
            return done.returncode == 0 and done.stdout.split() == ["idle"] * len(nodes)

        _wait_for(nodes_idle, 30, "the Slurm nodes did not come up idle", logs)
        yield cluster
    finally:
        try:
            subprocess.run(cluster.cmd("scancel", "--full", "--user=root"), env=env, capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass  # the daemons are ended below all the same
        for sig in (signal.SIGTERM, signal.SIGKILL):
            _end([p.pid for p in procs if p.poll() is None] + _ours(conf), sig)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (any(p.poll() is None for p in procs) or _ours(conf)):
                time.sleep(0.1)
        left = [p.pid for p in procs if p.poll() is None] + _ours(conf)
        assert not left, f"Slurm processes still running after the test: {left}"


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A running one-node cluster, shared by this module's tests."""
    _need_slurm()
    yield from _cluster(tmp_path_factory.mktemp("slurm"), [("localhost", "127.0.0.1", max(2, os.cpu_count() or 1))])


class SimpleCluster:
    def __init__(self, env: dict, logs, prefix: list[str]):
        self.env, self.logs, self.prefix = env, logs, prefix

    def cmd(self, *args: str) -> list[str]:
        """A client command (sbatch, scontrol, ...) as run where the controller is reachable."""
        return [*self.prefix, *args]


STEPS = 8


def _write_job(where: Path, run_dir: Path) -> None:
    code, _out, err = run_cli_inproc(
        ["launch", "slurm", "--nodes", "1", "--gpus-per-node", "2", "--device", "cpu", "--model", "tiny",
         "--steps", str(STEPS), "-o", str(where / "job.sh"),  # docs/launch.md's command; a private port and dir
         "--timeout-s", "60", "--port", str(_free_port()), "--out", str(run_dir)], cwd=where)
    assert code == 0, err


def _job_env(cluster, **extra: str) -> dict:
    # the job's `python` is this interpreter (sbatch passes the submitter's environment on)
    return {**cluster.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            **extra}


def _outputs(where: Path) -> str:
    return "\n".join(p.read_text()[-4000:] for p in where.glob("paratrain-ddp-*.out"))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _submit(cluster, where: Path, env: dict) -> str:
    submitted = subprocess.run(cluster.cmd("sbatch", "--parsable", "job.sh"), cwd=where, env=env, capture_output=True,
                               text=True, timeout=30)
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def _run_to_end(cluster, where: Path, env: dict, timeout: float) -> None:
    """sbatch job.sh and wait for it to end, which must be with exit 0. Not `sbatch --wait`: it polls after 2, 10
    and 42 s, so a job that takes 11 s on a loaded machine held the test for 42."""
    job_id = _submit(cluster, where, env)
    _wait_for(lambda: _finished(cluster, job_id), timeout, "the job did not end",
              lambda: _outputs(where) + cluster.logs())
    state = _job_state(cluster, job_id)
    assert (state["JobState"], state.get("ExitCode")) == ("COMPLETED", "0:0"), \
        f"{state}\n{_outputs(where)}\n{cluster.logs()}"


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory):
    """The generated job, run to its end under Slurm: (its directory, the per-step losses)."""
    where = tmp_path_factory.mktemp("uninterrupted")
    run_dir = where / "run"
    _write_job(where, run_dir)
    _run_to_end(slurm_cluster, where, _job_env(slurm_cluster), timeout=120)
    return where, [s["loss"] for s in _metrics(run_dir)]


@pytest.mark.timeout(150)
def test_generated_cpu_job_trains_under_real_slurm(uninterrupted):
    where, losses = uninterrupted
    assert len(losses) == STEPS, losses
    assert f"done: {STEPS} steps" in _outputs(where), _outputs(where)
    assert not (where / "run" / "preempted.json").exists()


def _job_state(cluster, job_id: str) -> dict:
    done = subprocess.run(cluster.cmd("scontrol", "show", "job", "-o", job_id), env=cluster.env, capture_output=True, text=True,
                          timeout=10)
    return dict(field.split("=", 1) for field in done.stdout.split() if "=" in field)


def _finished(cluster, job_id: str) -> bool:
    return _job_state(cluster, job_id).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


@pytest.mark.timeout(200)
def test_signal_checkpoints_requeues_and_resumes_to_the_same_losses(slurm_cluster, uninterrupted, tmp_path):
    """USR1 to the batch shell mid-run (what Slurm's --signal=B:USR1@120 sends before the time limit): the ranks
    checkpoint at one agreed step and stop, the job requeues itself, and the second run resumes from that
    checkpoint: its per-step losses are the uninterrupted run's."""
    run_dir = tmp_path / "run"
    _write_job(tmp_path, run_dir)
    slow = {**plugin_env("support.loader_delay:plugin"), "PARATRAIN_TEST_LOADER_DELAY_S": "0.3"}  # ~0.3 s a step
    job_id = _submit(slurm_cluster, tmp_path, _job_env(slurm_cluster, **slow))

    def trained(steps: int):
        return lambda: (run_dir / "metrics.jsonl").is_file() and len(_metrics(run_dir)) >= steps

    _wait_for(trained(3), 90, "the job did not reach step 3", lambda: _outputs(tmp_path) + slurm_cluster.logs())
    signalled = subprocess.run(slurm_cluster.cmd("scancel", "--signal=USR1", "--batch", job_id), env=slurm_cluster.env,
                               capture_output=True, text=True, timeout=10)
    assert signalled.returncode == 0, signalled.stderr

    _wait_for(lambda: _finished(slurm_cluster, job_id), 150, "the requeued job did not finish", lambda: _outputs(tmp_path) + slurm_cluster.logs())
    state, out = _job_state(slurm_cluster, job_id), _outputs(tmp_path)
    assert state["JobState"] == "COMPLETED" and state.get("Restarts") == "1", f"{state}\n{out}"
    stopped = [int(s) for s in re.findall(r"checkpoint \S+ at step (\d+)", out)]
    assert len(stopped) == 1 and 3 <= stopped[0] < STEPS, out  # stopped on the signal, before the end
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{stopped[0]}'}" in out, out
    assert f"done: {STEPS} steps" in out, out
    by_step = {}
    for record in _metrics(run_dir):  # the first run's steps, then the resumed run's from the checkpoint on
        by_step[record["step"]] = record["loss"]
    assert [by_step[i + 1] for i in range(STEPS)] == uninterrupted[1]


# -- two nodes: one slurmd in each of two network namespaces --------------------------------------------------------
def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    """Two Slurm nodes on this machine: network namespaces joined by a veth pair (as
    tests/reliability/test_two_nodes.py makes them), the interface named alike in both so one GLOO_SOCKET_IFNAME
    serves every node; each node's programs see their own /etc/hosts (a private mount namespace) naming both
    nodes and giving this machine's host name the node's own address. slurmctld and the first slurmd run in the
    first namespace, the second slurmd in the second; the namespaces are removed afterwards."""
    _need_slurm()
    missing = [t for t in ("ip", "unshare", "nsenter") if shutil.which(t, path=SEARCH) is None]
    if missing:
        pytest.skip(f"the two-node cluster needs {', '.join(missing)} (iproute2, util-linux)")
    root = tmp_path_factory.mktemp("slurm2")
    tag = f"pts{os.getpid() % 10000}"
    net = f"10.79.{os.getpid() % 200}"
    nodes = [(f"{tag}a", f"{net}.1", 2), (f"{tag}b", f"{net}.2", 2)]
    spaces = {name: f"{name}ns" for name, _, _ in nodes}
    host = socket.gethostname()
    setup = [("netns", "add", spaces[nodes[0][0]]), ("netns", "add", spaces[nodes[1][0]]),
             ("link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y")]
    for (name, addr, _), dev in zip(nodes, (f"{tag}x", f"{tag}y")):
        ns = spaces[name]
        setup += [("link", "set", dev, "netns", ns), ("-n", ns, "link", "set", dev, "name", IFNAME),
                  ("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME), ("-n", ns, "link", "set", IFNAME, "up"),
                  ("-n", ns, "link", "set", "lo", "up")]
        others = "".join(f"{a} {n}\n" for n, a, _ in nodes if n != name)
        (root / f"hosts-{name}").write_text(f"127.0.0.1 localhost\n{addr} {name} {host}\n{others}")

    def inside(name: str) -> list[str]:
        # sh -c SCRIPT HOSTS NETNS PROGRAM...: $0 is HOSTS, $1 the namespace, the rest the program
        return [_tool("unshare"), "-m", "sh", "-c",
                'mount --bind "$0" /etc/hosts && ns="$1" && shift && exec nsenter --net="$ns" "$@"',
                str(root / f"hosts-{name}"), f"/run/netns/{spaces[name]}"]

    try:
        for args in setup:
            done = _ip(*args)
            if done.returncode != 0:
                reason = f"cannot build the namespaces here: ip {' '.join(args)}: {done.stderr.strip()}"
                assert os.environ.get("CI") != "true", reason
                pytest.skip(reason)
        yield from _cluster(root, nodes, f"{host}({nodes[0][1]})", inside)
    finally:
        for ns in spaces.values():
            _ip("netns", "del", ns)


IFNAME = "ptslurm0"


@pytest.mark.timeout(200)
def test_two_node_job_matches_one_node(two_node_cluster, uninterrupted, tmp_path):
    """`launch slurm --nodes 2` across two slurmd, one rank on each: its losses equal the one-node job's two
    ranks' (the module's uninterrupted run), bit for bit."""
    run_dir = tmp_path / "run"
    code, _out, err = run_cli_inproc(
        ["launch", "slurm", "--nodes", "2", "--gpus-per-node", "1", "--device", "cpu", "--model", "tiny",
         "--steps", str(STEPS), "-o", str(tmp_path / "job.sh"), "--timeout-s", "60", "--port", str(_free_port()),
         "--out", str(run_dir)], cwd=tmp_path)
    assert code == 0, err
    _run_to_end(two_node_cluster, tmp_path, _job_env(two_node_cluster, GLOO_SOCKET_IFNAME=IFNAME), timeout=150)
    assert "on 2 x cpu" in _outputs(tmp_path) and f"done: {STEPS} steps" in _outputs(tmp_path), _outputs(tmp_path)
    assert [s["loss"] for s in _metrics(run_dir)] == uninterrupted[1]
