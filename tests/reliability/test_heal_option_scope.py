"""--heal-replicas is a train option: the other commands that take the train options refuse it in one line
(exit 2) instead of running without it, from the flag or from a config file; without it they go on."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("command", [["verify"], ["doctor"], ["launch", "slurm"]])
def test_commands_other_than_train_refuse_heal_replicas(cli_inproc, tmp_path, command):
    r = cli_inproc(*command, "--model", "tiny", "--nproc", "2", "--heal-replicas")
    assert r.returncode == 2, r.stderr
    assert f"does not apply to `paratrain {command[0]}`" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "run.toml").write_text("model = 'tiny'\nheal_replicas = true\n")
    assert cli_inproc(*command, "--config", str(tmp_path / "run.toml"), "--nproc", "2").returncode == 2


def test_launch_without_heal_replicas_still_renders(cli_inproc):
    r = cli_inproc("launch", "slurm", "--model", "tiny", "--nproc", "2", "--no-heal-replicas")
    assert r.returncode in (0, None), r.stderr
    assert "paratrain" in r.stdout and "#SBATCH" in r.stdout


def test_heal_replicas_refuses_degrees_once_before_any_replica_starts(cli_inproc, tmp_path):
    """Each replica is one process of world size 1, so --dp-replicate 3 cannot describe the replicas: `train`
    refuses it itself, in one line that gives the form that works, and no replica (nor run directory) is made."""
    r = cli_inproc("train", "--heal-replicas", "--dp-replicate", "3", "--nproc", "3", "--global-batch", "12",
                   "--out", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: --heal-replicas runs whole-model replicas, one device each, or hsdp's replicate groups, and takes no "
        "other parallel degree (got --dp-replicate 3): ask for 3 replicas with --strategy ddp --nproc 3"]
    assert not (tmp_path / "run").exists()
    # hsdp heals its replicate groups of --dp-shard ranks, and nothing more inside them
    r = cli_inproc("train", "--heal-replicas", "--strategy", "hsdp", "--dp-replicate", "2", "--dp-shard", "2",
                   "--tp", "2", "--nproc", "8", "--global-batch", "16", "--out", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: --heal-replicas heals hsdp's replicate groups, each FSDP over --dp-shard ranks and no other degree "
        "(got --tp 2): drop it, or heal whole replicas with --strategy ddp"]
    assert not (tmp_path / "run").exists()
