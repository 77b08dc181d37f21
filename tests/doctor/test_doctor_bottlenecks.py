"""Injected bottlenecks: each run of `paratrain doctor --json` must name the injected cause as its top finding.

Models are tiny and runs short (2 warm-up + 2-8 measured steps); only communication and allocation need
two processes. The injected causes are large on purpose, so the ranking holds on a busy machine. The runs are in
this process (cli_here: no interpreter start), except allocation's, whose workers must start with its threads.
"""

import json
import os

import pytest

from helpers import plugin_env

# what these tests measure is a share of a step's time: under -n no other test runs beside them (conftest.py)
pytestmark = pytest.mark.alone

CONTRACT = {"breakdown", "findings", "trace"}
BREAKDOWN = {"compute", "communication_exposed", "data_wait", "host_overhead", "bubble", "other"}

# a step dominated by a few large matmuls: nothing but the injected cause should show
HEALTHY = """model = "tiny"
dim = 512
ffn_dim = 1536
n_layers = 1
seq_len = 64
global_batch = 4
strategy = "single"
nproc = 1
"""


def doctor(cli, tmp_path, *args, toml=None, env=None):
    if toml is not None:
        (tmp_path / "run.toml").write_text(toml)
        args = ("--config", str(tmp_path / "run.toml"), *args)
    res = cli("doctor", "--json", "--timeout-s", "120", *args, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = res.json()
    assert CONTRACT <= set(report) and set(report["breakdown"]) == BREAKDOWN
    assert sum(report["breakdown"].values()) == pytest.approx(1.0, abs=1e-3)
    for f in report["findings"]:
        assert {"cause", "severity", "evidence", "fix"} <= set(f) and f["severity"] in ("high", "medium", "low")
    assert report["findings"], res.stderr[-2000:]
    return report


def causes(report):
    return [(f["cause"], f["severity"], round(f["score"], 3)) for f in report["findings"]]


@pytest.mark.timeout(300)
def test_sleeping_loader_is_data_loading_and_trace_opens(cli_here, tmp_path):
    # one layer, one 8-token sequence: a step takes a few ms, the loader 50 ms per batch, or 3x the longest step
    # where a busy machine makes that longer (support/step_share.py); 6 measured steps, so that one preempted step
    # moves the shares less
    toml = 'model = "tiny"\nn_layers = 1\nseq_len = 8\nglobal_batch = 1\nstrategy = "single"\nnproc = 1\n'
    report = doctor(cli_here, tmp_path, "--steps", "6", "--trace", "trace.json", toml=toml,
                    env=plugin_env("support.loader_delay:plugin", PARATRAIN_TEST_LOADER_DELAY_S="0.05",
                                   PARATRAIN_TEST_DELAY_STEP_SHARE="3"))
    assert report["findings"][0]["cause"] == "data_loading", causes(report)
    assert report["findings"][0]["severity"] == "high"
    assert report["breakdown"]["data_wait"] > 0.3
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"paratrain.forward", "paratrain.optimizer", "paratrain.data_wait"} <= names
    assert any(e.get("name") == "process_name" and e["args"]["name"] == "rank 0" for e in trace["traceEvents"])
    assert all("ts" in e for e in trace["traceEvents"] if e.get("ph") == "X")


@pytest.mark.timeout(300)
def test_tiny_model_and_batch_is_small_compute(cli_here, tmp_path):
    # 8 measured steps: on a busy machine one preempted step of three could move a share by 20 points
    report = doctor(cli_here, tmp_path, "--strategy", "single", "--nproc", "1", "--global-batch", "1", "--seq-len", "8",
                    "--steps", "8")
    top = report["findings"][0]
    assert top["cause"] == "small_compute", causes(report)
    assert "--micro-batch" in top["fix"]


@pytest.mark.timeout(300)
def test_misaligned_vocab_and_hidden_are_shapes_with_padded_sizes(cli_here, tmp_path):
    toml = 'model = "tiny"\nvocab_size = 50257\ndim = 96\nseq_len = 16\nglobal_batch = 2\nstrategy = "single"\n' \
           'nproc = 1\n'
    report = doctor(cli_here, tmp_path, "--steps", "2", toml=toml)
    top = report["findings"][0]
    assert top["cause"] == "shapes", causes(report)
    assert top["numbers"]["padded"] == {"vocab_size": 50304, "dim": 128}
    assert "vocab_size = 50304" in top["fix"] and "dim = 128" in top["fix"]


@pytest.mark.timeout(300)
def test_memory_above_budget_suggests_zero3_ac_and_accumulation(cli_here, tmp_path):
    report = doctor(cli_here, tmp_path, "--strategy", "single", "--nproc", "1", "--global-batch", "4", "--seq-len", "16",
                    "--steps", "2", "--mem-budget-gib", "0.1")
    top = report["findings"][0]
    assert top["cause"] == "memory" and top["severity"] == "high", causes(report)
    assert top["numbers"]["ratio"] > 0.9
    assert "--strategy zero3" in top["fix"] and "--ac full" in top["fix"] and "--micro-batch" in top["fix"]


@pytest.mark.timeout(300)
def test_large_model_under_ddp_on_gloo_is_communication(cli_here, tmp_path):
    # 4.8M parameters (a wide vocabulary) and 16 tokens per rank: the 19 MiB all-reduce dominates the step
    toml = 'model = "tiny"\nvocab_size = 8192\ndim = 256\nffn_dim = 768\nn_layers = 1\nseq_len = 16\n' \
           'global_batch = 2\nstrategy = "ddp"\nnproc = 2\n'
    report = doctor(cli_here, tmp_path, "--steps", "3", toml=toml)
    top = report["findings"][0]
    assert top["cause"] == "communication", causes(report)
    assert top["numbers"]["bytes_per_step"] > 10 * 2**20
    for hint in ("--ddp-comm-hook", "--strategy zero2", "--global-batch", "bucket"):
        assert hint in top["fix"]


@pytest.mark.timeout(300)
def test_more_threads_than_cores_per_rank_is_allocation(cli, tmp_path):
    cores = len(os.sched_getaffinity(0))
    # every rank may use all cores: 2 ranks x cores threads = 2x oversubscribed (passive waits keep it short)
    env = {"OMP_NUM_THREADS": str(cores), "OMP_WAIT_POLICY": "PASSIVE"}
    report = doctor(cli, tmp_path, "--strategy", "ddp", "--nproc", "2", "--steps", "2", toml=HEALTHY, env=env)
    top = report["findings"][0]
    assert top["cause"] == "allocation" and top["severity"] == "high", causes(report)
    assert f"OMP_NUM_THREADS={max(1, cores // 2)}" in top["fix"]


@pytest.mark.timeout(300)
def test_metrics_off_is_monitoring_low(cli_here, tmp_path):
    report = doctor(cli_here, tmp_path, "--no-metrics", "--steps", "3", toml=HEALTHY)
    top = report["findings"][0]
    assert top["cause"] == "monitoring" and top["severity"] == "low", causes(report)
    assert all(f["severity"] == "low" for f in report["findings"]), causes(report)
