"""benchmarks/gpu_suite.py --dry-run: the GPU suite's own code on CPU (tiny models, eager), the rows that need a
GPU skipped with one line each, results.json and table.md written, predictions next to measurements."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from paratrain.costs.hardware import profile_from_spec
from paratrain.gpu_catalog import get_gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUITE = os.path.join(REPO, "benchmarks", "gpu_suite.py")
# the headline pair (train + plain loop, with its doctor row), the GPU-only variants of the same step, one
# verify; the calibration is replaced by a given profile (calibrating takes ~10-30 s here)
ONLY = ",".join(["gpt2-124m-bf16-compile-mb16-*", "gpt2-124m-bf16-compile-cudagraphs-mb16-train",
                 "gpt2-124m-fp8-compile-mb16-*", "verify-gpt2-124m-fp32-eager", "calibrate"])


@pytest.mark.timeout(300)
def test_dry_run_measures_the_cpu_rows_and_skips_the_gpu_rows(tmp_path):
    profile = profile_from_spec(get_gpu("cpu")).save(tmp_path / "cpu-profile.json")
    out = tmp_path / "suite"
    res = subprocess.run([sys.executable, SUITE, "--dry-run", "--out", str(out), "--only", ONLY,
                          "--hardware", str(profile)], capture_output=True, text=True, timeout=280,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    table = (out / "table.md").read_text()
    assert doc["suite"]["state"] == "complete" and doc["suite"]["dry_run"]
    assert doc["suite"]["hardware_profile"] == "hardware-profile.json"
    assert (out / "hardware-profile.json").exists()
    rows = {e["id"]: e for e in doc["rows"]}
    assert set(rows) == {"gpt2-124m-bf16-compile-mb16-train", "gpt2-124m-bf16-compile-mb16-plain",
                         "gpt2-124m-bf16-compile-mb16-doctor", "gpt2-124m-bf16-compile-cudagraphs-mb16-train",
                         "gpt2-124m-fp8-compile-mb16-train", "gpt2-124m-fp8-compile-mb16-plain",
                         "verify-gpt2-124m-fp32-eager", "calibrate"}

    # the rows a CPU can run measured a step, and the planner predicted the same layout, catalog and profile
    for rid in ("gpt2-124m-bf16-compile-mb16-train", "gpt2-124m-bf16-compile-mb16-plain"):
        r = rows[rid]
        assert "skipped" not in r and "error" not in r, r
        assert r["result"]["tokens_per_s"] > 0 and r["result"]["step_time_s"] > 0
        for key in ("predicted_catalog", "predicted_calibrated"):
            assert r[key]["step_time_s"] > 0 and r[key]["ratio"] > 0
        assert "calibrated profile" in r["predicted_calibrated"]["hardware"]
    train = rows["gpt2-124m-bf16-compile-mb16-train"]
    assert train["result"]["layout"]["dtype"] == "fp32" and train["dry_run_as"]["model"] == "gpt2-tiny"
    assert train["pair"] == "gpt2-124m-bf16-compile-mb16-plain"
    assert train["warm"], train  # the prewarm ran it first (its compile cache, on a GPU)
    assert (out / "rows" / train["id"] / "run" / "metrics.jsonl").exists()
    assert rows["verify-gpt2-124m-fp32-eager"]["result"]["passed"] is True
    doctor = rows["gpt2-124m-bf16-compile-mb16-doctor"]["result"]
    assert doctor["breakdown"]
    assert (out / "rows" / "gpt2-124m-bf16-compile-mb16-doctor" / doctor["trace"]).exists()

    # what needs a GPU says so, one line each, in the table too
    for rid in ("gpt2-124m-bf16-compile-cudagraphs-mb16-train", "gpt2-124m-fp8-compile-mb16-train",
                "gpt2-124m-fp8-compile-mb16-plain"):
        assert rows[rid]["skipped"].startswith("needs CUDA"), rows[rid]
        assert f"- {rid}: needs CUDA" in table
    assert rows["calibrate"]["skipped"].startswith("profile given")
    assert "| gpt2-124m | bf16 | compile | 16 x 1024 |" in table and "PASSED" in table


@pytest.mark.timeout(200)
def test_budget_and_a_kill_leave_results_with_one_line_per_row(tmp_path):
    row = "verify-gpt2-124m-fp32-eager"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # a row whose time estimate exceeds what is left of the budget is skipped, not started
    out = tmp_path / "budget"
    res = subprocess.run([sys.executable, SUITE, "--dry-run", "--out", str(out), "--only", row,
                          "--budget-s", "3"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["suite"]["state"] == "complete"
    assert [e["skipped"].split(":")[0] for e in doc["rows"]] == ["budget"]

    # SIGTERM (the caller's `timeout`) mid-row: the child is stopped, what is known is written, exit 143
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, SUITE, "--dry-run", "--out", str(out), "--only", row],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    started = out / "rows" / row / "command.txt"
    deadline = time.monotonic() + 120
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["suite"]["state"].startswith("interrupted (SIGTERM)")
    assert doc["rows"][0]["id"] == row and doc["rows"][0]["skipped"].startswith("cut off (SIGTERM)")
    assert "interrupted" in (out / "table.md").read_text()
