"""Issue 35: the README's tour runs as written, top to bottom, in an empty directory, every line exiting 0.

The lines are read from README.md itself (the ```bash block under "## A tour"), not copied here, and run in
order in one fresh directory: the early lines make what the later ones use (a run with a checkpoint at runs/x,
a text file, a tokenizer trained on it, tokens, an export in hf/). A `paratrain ...` line (with at most a
`> FILE` at its end) runs in this process, with exactly the arguments written, which saves an interpreter
start per line; any other line (the shell line that writes the text) runs in bash. The tour keeps its own
runs short (tiny model, 2 processes, 20 steps), so it stays part of the suite.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reliability.inproc import run_cli_inproc

README = Path(__file__).resolve().parents[1] / "README.md"


def tour() -> list[str]:
    """The tour block's lines, as written (blank lines dropped)."""
    block = re.search(r"## A tour\n.*?```bash\n(.*?)```", README.read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def words(line: str) -> list[str]:
    """The line as the shell splits it, comment dropped, with operators (|, >, ;, &&) as their own words."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def in_process(argv: list[str]) -> tuple[list[str], str | None] | None:
    """(the paratrain arguments, the file stdout goes to) for a plain `paratrain ... [> FILE]`; else None."""
    operators = [w for w in argv if w and set(w) <= set("|&;<>()")]
    if argv[0] != "paratrain" or operators not in ([], [">"]):
        return None
    if operators:
        at = argv.index(">")
        if at != len(argv) - 2:
            return None
        return argv[1:at], argv[at + 1]
    return argv[1:], None


def run_in_bash(line: str, cwd: Path) -> tuple[int, str, str]:
    bin_dir = os.path.dirname(sys.executable)  # this environment's `paratrain` and `python` come first
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout, proc.stderr


def test_the_tour_block_is_found_and_every_line_is_a_command():
    lines = tour()
    assert len(lines) >= 14, lines
    assert all(words(line) for line in lines)
    assert sum(in_process(words(line)) is not None for line in lines) >= len(lines) - 2  # mostly in-process


@pytest.mark.timeout(300)
def test_every_tour_line_runs_as_written_in_an_empty_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    workdir = tmp_path / "tour"
    workdir.mkdir()
    timings = []
    needed = recording_optional_imports(monkeypatch)
    for line in tour():
        if line.startswith("paratrain data tokenizer"):
            needed.clear()  # the extras the intro names: what the lines need from here on
        t0 = time.perf_counter()
        plain = in_process(words(line))
        if plain is None:
            code, out, err = run_in_bash(line, workdir)
        else:
            argv, target = plain
            code, out, err = run_cli_inproc(argv, cwd=workdir)
            if target:
                (workdir / target).write_text(out)
        timings.append(f"{time.perf_counter() - t0:5.1f} s  {line[:90]}")
        assert code == 0, f"{line}\nexit {code}\n{err[-3000:]}"
        assert "Traceback" not in err, f"{line}\n{err[-3000:]}"
    print("\n".join(timings))
    # what the lines say they make
    assert (workdir / "job.sh").read_text().startswith("#!/bin/bash")
    assert (workdir / "runs/x/checkpoints").is_dir() and (workdir / "hf/config.json").is_file()
    assert (workdir / "tok/tokenizer.json").is_file() and (workdir / "tokens.bin.json").is_file()
    for made in ("trace.json", "doctor.html", "scaling.png", "bench.html"):
        assert (workdir / made).is_file(), made
    # the launch line's comment: the other launchers take the same arguments
    launch = next(words(line) for line in tour() if line.startswith("paratrain launch "))
    for other in ("k8s", "skypilot"):
        argv = [launch[1], other, *launch[3:launch.index("-o")], "-o", f"job-{other}"]
        code, _, err = run_cli_inproc(argv, cwd=workdir)
        assert code == 0, f"launch {other}: {err[-2000:]}"
    code, _, err = run_cli_inproc(["train", "--config", "my.toml", "--print-config"], cwd=workdir)
    assert code == 0, err  # the printed config reads back
    from paratrain.interop.optional import EXTRA_OF

    extras = {EXTRA_OF.get(module.split(".")[0]) for module in needed}
    assert "data" in extras and extras <= tour_extras(), (sorted(needed), tour_extras())


def tour_extras() -> set[str]:
    """The extras the tour's intro says the lines from `data tokenizer` on need."""
    found = re.search(r"From `data tokenizer` on it needs.*?`pip install -e '\.\[([a-z,]+)\]'`", README.read_text(),
                      re.S)
    return set(found.group(1).split(","))


def recording_optional_imports(monkeypatch) -> set[str]:
    """The optional modules (interop/optional.py's require) imported from now on, in this process."""
    import importlib
    import types

    from paratrain.interop import optional

    seen: set[str] = set()

    def import_module(name: str):
        seen.add(name)
        return importlib.import_module(name)

    monkeypatch.setattr(optional, "importlib", types.SimpleNamespace(import_module=import_module))
    return seen


def test_the_extras_the_tour_names_exist():
    import tomllib

    declared = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert tour_extras() and tour_extras() <= set(declared)
