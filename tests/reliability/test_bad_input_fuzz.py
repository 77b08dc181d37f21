"""Bad input fuzz (hypothesis): CLI flags and TOML configs that are wrong in one generated way each.

Every case must exit 2 with exactly one line on stderr, no traceback, and write no file. The cases run
in-process through paratrain.cli.main (fast); starting a worker counts as a failure, since bad input must
be caught in the parent before any process starts.
"""

from __future__ import annotations

import contextlib
import io
import os
import string
import tempfile
from pathlib import Path

import pytest
import tomllib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paratrain import cli
from paratrain.config import STRATEGIES, TrainConfig
from paratrain.models.presets import PRESETS

MIN_CASES = 50
INT_AT_LEAST_1 = [
    "--steps",
    "--nproc",
    "--global-batch",
    "--micro-batch",
    "--seq-len",
    "--tp",
    "--pp",
    "--cp",
    "--dp-shard",
    "--dp-replicate",
    "--microbatches",
    "--virtual-stages",
]
INT_AT_LEAST_0 = ["--seed", "--ckpt-every", "--max-restarts", "--local-sgd-period"]
POSITIVE_FLOAT = ["--lr", "--timeout-s"]
CHOICES = {
    "--strategy": STRATEGIES,
    "--dtype": ("fp32", "bf16", "fp16"),
    "--ac": ("none", "selective", "full"),
    "--device": ("auto", "cpu", "cuda"),
    "--cp-impl": ("ring", "ulysses"),
    "--pp-schedule": ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"),
    "--ddp-comm-hook": ("none", "bf16", "fp16", "powersgd"),
    "--model": tuple(PRESETS),
}
FIELDS = set(TrainConfig.model_fields)
COMMANDS = ["train", "verify"]


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


words = st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1, max_size=12)
not_numbers = words.filter(lambda w: not _is_number(w) and not w.startswith("-"))
commands = st.sampled_from(COMMANDS)


@st.composite
def bad_int_flag(draw):
    flag = draw(st.sampled_from(INT_AT_LEAST_1 + INT_AT_LEAST_0))
    low = 0 if flag in INT_AT_LEAST_1 else -1
    value = draw(
        st.one_of(
            st.integers(max_value=low).map(str),
            not_numbers,
            st.floats(0.1, 100).filter(lambda x: x != int(x)).map(repr),
        )
    )
    return [draw(commands), f"{flag}={value}"], None


@st.composite
def bad_float_flag(draw):
    value = draw(
        st.one_of(
            st.floats(max_value=0, allow_nan=False, allow_infinity=False).map(repr),
            not_numbers,
            st.just("nan"),
        )
    )
    return [draw(commands), f"{draw(st.sampled_from(POSITIVE_FLOAT))}={value}"], None


@st.composite
def bad_choice(draw):
    flag = draw(st.sampled_from(sorted(CHOICES)))
    value = draw(not_numbers.filter(lambda w: w not in CHOICES[flag]))
    return [draw(commands), flag, value], None


@st.composite
def unknown_flag(draw):
    name = draw(st.text(alphabet=string.ascii_lowercase + "-", min_size=3, max_size=15))
    known = {p.opts[0] for p in _params()}
    flag = f"--{name.strip('-') or 'zz'}x"
    return [draw(commands), flag if flag not in known else "--not-a-flag", "1"], None


@st.composite
def missing_path(draw):
    flag = draw(st.sampled_from(["--config", "--resume", "--data"]))
    name = "missing-" + draw(st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=8))
    return [draw(commands), flag, name + (".toml" if flag == "--config" else ".bin")], None


@st.composite
def bad_mixture(draw):
    """A --data mixture written wrong (issue 44): ';' between sources, '=' before a weight, a weight not a number."""
    names = st.builds(str.__add__, st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=6),
                      st.sampled_from([".jsonl", ".parquet", ".arrow", ".txt"]))
    first, second = draw(names), draw(names)
    spec = draw(st.sampled_from([f"{first}:0.7;{second}:0.3", f"{first}={draw(st.floats(0.01, 10)):g}",
                                 f"{first}:0.5,{second}:{draw(not_numbers)}"]))
    return [draw(commands), "--data", spec], None


@st.composite
def inconsistent(draw):
    kind = draw(st.sampled_from(["batch", "ckpt", "degrees", "heads"]))
    if kind == "batch":
        nproc = draw(st.integers(2, 8))
        batch = draw(st.integers(1, 64).filter(lambda b: b % nproc))
        return ["train", "--strategy", "ddp", "--nproc", str(nproc), "--global-batch", str(batch)], None
    if kind == "ckpt":
        steps = draw(st.integers(1, 50))
        return ["train", "--steps", str(steps), "--ckpt-every", str(steps + draw(st.integers(1, 50)))], None
    if kind == "degrees":
        tp = draw(st.integers(2, 8))
        return [draw(commands), "--strategy", "tp", "--nproc", str(tp + 1), "--tp", str(tp)], None
    return [draw(commands), "--strategy", "tp", "--nproc", "3", "--tp", "3"], None


