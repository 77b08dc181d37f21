"""Issue 19, defect 10: every command of the README's tour runs and exits 0.

The launch commands run exactly as written (and for k8s and skypilot too, as the README says); `env`,
`--print-config`, `data prepare` and `export` as written, on what the tour assumes the reader has (a local
tokenizer and a text file, a run directory runs/x with checkpoints). train, verify and doctor run with
small settings: one process (`--nproc 1`), 2 steps, short sequences, a tiny model (doctor without its
counterfactual probes, which tests/doctor covers). Everything runs in this process, so it stays fast.
`plan`, `train --strategy auto` and `bench` cost 10-15 s each even when small (the planner, 3 strategies and
a plot); the same commands already run in tests/plan/test_plan_cli.py (plan --model llama3-8b as written),
tests/plan/test_auto_and_calibrate.py and tests/bench/test_bench_scaling.py, so they are not run twice here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from reliability.inproc import run_cli_inproc

README = Path(__file__).resolve().parents[1] / "README.md"
SMALL = {"--nproc": "1", "--steps": "2", "--model": "tiny", "--seq-len": "16"}
RUN_ELSEWHERE = {"plan", "bench", "auto"}  # see the module docstring


def tour() -> list[list[str]]:
    text = README.read_text()
    block = re.search(r"## A tour\s+```bash\n(.*?)```", text, re.S).group(1)
    return [shlex.split(line.split("#", 1)[0]) for line in block.splitlines() if line.strip()]


def small(argv: list[str]) -> list[str]:
    """The command with small settings: every SMALL flag it has is replaced, the rest appended."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in SMALL and i + 1 < len(argv):
            i += 2
            continue
        out.append(argv[i])
        i += 1
    command = out[0]
    extra = {"train": ["--nproc", "1", "--steps", "2", "--seq-len", "16", "--global-batch", "4"],
             "verify": ["--nproc", "1", "--steps", "2", "--seq-len", "16", "--global-batch", "4"],
             "doctor": ["--model", "tiny", "--nproc", "1", "--steps", "2", "--warmup", "1", "--seq-len", "16",
                        "--global-batch", "4", "--probe-rounds", "0"],  # probes: tests/doctor
             }
    return out + extra.get(command, [])


def test_the_tour_is_what_this_test_runs():
    commands = [argv[1] for argv in tour()]
    assert commands == ["env", "train", "train", "verify", "plan", "train", "doctor", "bench", "launch", "data",
                        "train", "export", "train", "verify"], commands


def prerequisites(tmp_path: Path) -> None:
    """What the tour assumes the reader has: a local tokenizer and a text file (`data prepare`), and a run
    directory with checkpoints at runs/x (`export runs/x/checkpoints`)."""
    from train.test_prepare import make_tokenizer

    make_tokenizer(tmp_path / "tok", 300)
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 400)
    code, _, err = run_cli_inproc(["train", "--strategy", "single", "--steps", "2", "--seq-len", "16",
                                   "--global-batch", "2", "--ckpt-every", "2", "--out", "runs/x"], cwd=tmp_path)
    assert code == 0, err


@pytest.mark.timeout(240)
def test_every_tour_command_exits_0(tmp_path):
    prerequisites(tmp_path)
    for argv in tour():
        assert argv[0] == "paratrain"
        argv = argv[1:]
        if argv[0] in RUN_ELSEWHERE or "auto" in argv:
            continue
        redirect = argv.index(">") if ">" in argv else None
        target = argv[redirect + 1] if redirect is not None else None
        argv = argv[:redirect] if redirect is not None else argv
        as_written = argv[0] in ("env", "launch", "data", "export") or "--print-config" in argv
        run = argv if as_written else small(argv)
        code, out, err = run_cli_inproc(run, cwd=tmp_path)
        assert code == 0, f"paratrain {shlex.join(run)}: exit {code}\n{err[-2000:]}"
        assert "Traceback" not in err
        if target:
            (tmp_path / target).write_text(out)
        if argv[0] == "launch":
            assert (tmp_path / "job.sh").read_text().startswith("#!/bin/bash")
            for other in ("k8s", "skypilot"):
                code, _, err = run_cli_inproc([argv[0], other, *argv[2:-2]], cwd=tmp_path)
                assert code == 0, f"launch {other}: {err[-2000:]}"
    code, _, err = run_cli_inproc(["train", "--config", "my.toml", "--print-config"], cwd=tmp_path)
    assert code == 0, err  # the printed config reads back
