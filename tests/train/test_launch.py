"""The same entrypoint works when torchrun already started the processes (it reads RANK/WORLD_SIZE)."""

import subprocess
import sys

import pytest

from paratrain.train.runtime import free_loopback_port


@pytest.mark.timeout(240)
def test_train_under_torchrun_matches_our_launcher(cli_here, tmp_path):
    from helpers import cli_env

    port = free_loopback_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "paratrain.cli", "train", "--steps", "4", "--json",
           "--out", "viatorchrun"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=tmp_path, env=cli_env(),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    via_torchrun = json.loads(proc.stdout)
    ours = cli_here("train", "--steps", "4", "--json", "--out", "ours").json()
    assert via_torchrun["world_size"] == 2
    assert via_torchrun["final_loss"] == ours["final_loss"]
