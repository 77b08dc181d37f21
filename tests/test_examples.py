"""examples/: the custom-model example trains under ddp and zero3, and its own verify (single vs ddp vs zero3
loss curves, fp32 rel 1e-5; the loss falls) passes. Also through the CLI: `train --script FILE:build`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, cli_env

EXAMPLE = os.path.join(REPO, "examples", "custom_mlp.py")


@pytest.mark.timeout(300)
def test_custom_model_example_verify_passes(tmp_path):
    proc = subprocess.run([sys.executable, EXAMPLE, "--steps", "12"], capture_output=True, text=True, timeout=280,
                          cwd=str(tmp_path), env=cli_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verify PASSED" in proc.stderr
    assert "applied DDP over 2 ranks" in proc.stderr and "applied FSDP2 (ZeRO-3)" in proc.stderr


@pytest.mark.timeout(200)
def test_train_script_from_the_cli(cli_here, tmp_path):
    res = cli_here("train", "--script", EXAMPLE + ":build", "--strategy", "zero3", "--nproc", "2", "--steps", "5",
              "--global-batch", "16", "--out", "r", "--ckpt-every", "5", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 5 and lines[-1]["loss"] < lines[0]["loss"] and lines[0]["mfu"] is None
    manifest = json.loads((tmp_path / "r" / "checkpoints" / "step-5" / "manifest.json").read_text())
    assert manifest["model"]["custom"] == "custom_mlp.py:build"
    export = cli_here("export", "r/checkpoints", "-o", "out")  # a custom model: a plain safetensors state dict
    assert export.returncode == 0, export.stderr[-2000:]
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted((tmp_path / "out").glob("*.safetensors")):
        tensors.update(load_file(shard))
    assert tensors and all(not k.startswith("model.") for k in tensors), sorted(tensors)


@pytest.mark.timeout(200)
def test_custom_model_with_a_tp_plan_matches_single(cli_here, tmp_path):
    script = os.path.join(REPO, "tests", "tp_custom_model.py") + ":build"
    runs = {}
    for strategy in ("single", "tp"):  # in this process; the tp ranks' output comes back in stderr (ranks=True)
        res = cli_here("train", "--script", script, "--strategy", strategy, "--nproc", "2", "--steps", "4",
                       "--global-batch", "8", "--out", strategy, "--json", ranks=True)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[strategy] = [json.loads(x)["loss"] for x in (tmp_path / strategy / "metrics.jsonl").read_text().splitlines()]
    assert "applied tensor parallel" in res.stderr.lower() or "tp=2" in res.stderr, res.stderr[-2000:]
    assert runs["tp"] == pytest.approx(runs["single"], rel=1e-5)


@pytest.mark.parametrize("args,needle", [
    (["--script", "nope.py:build"], "--script: file not found: nope.py"),
    (["--script", EXAMPLE], "expected FILE.py:FUNCTION"),
    (["--script", EXAMPLE + ":missing"], "has no function 'missing'"),
    (["--script", EXAMPLE + ":build", "--strategy", "pp", "--nproc", "2"], "pipeline parallelism (pp) needs"),
    (["--script", EXAMPLE + ":build", "--strategy", "tp", "--nproc", "2"], "needs a TP plan"),
])
def test_bad_scripts_are_one_line_errors(cli_inproc, args, needle):
    res = cli_inproc("train", "--steps", "1", *args)
    assert res.returncode == 2 and needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
