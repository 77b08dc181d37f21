"""Issue 34: a stalled rank is named, with the collective its peers wait in and its own last phase; a killed one
is named as dead. Rank 3 of 4 stalls (tests/support/hang_points.py, through the trainer's hooks) so naming it is
no process of elimination. One 4-rank launch per case: a run ends at its first fault. Every run ends within its
timeout, non-zero, its last line naming the culprit, and leaves no rank behind (this replaced test_stall.py).
The stalls run in this process (cli_here: the ranks fork from the warm forkserver, their output and pids kept by
support/rank_output.py); the killed rank's run is a process of its own, whose stderr is read to its end.

Issue 44: a rank stopped by SIGSTOP (the ddp case) writes nothing more, so its peers' records give its step, and
the launcher kills it once they time out; with --json a failed run prints the error, the rank and the last
completed step; the killed rank's data-loader workers (document data) print nothing after the last line; each
rank is named in `ps -o comm`."""

from __future__ import annotations

import json
import os
import time

import pytest

from helpers import plugin_env, run_cli
from paratrain.train.recovery.hang_report import diagnose
from reliability.inproc import run_cli_inproc
from support.doc_corpus import make_corpus
from support.rank_output import alive

TIMEOUT_S = 3
BASE = ["--nproc", "4", "--steps", "4", "--timeout-s", str(TIMEOUT_S), "--seq-len", "32", "--global-batch", "8",
        "--micro-batch", "2"]
# case: (paratrain train options, where rank 3 stops, words the culprit line must hold)
CASES = {
    "ddp-grad-all-reduce": (["--strategy", "ddp"], "stop", ["all_reduce", "on dp_replicate", "forward_backward"]),
    "fsdp-all-gather": (["--strategy", "zero3"], "compute", ["all_gather", "on dp_shard", "forward_backward"]),
    "tp-collective": (["--strategy", "tp", "--model", "tiny-mha"], "compute", ["on tp", "forward_backward"]),
    "pp-send-recv": (["--strategy", "pp", "--model", "tiny4"], "compute", ["with rank 2 on pp", "forward_backward"]),
    "cp-ring": (["--strategy", "cp-ring"], "compute", ["with rank 0 on cp", "forward_backward"]),
    "loss-all-reduce": (["--strategy", "ddp"], "optimizer", ["all_reduce", "on dp", "optimizer"]),
}


def assert_no_rank_left(pids: list[int]) -> None:
    assert len(pids) == 4, pids  # every rank wrote its pid
    deadline = time.monotonic() + 10  # the forkserver reaps its children a moment after they exit
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], left


