"""benchmarks/gpu_suite.py --dry-run: the GPU suite's own code on CPU (tiny models, eager), the rows that need a
GPU skipped with one line each, results.json and table.md written, predictions next to measurements; issue 47's
rows (speed flags against their baseline, FP8 on the 8B-shaped model) in order, and the table's reading of them."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.cli_options import run_options
from paratrain.costs.hardware import profile_from_spec
from paratrain.gpu_catalog import get_gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(REPO, "benchmarks")
SUITE = os.path.join(BENCHMARKS, "gpu_suite.py")
SPEED_FLAGS = ["--bf16-residual", "--fused-qkv", "--fused-loss", "--optimizer-graph", "--bf16-param-copies",
               "--fused-bias-gelu"]
ALL16, ALL32 = "gpt2-124m-bf16-compile+all-flags-mb16-train", "gpt2-124m-bf16-compile+all-flags-mb32-train"
LLAMA3 = "llama3-8b-4l-{}-compile-mb2-train"
# the headline pair (train + plain loop, with its doctor row), the GPU-only variants of the same step, one
# verify, all speed flags at micro-batch 16 and 32 (32 runs the same suite code: one line), the 8B-shaped bf16 and
# fp8 rows; the calibration is replaced by a given profile (calibrating takes ~10-30 s here)
ONLY = ",".join(["gpt2-124m-bf16-compile-mb16-*", "gpt2-124m-bf16-compile-cudagraphs-mb16-train",
                 "gpt2-124m-fp8-compile-mb16-*", "verify-gpt2-124m-fp32-eager", "calibrate",
                 "gpt2-124m-bf16-compile+all-flags-*", "llama3-8b-4l-*"])


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
                         "verify-gpt2-124m-fp32-eager", "calibrate", ALL16, ALL32, LLAMA3.format("bf16"),
                         LLAMA3.format("fp8")}

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
    assert "| gpt2-124m | bf16 | compile | - | 16 x 1024 |" in table and "PASSED" in table

    # all speed flags on the same step: given to train, compared with the row without them; where this paratrain's
    # train lacks one of them, one line says which
    every = rows[ALL16]
    assert every["flags"] == SPEED_FLAGS and every["baseline"] == "gpt2-124m-bf16-compile-mb16-train"
    missing = [f for f in SPEED_FLAGS if f[2:].replace("-", "_") not in run_options()]
    if missing:
        assert every["skipped"] == f"this paratrain's train has no {', '.join(missing)} (paratrain train --help)"
    else:
        assert "skipped" not in every and "error" not in every, every
        command = (out / "rows" / ALL16 / "command.txt").read_text().split()
        assert all(flag in command for flag in SPEED_FLAGS) and every["result"]["tokens_per_s"] > 0
        assert f"| gpt2-124m | bf16 | compile | {' '.join(SPEED_FLAGS)} | 16 x 1024 |" in table
    assert rows[ALL32]["skipped"] == f"dry-run: runs the same suite code as {ALL16} (tiny model, eager, on CPU)"
    assert rows[ALL32]["baseline"] == "gpt2-124m-bf16-compile-mb32-train"

    # Llama 3 8B's shape in 4 blocks: its CPU twin is a config-file shape too; fp8 needs CUDA
    bf16, fp8 = rows[LLAMA3.format("bf16")], rows[LLAMA3.format("fp8")]
    assert bf16["result"]["tokens_per_s"] > 0 and bf16["dry_run_as"]["model"] == "tiny", bf16
    assert (bf16["micro_batch"], bf16["seq_len"]) == (2, 4096)
    assert "n_layers = 3" in (out / "rows" / bf16["id"] / "config.toml").read_text()
    assert fp8["skipped"].startswith("needs CUDA") and fp8["baseline"] == bf16["id"]
    assert "| llama3-8b-4l | bf16 | compile | - | 2 x 4096 |" in table


def _suite_modules(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)  # the suite's modules import each other by name
    import gpu_suite_machine
    import gpu_suite_report
    import gpu_suite_rows

    return gpu_suite_rows, gpu_suite_machine, gpu_suite_report


def test_speed_rows_come_first_each_flag_against_the_same_calls_baseline(monkeypatch):
    rows_mod, _, _ = _suite_modules(monkeypatch)
    rows = rows_mod.GPU_ROWS
    assert len({r.id for r in rows}) == len(rows)
    base16, base32 = "gpt2-124m-bf16-compile-mb16-train", "gpt2-124m-bf16-compile-mb32-train"
    expected = [(base16, None)]
    expected += [(f"gpt2-124m-bf16-compile+{f[2:]}-mb16-train", base16) for f in SPEED_FLAGS]
    expected += [(ALL16, base16), (base32, None), (ALL32, base32), (LLAMA3.format("bf16"), None),
                 (LLAMA3.format("fp8"), LLAMA3.format("bf16"))]
    assert [(r.id, r.baseline) for r in rows[:len(expected)]] == expected
    llama = rows[len(expected) - 2]
    assert (llama.model, dict(llama.shape), llama.micro_batch, llama.seq_len) == ("llama3-8b", {"n_layers": 4}, 2, 4096)
    argv = rows_mod.command(rows[1], Path("/r"), "cuda", Path("/p.json"), None)
    assert argv[argv.index("train") + 1:].count("--bf16-residual") == 1

    # the plain loop a flag row is read against builds the same model code: the model's own flags, never the loop's
    by_id = {r.id: r for r in rows}
    qkv, loss = by_id["gpt2-124m-bf16-compile+fused-qkv-mb16-train"], by_id["gpt2-124m-bf16-compile+fused-loss-mb16-train"]
    assert loss.pair == "gpt2-124m-bf16-compile-mb16-plain" and loss.pair in by_id
    assert by_id[qkv.pair].flags == ("fused_qkv",) and by_id[qkv.pair].kind == "plain"
    assert by_id[by_id[ALL16].pair].flags == rows_mod.MODEL_CODE_FLAGS and by_id[ALL32].pair in by_id
    plain_argv = rows_mod.command(by_id[qkv.pair], Path("/r"), "cuda", Path("/p.json"), None)
    assert "--fused-qkv" in plain_argv and "--fused-loss" not in plain_argv
    verify = by_id["verify-gpt2-124m-bf16-compile+all-flags"]
    assert all(f in rows_mod.command(verify, Path("/r"), "cuda", Path("/p.json"), None) for f in SPEED_FLAGS)


def test_a_flag_train_lacks_skips_its_rows_in_one_line(monkeypatch):
    rows_mod, machine_mod, _ = _suite_modules(monkeypatch)
    machine = machine_mod.probe_machine(dry_run=True)
    machine["train_options"] = machine["train_options"] - {"fused_loss"}
    reasons = {r.id: machine_mod.skip_reason(r, machine, dry_run=True) for r in rows_mod.SPEED_ROWS}
    line = "this paratrain's train has no --fused-loss (paratrain train --help)"
    assert reasons["gpt2-124m-bf16-compile+fused-loss-mb16-train"] == line
    assert reasons[ALL16] == reasons[ALL32] == line
    assert reasons["gpt2-124m-bf16-compile+fused-qkv-mb16-train"] is None


def test_fp8_rows_read_against_the_bf16_peak_and_their_baseline(monkeypatch):
    _, _, report = _suite_modules(monkeypatch)

    def train_row(dtype, tokens_per_s, mfu, baseline=None):
        return {"id": LLAMA3.format(dtype), "kind": "train", "model": "llama3-8b-4l", "dtype": dtype,
                "mode": "compile", "flags": [], "micro_batch": 2, "seq_len": 4096, "baseline": baseline,
                "result": {"tokens_per_s": tokens_per_s, "step_time_s": 8192 / tokens_per_s, "mfu": mfu,
                           "peak_mem_gib": 40.0}}

    suite = {"device": "gpu", "state": "complete", "torch": "t", "torchao": "a", "paratrain": "p", "dry_run": False,
             "elapsed_s": 1.0, "budget_s": 2.0, "peak_tflops": {"bf16": 1000.0, "fp8": 2000.0}}
    doc = {"suite": suite, "rows": [train_row("bf16", 40000.0, 0.40),
                                    train_row("fp8", 50000.0, 0.25, baseline=LLAMA3.format("bf16"))]}
    table = report.markdown(doc)
    assert "| 40,000 | 204.8 | 40.0% | 40.0% | - |" in table  # bf16: its own MFU, no baseline
    assert "| 50,000 | 163.8 | 25.0% (fp8 peak) | 50.0% | 1.250 |" in table
    assert report.bf16_equivalent_mfu(0.25, "fp8", None) is None  # no catalog peaks (an unknown GPU): no figure


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
