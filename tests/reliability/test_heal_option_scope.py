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