def failed_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("failed: "), stderr[-3000:]
    return lines[-1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_stalled_rank_is_named(cli_here, tmp_path, case):
    options, point, words = CASES[case]
    env = plugin_env("support.hang_points:plugin", PARATRAIN_HANG_AT=f"3:3:{point}")
    run = cli_here("train", *BASE, *options, "--out", str(tmp_path / "run"), "--json", env=env, ranks=True)
    assert run.returncode == 1, run.stderr[-3000:]
    line = failed_line(run.stderr)
    assert line.startswith("failed: rank 3 never reached "), line
    culprit = line.split(" [")[0]
    assert all(w in culprit for w in words) and "step 3" in culprit, line
    assert "Traceback" not in run.stderr
    # one JSON document all the same: the error line, the rank it blames, the last step every rank finished
    assert run.json() == {"error": line.removeprefix("failed: "), "rank": 3, "step": 2,
                          "run_dir": str(tmp_path / "run")}
    stopped = "rank 3 (pid " in run.stderr and ") is stopped (SIGSTOP) and cannot exit: killed it" in run.stderr
    assert stopped == (point == "stop"), run.stderr[-3000:]  # killed at once, not after the agent's 30 s grace
    assert_no_rank_left(run.rank_pids)
    if case == "ddp-grad-all-reduce":  # afterwards, from the files alone (in this process: it starts no worker)
        code, out, err = run_cli_inproc(["doctor", "--hang", str(tmp_path / "run"), "--json"])
        assert code == 0, err[-2000:]
        finding = json.loads(out)["findings"][0]
        assert finding == {**finding, "cause": "hang", "evidence": culprit.removeprefix("failed: ")}, finding


@pytest.mark.timeout(120)
def test_killed_rank_is_named_dead(tmp_path):
    """On document data: each rank's loader worker outlives a killed rank unless the launcher stops it (it printed
    a FileNotFoundError traceback after the last line). run_cli reads stderr to its end, after every writer, so
    failed_line() checks that nothing came after the last line."""
    corpus = make_corpus(tmp_path / "corpus")
    env = plugin_env("support.hang_points:plugin", "support.process_names:plugin", PARATRAIN_HANG_AT="3:3:kill",
                     PARATRAIN_NAMES_DIR=str(tmp_path / "names"))
    base = list(BASE)
    base[base.index("--timeout-s") + 1] = "30"  # a kill needs no timeout; a loaded machine may start a loader slowly
    run = run_cli("train", *base, "--strategy", "ddp", "--data", corpus["a"], "--tokenizer", corpus["tok"],
                  "--vocab-size", "320", "--out", str(tmp_path / "run"), "--json", timeout=90, env=env)
    assert run.returncode == 1, run.stderr[-3000:]
    line = failed_line(run.stderr)
    assert line.startswith("failed: rank 3 died ("), line
    assert "never reached" not in line, line
    assert "FileNotFoundError" not in run.stderr and "leaked" not in run.stderr, run.stderr[-3000:]
    assert run.json() == {"error": line.removeprefix("failed: "), "rank": 3, "step": 2,
                          "run_dir": str(tmp_path / "run")}
    names = {p.name: p.read_text() for p in (tmp_path / "names").iterdir()}
    assert names == {f"rank-{r}": f"pt-rank{r}/4" for r in range(4)}  # as `ps -o comm` shows each rank


def test_diagnosis_from_planted_records():
    """The rule on its own: the waiting ranks are not blamed, the one that stopped short is, once."""
    def entry(seq, retired=True, group="1"):
        return {"collective_seq_id": seq, "is_p2p": False, "profiling_name": "gloo:all_reduce",
                "process_group": [group, "mesh_dp_shard"], "retired": retired}

    groups = {"1": {"dim": "dp_shard", "ranks": [0, 1, 2, 3]}}
    waiting = {r: {"rank": r, "reason": "timeout", "step": 3, "phase": "forward_backward", "groups": groups,
                   "torch": [entry(36), entry(37, retired=False)]} for r in range(3)}
    stalled = {"rank": 3, "reason": "stalled", "step": 3, "phase": "optimizer", "groups": groups,
               "torch": [entry(36)]}
    assert diagnose({**waiting, 3: stalled}) == [
        "rank 3 never reached all_reduce #37 on dp_shard (step 3, last seen in optimizer)"]
    assert diagnose({**waiting, 3: {**stalled, "torch": [entry(37)]}}) == []  # it did arrive: nobody to blame
    assert diagnose(waiting, {0: 1, 1: 1, 2: 1, 3: -9}) == [
        "rank 3 died (SIGKILL; the others were in all_reduce #37 on dp_shard, step 3)"]
    assert diagnose(waiting, {0: -15, 3: -15}) == [
        "rank 3 never reached all_reduce #37 on dp_shard (it wrote no record)"]
    # a peer found gone after the launcher stopped it (SIGTERM) did not die: only the killed one is named
    lost = {**waiting[0], "reason": "lost_peer", "dead_peers": [1, 3], "time": 1.0}
    assert diagnose({**waiting, 0: lost}, {1: -15, 3: -9}) == [
        "rank 3 died (SIGKILL; the others were in all_reduce #37 on dp_shard, step 3)"]
    # a stopped (SIGSTOP) rank the launcher killed once a peer timed out (its exit: None) did not die either, though
    # a peer still waiting on a loaded machine then finds it gone: it is named for the collective it never reached
    stopped = {**stalled, "reason": "started"}
    assert diagnose({**waiting, 1: {**lost, "rank": 1, "dead_peers": [3]}, 3: stopped}, {0: 1, 1: 1, 2: 1, 3: None}) == [
        "rank 3 never reached all_reduce #37 on dp_shard (step 3, last seen in optimizer)"]


@pytest.mark.timeout(120)
def test_recorder_writes_when_stalled_and_a_run_that_ends_well_leaves_nothing(tmp_path):
    from paratrain.train.hooks import Hooks
    from paratrain.train.recovery.flight_recorder import FlightRecorder

    hooks = Hooks()
    recorder = FlightRecorder(0, tmp_path / "hang", stall_after_s=0.2)
    recorder.attach(hooks)
    hooks.phase("start")  # the first mark writes a "started" record (its pid: how a dead rank is told)
    record = json.loads((tmp_path / "hang" / "rank-0.json").read_text())
    assert record["reason"] == "started" and record["pid"] == os.getpid() and record["phase"] == "forward_backward"
    # no progress for 0.2 s: the watchdog writes again (however long that takes on a loaded machine; the test's
    # own timeout ends a watchdog that never writes)
    while json.loads((tmp_path / "hang" / "rank-0.json").read_text())["reason"] != "stalled":
        time.sleep(0.05)
    recorder.close()
    assert not (tmp_path / "hang").exists()
    hooks.phase("optimizer")  # detached: nothing more is recorded
    assert recorder.phase == "forward_backward"
