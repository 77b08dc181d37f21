"""`paratrain plan` as users run it (its main(), in this process: a plan starts no worker): the acceptance
command, fixed degrees, --hf-config, errors, fits-nowhere."""

from __future__ import annotations

import json

import pytest

CONTRACT = ("strategy", "dims", "pp_schedule", "microbatches", "micro_batch", "activation_checkpointing",
            "memory_gib", "step_time_s", "tokens_per_s_per_device", "mfu", "comm_bytes_per_step",
            "bubble_fraction", "feasible", "reasons")
MEMORY = ("params", "grads", "optimizer", "activations", "other", "total")


@pytest.mark.timeout(300)
def test_llama3_8b_on_8_h100(cli_inproc):
    res = cli_inproc("plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--seq-len", "8192",
              "--global-batch", "16", "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["model"]["name"] == "llama3-8b" and doc["model"]["params"] > 8e9
    assert doc["cluster"]["gpu"] == "h100-sxm" and doc["cluster"]["gpus"] == 8 and doc["cluster"]["nodes"] == 1
    assert doc["recommended"] == 0 and doc["fits"]
    cands = doc["candidates"]
    assert len(cands) >= 3
    for cand in cands:
        assert all(k in cand for k in CONTRACT), set(CONTRACT) - set(cand)
        assert all(k in cand["memory_gib"] for k in MEMORY)
        assert cand["reasons"] and all(isinstance(r, str) and r for r in cand["reasons"])
        assert set(cand["dims"]) == {"pp", "dp_replicate", "dp_shard", "cp", "ep", "tp"}
        parts = sum(cand["memory_gib"][k] for k in MEMORY[:-1])
        assert parts == pytest.approx(cand["memory_gib"]["total"], abs=1e-3)
    feasible = [c for c in cands if c["feasible"]]
    times = [c["step_time_s"] for c in feasible]
    assert times == sorted(times)
    best = feasible[0]
    # 8B parameters x 16 bytes of model states cannot sit unsharded on one 80 GB GPU
    assert best["dims"]["dp_shard"] > 1 or best["dims"]["tp"] > 1 or best["dims"]["pp"] > 1
    assert best["memory_gib"]["total"] <= 80 and 0.05 < best["mfu"] < 0.8
    assert any("ZeRO-3 needed" in r or "ZeRO-2 needed" in r or "TP" in r or "pipeline" in r for r in best["reasons"])


def test_unknown_gpu_exits_2_listing_known_names(cli_inproc):
    res = cli_inproc("plan", "--model", "tiny", "--gpu", "v100", "--gpus", "2")
    assert res.returncode == 2
    assert "h100-sxm" in res.stderr and "rtx4090" in res.stderr and res.stderr.count("\n") == 1


@pytest.mark.timeout(200)
def test_fits_nowhere_names_the_smallest_gpu_count(cli_inproc):
    res = cli_inproc("plan", "--model", "llama3-8b", "--gpu", "rtx4090", "--gpus", "2", "--seq-len", "2048",
              "--global-batch", "16", "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert not doc["fits"] and doc["recommended"] is None
    assert all(not c["feasible"] for c in doc["candidates"])
    n = doc["smallest_gpus_that_fit"]
    assert isinstance(n, int) and n > 2 and f"is {n}" in doc["message"]


@pytest.mark.timeout(200)
def test_fixed_degrees_and_hf_config(cli_inproc, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 8, "n_inner": None,
                                  "vocab_size": 4096, "n_positions": 512, "tie_word_embeddings": False}))
    res = cli_inproc("plan", "--hf-config", str(config), "--gpu", "a100-80", "--gpus", "4", "--tp", "2", "--ac", "none",
              "--seq-len", "512", "--global-batch", "8", "--json", "--top", "4")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["model"]["family"] == "gpt2"
    assert doc["candidates"] and all(c["dims"]["tp"] == 2 and c["activation_checkpointing"] == "none"
                                     for c in doc["candidates"])


def test_custom_hardware(cli_inproc):
    res = cli_inproc("plan", "--model", "tiny", "--peak-tflops", "100", "--mem-gib", "16", "--intra-node-gbs", "64",
              "--inter-node-gbs", "12.5", "--gpus", "2", "--seq-len", "64", "--global-batch", "4", "--json", "--top", "3")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["cluster"]["gpu"] == "custom" and doc["cluster"]["mem_gib"] == 16 and doc["fits"]


_WARM_PLAN = """
import sys
from paratrain.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    assert not exc.code, exc.code
print("torch imported:", "torch" in sys.modules, file=sys.stderr)
"""


@pytest.mark.timeout(300)
def test_a_plan_from_the_trace_cache_does_not_import_torch(tmp_path):
    """The first plan traces (and imports torch); the same plan again answers from the disk cache alone, without
    importing torch (what made a warm plan cost seconds). A traced-code import at module level fails this."""
    import os
    import subprocess
    import sys

    from helpers import cli_env

    args = ["plan", "--model", "small", "--gpu", "a100-80", "--gpus", "8", "--seq-len", "1024", "--global-batch",
            "16", "--json"]
    env = cli_env({"PARATRAIN_CACHE": str(tmp_path)})  # its own cache: the first run is cold whatever ran before
    runs = [subprocess.run([sys.executable, "-c", _WARM_PLAN, *args], capture_output=True, text=True, env=env,
                           timeout=240, cwd=os.getcwd()) for _ in range(2)]
    for res in runs:
        assert res.returncode == 0, res.stderr
    assert "torch imported: True" in runs[0].stderr  # the cold run traced
    assert "torch imported: False" in runs[1].stderr, runs[1].stderr[-2000:]
    assert json.loads(runs[0].stdout)["candidates"] == json.loads(runs[1].stdout)["candidates"]


_AS_THE_CLI = """
import atexit, sys
atexit.register(lambda: sys.stderr.write("atexit ran\\n"))
from paratrain.cli import main
sys.argv = ["paratrain", *sys.argv[1:]]
main()
"""


@pytest.mark.timeout(300)
def test_the_cli_process_skips_teardown_after_a_plan_and_only_then():
    """`paratrain plan` leaves with os._exit once its output is flushed (interpreter teardown with torch imported
    costs ~0.7 s): atexit handlers do not run, and the JSON is whole. A failing command exits as before."""
    import os
    import subprocess
    import sys

    from helpers import cli_env

    ok = ["plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "2", "--seq-len", "64", "--global-batch", "8",
          "--dtype", "fp32", "--json"]
    runs = [subprocess.run([sys.executable, "-c", _AS_THE_CLI, *argv], capture_output=True, text=True, env=cli_env(),
                           timeout=240, cwd=os.getcwd()) for argv in (ok, ok[:-3] + ["--gpus", "0", "--json"])]
    assert runs[0].returncode == 0, runs[0].stderr[-2000:]
    assert json.loads(runs[0].stdout)["candidates"] and "atexit ran" not in runs[0].stderr
    assert "# strategy" in runs[0].stderr  # the table on stderr was flushed too
    assert runs[1].returncode == 2 and "atexit ran" in runs[1].stderr, runs[1].stderr[-2000:]
