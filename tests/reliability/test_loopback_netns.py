"""Defect 5 (issue 19): a lone process listens on loopback only, even when the host name resolves to another
address. The host name and address are set in a private UTS/network/mount namespace (`unshare`, `ip`),
so the machine's own network is untouched. Without namespaces this test fails: it must not pass unchecked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import cli_env
from reliability.procnet import is_loopback

ADDRESS, HOST = "10.77.0.5", "paratrain-nonloopback"
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_namespace(tmp_path) -> dict:
    for tool in ("unshare", "ip", "mount"):
        assert shutil.which(tool), f"{tool} is missing: this test needs util-linux and iproute2 (see .ci/run)"
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{ADDRESS} {HOST}\n")
    setup = (f"hostname {HOST} && ip link set lo up && ip addr add {ADDRESS}/32 dev lo && "
             f"mount --bind {hosts} /etc/hosts && exec \"$@\"")
    env = cli_env({"PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])})
    done = subprocess.run(["unshare", "--uts", "--net", "--mount", "sh", "-c", setup, "sh", sys.executable,
                           os.path.join(TESTS, "reliability", "netns_watch.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 0 and done.stdout.strip(), (
        f"could not run in a private namespace (needs root or user namespaces): {done.stderr[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(150)
def test_lone_process_listens_on_loopback_only(tmp_path):
    report = in_namespace(tmp_path)
    # the setup worked: the host name resolves to a non-loopback address here
    assert report["hostname"] == HOST and report["resolved"] == ADDRESS, report
    assert report["listeners"], "saw no listening socket: the watcher did not see the process group"
    outside = [addr for addr in report["listeners"] if not is_loopback(addr[0])]
    assert outside == [], f"listening beyond loopback: {outside}"
