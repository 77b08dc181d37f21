"""The CLI contract: the default job trains, bad input is one line + exit 2 with nothing written."""

import pytest


@pytest.mark.timeout(300)
def test_default_job_trains_towards_the_floor(cli_here, tmp_path):
    res = cli_here("train", "--steps", "120", "--json", "--out", "run")
    assert res.returncode == 0, res.stderr[-2000:]
    summary = res.json()
    assert summary["strategy"] == "ddp" and summary["world_size"] == 2
    assert summary["final_loss"] < 2.0 < 5.0  # starts at ln(256) = 5.55
    assert summary["final_loss"] > summary["loss_floor"] - 0.05
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 120
    import json

    record = json.loads(lines[-1])
    for key in ("step", "loss", "lr", "grad_norm", "step_time_s", "data_wait_s", "tokens_per_s", "mfu", "mem_peak_gib"):
        assert key in record
    assert "floor" in res.stderr


BAD_INPUTS = [
    (["train", "--nproc", "2", "--dp-shard", "2", "--tp", "2"], "world size"),
    (["train", "--model", "giant"], "unknown model preset"),
    (["train", "--strategy", "warp"], "unknown strategy"),
    (["train", "--steps", "0"], "steps"),
    (["train", "--steps", "-3"], "steps"),
    (["train", "--data", "nope/missing.bin"], "data file not found"),
    (["train", "--config", "nope.toml"], "cannot read config file"),
    (["verify", "--strategy", "ddp", "--nproc", "3"], "not divisible"),
    (["train", "--no-such-flag"], "no-such-flag"),
    (["train", "--steps", "abc"], "--steps"),
]


def one_line_exit_2_nothing_written(res, tmp_path, needle):
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert needle in lines[0]
    assert "Traceback" not in res.stderr
    assert res.stdout == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,needle", BAD_INPUTS)
def test_bad_input_is_one_line_exit_2_and_nothing_written(cli_inproc, tmp_path, args, needle):
    one_line_exit_2_nothing_written(cli_inproc(*args), tmp_path, needle)


@pytest.mark.parametrize("args,needle", [BAD_INPUTS[0], BAD_INPUTS[-2]])
def test_bad_input_from_a_real_process(cli, tmp_path, args, needle):
    """The same contract through the installed entry point (interpreter exit code, nothing on stdout)."""
    one_line_exit_2_nothing_written(cli(*args, timeout=60), tmp_path, needle)


def test_help_for_every_command(cli_inproc):
    for cmd in ("train", "verify", "env"):
        res = cli_inproc(cmd, "--help")
        assert res.returncode == 0 and "--json" in res.stdout + res.stderr or cmd == "train"


def test_env_json(cli_inproc):
    res = cli_inproc("env", "--json")
    assert res.returncode == 0
    report = res.json()
    assert report["gloo"] is True and report["torch"]
    for package in ("transformers", "tokenizers", "safetensors", "datasets", "torchao"):
        assert package in report  # a version string, or None when it is not installed


def test_env_report_goes_to_stdout_so_it_can_be_redirected(cli_inproc):
    res = cli_inproc("env")
    assert res.returncode == 0, res.stderr
    fields = dict(line.split(":", 1) for line in res.stdout.splitlines())
    assert {"torch", "transformers", "tokenizers", "safetensors"} <= {key.strip() for key in fields}
