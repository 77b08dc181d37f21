"""Config: defaults < TOML < CLI; --print-config round-trips; bad values are one-line user errors."""

import pytest

from paratrain.config import TrainConfig, load_config
from paratrain.errors import UserError


def test_print_config_output_is_a_valid_config(tmp_path, cli_inproc):  # it starts no run: in this process
    first = cli_inproc("train", "--print-config", "--model", "small", "--lr", "0.001", "--tp", "2", "--strategy", "tp")
    assert first.returncode == 0, first.stderr
    path = tmp_path / "resolved.toml"
    path.write_text(first.stdout)
    cfg = load_config(str(path), {})
    assert (cfg.model, cfg.lr, cfg.tp, cfg.strategy) == ("small", 0.001, 2, "tp")
    second = cli_inproc("train", "--print-config", "--config", str(path))
    assert second.stdout == first.stdout
    assert not (tmp_path / "runs").exists()


def test_cli_overrides_win_over_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('model = "small"\nsteps = 7\n')
    cfg = load_config(str(path), {"steps": 9, "seed": None})
    assert (cfg.model, cfg.steps, cfg.seed) == ("small", 9, 0)


@pytest.mark.parametrize("text,match", [
    ("steps = 0\n", "steps"),
    ("stepz = 3\n", "unknown config key 'stepz'"),
    ("model = 'nope'\n", "unknown model preset"),
    ("strategy = 'magic'\n", "unknown strategy"),
    ("steps = [1\n", "not valid TOML"),
    ("dtype = 'fp4'\n", "dtype"),
])
def test_bad_config_files(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UserError, match=match):
        load_config(str(path), {})


def test_unreadable_config_file(tmp_path):
    with pytest.raises(UserError, match="cannot read config file"):
        load_config(str(tmp_path / "missing.toml"), {})


def test_toml_never_evaluates_strings(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('out = "__import__(\'os\').system(\'touch pwned\')"\n')
    cfg = load_config(str(path), {})
    assert cfg.out.startswith("__import__")
    assert not (tmp_path / "pwned").exists()
    assert TrainConfig().strategy == "ddp"
