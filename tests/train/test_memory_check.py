"""train's memory check (plan/memory_check.py): a layout predicted past --mem-budget-gib is refused before any
process starts, with the best layout that fits; one that fits runs and logs predicted against measured at step 2."""

from __future__ import annotations

import json
import re

import pytest

from paratrain.config import load_config
from paratrain.models.presets import model_args_for
from paratrain.parallel.strategies import resolve_layout
from paratrain.plan.costing.memory import estimate_memory
from paratrain.plan.memory_check import check_memory

RUN = {"model": "small", "strategy": "ddp", "nproc": 2, "steps": 2}


def predicted_gib(overrides: dict) -> float:
    cfg = load_config(None, overrides)
    layout = resolve_layout(cfg, cfg.nproc)
    return estimate_memory(model_args_for(cfg), layout, cfg.seq_len, layout.dtype, "cpu").total / 2**30


def test_a_layout_over_the_budget_is_refused_with_the_best_that_fits(cli_inproc, tmp_path):
    budget = 0.5 * predicted_gib(RUN)
    res = cli_inproc("train", "--model", "small", "--strategy", "ddp", "--nproc", "2", "--steps", "2",
                     "--mem-budget-gib", f"{budget:.4f}", "--out", "r")
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "predicted to need" in lines[0] and "--no-memory-check" in lines[0], res.stderr
    fits = re.search(r"the best layout that fits is (.+?) at ([0-9.e-]+) GiB: (--strategy [^;]+)", lines[0])
    assert fits and float(fits.group(2)) <= budget, lines[0]
    assert not (tmp_path / "r").exists()  # nothing written before the check
    # the flags it names are ones train takes as written, and that layout fits the same budget
    printed = cli_inproc("train", "--model", "small", "--steps", "2", *fits.group(3).split(), "--print-config")
    assert printed.returncode == 0, printed.stderr
    (tmp_path / "named.toml").write_text(printed.stdout)
    named = load_config(str(tmp_path / "named.toml"), {})
    layout = resolve_layout(named, named.nproc)
    assert layout.label() == fits.group(1)
    assert estimate_memory(model_args_for(named), layout, named.seq_len, layout.dtype, "cpu").total / 2**30 <= budget


def test_no_memory_check_and_cpu_without_a_budget_skip_it():
    args = model_args_for(load_config(None, RUN))
    tiny_budget = load_config(None, {**RUN, "mem_budget_gib": 1e-6, "memory_check": False})
    assert check_memory(tiny_budget, resolve_layout(tiny_budget, 2), args, "cpu") is None
    unbounded = load_config(None, RUN)  # CPU ranks share the host: no per-device budget unless given
    assert check_memory(unbounded, resolve_layout(unbounded, 2), args, "cpu") is None
    fits = load_config(None, {**RUN, "mem_budget_gib": 64.0})
    assert check_memory(fits, resolve_layout(fits, 2), args, "cpu") == pytest.approx(predicted_gib(RUN))


@pytest.mark.timeout(200)
def test_a_fitting_run_logs_predicted_against_measured_at_step_2(cli_here):
    res = cli_here("train", "--model", "tiny", "--strategy", "single", "--nproc", "1", "--steps", "3",
              "--mem-budget-gib", "8", "--out", "r", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout)
    line = next((ln for ln in res.stderr.splitlines() if "memory at step 2:" in ln), None)
    assert line and f"predicted {summary['predicted_peak_gib']:.3g} GiB" in line, res.stderr[-2000:]
    assert "within 8 GiB" in res.stderr
    # on CPU, like with like: the resident memory the run added, not the process's (torch's own included)
    measured = re.search(r"measured ([0-9.e-]+) GiB \(resident peak above the ([0-9.e-]+) GiB held before the "
                         r"model was built\): [0-9.]+x$", line)
    assert measured, line
    assert 0 < float(measured.group(1)) < float(measured.group(2)), line  # tiny's tensors are far below torch's


def test_resident_memory_above_the_baseline_counts_what_was_allocated_since():
    import torch

    from paratrain.train.host_memory import ResidentBaseline

    baseline = ResidentBaseline.take()
    held = torch.ones(64 * 2**20 // 4)  # 64 MiB, written (so resident)
    assert 60 / 1024 < baseline.peak_above() < 200 / 1024 and not baseline.since_start
    del held
    assert baseline.peak_above() > 60 / 1024  # a peak: freeing does not lower it
