"""Issue 19, defects 7 and 9: inputs that gave tracebacks or were silently coerced are one line and exit 2;
a diverging loss is one line and exit 1; to_toml writes what TOML reads back."""

from __future__ import annotations

import json
import shutil
import string

import pytest
import tomllib
from hypothesis import given, settings
from hypothesis import strategies as st

from reliability.inproc import run_cli_inproc

SMALL = ["--strategy", "single", "--seq-len", "8", "--global-batch", "1", "--steps", "2", "--no-metrics"]


def error_line(err: str, prefix: str = "error: ") -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(("error:", "failed:"))]
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


@pytest.mark.parametrize("argv,message", [
    (["train", "--timeout-s", "inf"], "'timeout_s': Input should be a finite number"),
    (["train", "--seed", str(2**64)], "'seed': Input should be less than or equal to 4294967295"),
    (["train", "--out", "runs/a\x00b"], "argument 3 contains a NUL byte"),
    (["train", "--config", "seq_len.toml"], "'seq_len': Input should be a valid integer"),
    (["train", "--config", "compile.toml"], "'compile': Input should be a valid boolean"),
    (["train", "--config", "nul.toml"], "'out': Value error, contains a control or line-break character"),
    (["launch", "slurm", "--out", "x PARATRAIN_CONFIG_EOF"], "contains PARATRAIN_CONFIG_EOF"),
    (["train", *SMALL, "--data", "a-directory"], "--data a-directory holds documents to tokenize: give --tokenizer"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, argv, message):
    (tmp_path / "seq_len.toml").write_text('seq_len = "16"\n')
    (tmp_path / "compile.toml").write_text('compile = "off"\n')
    (tmp_path / "nul.toml").write_text('out = "runs/a\\u0000b"\n')
    (tmp_path / "a-directory").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = run_cli_inproc(argv, cwd=tmp_path)
    assert code == 2 and message in error_line(err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "an exit-2 run left a file behind"


def test_manifest_files_not_a_mapping_is_exit_2(good_checkpoints, tmp_path):
    step = shutil.copytree(good_checkpoints / "step-4", tmp_path / "step-4")
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"] = ["__0_0.distcp"]
    (step / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli_inproc(["train", *SMALL, "--seq-len", "32", "--global-batch", "4", "--steps", "6",
                                   "--resume", step, "--out", "run"], cwd=tmp_path)
    assert code == 2 and "'files' is not a mapping" in error_line(err), err
    assert not (tmp_path / "run").exists()


def test_diverging_loss_is_exit_1_naming_the_step(tmp_path):
    code, _, err = run_cli_inproc(["train", *SMALL, "--steps", "4", "--lr", "1e30", "--out", "run"], cwd=tmp_path)
    line = error_line(err, "failed: ")
    assert code == 1 and "loss became nan at step 2" in line and "lower --lr" in line, err


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]) | st.sampled_from(
    list(string.printable) + ["\x00", "\x7f", "\x85", "\u2028", "\u2029", '"', "\\"]), max_size=40))
def test_to_toml_string_round_trips(text):
    from paratrain.config import TrainConfig, toml_string

    assert tomllib.loads(f"v = {toml_string(text)}\n")["v"] == text
    if text.isprintable():  # what a config may hold: the whole config round-trips
        cfg = TrainConfig(out=text or None, data=text or "synthetic")
        assert TrainConfig(**tomllib.loads(cfg.to_toml())) == cfg