@st.composite
def bad_toml(draw):
    kind = draw(st.sampled_from(["unknown key", "wrong type", "bad value", "syntax"]))
    if kind == "unknown key":
        key = draw(
            st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=12).filter(
                lambda k: k.replace("-", "_") not in FIELDS
            )
        )
        text = f"{key} = 1\n"
    elif kind == "wrong type":
        key = draw(st.sampled_from(["steps", "nproc", "global_batch", "seq_len", "seed", "lr", "compile"]))
        text = f"{key} = {draw(st.sampled_from(['[1, 2]', '{a = 1}', '1979-05-27', 'nan', 'inf']))}\n"
        if key == "lr" and text.endswith("inf\n"):
            text = "lr = -inf\n"
    elif kind == "bad value":
        key = draw(st.sampled_from(["strategy", "dtype", "model", "ac", "device"]))
        text = f'{key} = "{draw(not_numbers)}"\n'
        if key == "device" and text.split('"')[1] in ("auto", "cpu", "cuda"):
            text = 'device = "tpu"\n'
    else:
        text = draw(st.text(min_size=1, max_size=40).filter(_not_toml))
    return [draw(commands), "--config", "bad.toml"], text


@st.composite
def bad_launch(draw):
    target = draw(st.sampled_from(["slurm", "k8s", "skypilot"]))
    kind = draw(st.sampled_from(["target", "nodes", "gpus", "api", "port", "name"]))
    if kind == "target":
        return ["launch", draw(not_numbers.filter(lambda w: w not in ("slurm", "k8s", "skypilot")))], None
    if kind in ("nodes", "gpus"):
        flag = "--nodes" if kind == "nodes" else "--gpus-per-node"
        return ["launch", target, f"{flag}={draw(st.integers(max_value=0))}"], None
    if kind == "api":
        return [
            "launch",
            "k8s",
            "--k8s-api",
            draw(not_numbers.filter(lambda w: w not in ("trainjob", "pytorchjob"))),
        ], None
    if kind == "port":
        port = draw(st.one_of(st.integers(max_value=0), st.integers(min_value=65536)))
        return ["launch", target, f"--port={port}"], None
    name = draw(
        st.text(alphabet=string.ascii_letters + "_.", min_size=1, max_size=10).filter(
            lambda n: any(c.isupper() or c in "_." for c in n)
        )
    )
    return ["launch", target, "--job-name", name], None


def _not_toml(text: str) -> bool:
    try:
        tomllib.loads(text)
        return False
    except (tomllib.TOMLDecodeError, ValueError):
        return True
    except Exception:  # noqa: BLE001 - e.g. recursion: still not a valid config
        return True


def _params():
    return [p for p in cli.typer.main.get_command(cli.app).commands["train"].params if p.opts]


cases = st.one_of(
    bad_int_flag(),
    bad_float_flag(),
    bad_choice(),
    unknown_flag(),
    missing_path(),
    bad_mixture(),
    inconsistent(),
    bad_toml(),
    bad_launch(),
)


def run_main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, err.getvalue()


def no_workers(*args, **kwargs):
    raise AssertionError("a worker started: bad input got past validation in the parent")


@pytest.mark.timeout(120)
def test_bad_input_exits_2_with_one_line(monkeypatch):
    monkeypatch.setattr("paratrain.train.launch.run_workers", no_workers)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    seen = []
    home = os.getcwd()

    @settings(
        max_examples=MIN_CASES + 20,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def check(case):
        argv, toml_text = case
        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)
            try:
                if toml_text is not None:
                    Path("bad.toml").write_text(toml_text)
                code, stderr = run_main(argv)
                left = sorted(os.listdir(tmp))
            finally:
                os.chdir(home)
        where = f"paratrain {' '.join(argv)}" + (f" with bad.toml = {toml_text!r}" if toml_text else "")
        assert code == 2, f"{where}: exit {code}\n{stderr}"
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{where}: stderr was\n{stderr}"
        assert "Traceback" not in stderr
        if argv[1] == "--data" and set(argv[2]) & set(":;="):  # a mixture written wrong shows how to write one
            assert "a mixture is written A:w,B:w" in lines[0], f"{where}: {lines[0]}"
        assert left == (["bad.toml"] if toml_text is not None else []), f"{where}: wrote {left}"
        seen.append(where)

    check()
    assert len(seen) >= MIN_CASES, f"only {len(seen)} cases ran"
