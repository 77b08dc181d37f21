"""Two nodes on one machine: two network namespaces joined by a veth pair, `paratrain train` started by
torchrun on each as 2 nodes x 2 processes with a c10d rendezvous on the veth address.

Reference: the same run as 1 node x 4 processes (our launcher). Losses must be exactly equal: the same
ranks hold the same data and gloo reduces in the same order, whatever network carries it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from helpers import cli_env
from reliability.inproc import run_cli_inproc

TRAIN = ["--steps", "5", "--seq-len", "32", "--global-batch", "8", "--timeout-s", "60", "--out", "{out}"]
PORT = 29417


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_namespaces():
    """[(netns, interface, address)] for node 0 and node 1; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("needs the `ip` command (iproute2)")
    tag = f"pt{os.getpid() % 100000}"
    nodes = [(f"{tag}n{i}", f"{tag}v{i}", f"10.77.{os.getpid() % 200}.{i + 1}") for i in range(2)]
    setup = [
        ("netns", "add", nodes[0][0]),
        ("netns", "add", nodes[1][0]),
        ("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1]),
    ]
    for ns, dev, addr in nodes:
        setup += [
            ("link", "set", dev, "netns", ns),
            ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
            ("-n", ns, "link", "set", dev, "up"),
            ("-n", ns, "link", "set", "lo", "up"),
        ]
    try:
        for args in setup:
            done = _ip(*args)
            if done.returncode != 0:
                pytest.skip(f"cannot build the namespaces here: ip {' '.join(args)}: {done.stderr.strip()}")
        yield nodes
    finally:
        for ns, _, _ in nodes:
            _ip("netns", "del", ns)


def losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.timeout(300)
def test_two_nodes_match_one_node(two_namespaces, tmp_path):
    head = two_namespaces[0][2]
    procs = []
    for rank, (ns, dev, addr) in enumerate(two_namespaces):
        cmd = [
            "ip",
            "netns",
            "exec",
            ns,
            "env",
            f"GLOO_SOCKET_IFNAME={dev}",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--node-rank",
            str(rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{head}:{PORT}",
            "--rdzv-id",
            "two-nodes",
            "--rdzv-conf",
            f"is_host={'true' if rank == 0 else 'false'}",
            "--local-addr",
            addr,
            "-m",
            "paratrain.cli",
            "train",
            *[a.format(out="two") for a in TRAIN],
        ]
        log = open(tmp_path / f"node{rank}.log", "w")  # a file, not a pipe: nobody must block on output
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=tmp_path,
                env=cli_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        log.close()
    try:
        for p in procs:
            p.wait(timeout=200)
    finally:
        for p in procs:  # the whole session: torchrun's workers too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"node {rank}:\n{(tmp_path / f'node{rank}.log').read_text()[-3000:]}"
    # the reference in this process: its 4 ranks fork from the warm forkserver (no interpreter or torch start)
    code, _, err = run_cli_inproc(["train", "--nproc", "4", *[a.format(out="one") for a in TRAIN]], cwd=tmp_path)
    assert code == 0, err[-3000:]
    two_losses, one_losses = (
        losses(tmp_path / "two" / "metrics.jsonl"),
        losses(tmp_path / "one" / "metrics.jsonl"),
    )
    assert len(two_losses) == 5
    assert two_losses == one_losses
