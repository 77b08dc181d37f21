"""train --heal-replicas (train/recovery/replica_heal.py): one DDP replica of 3 is SIGKILLed inside a step with no
checkpoint directory; the other two keep stepping in the same processes, the replacement copies its state from a live peer,
and at the end the 3 replicas hold bit-identical parameters and optimizer states. The reference is the replicas
themselves (each other's state, compared bit for bit). The identical-state check is shown to fail when a joiner
copies the weights but not the optimizer state, and what healing cannot cover is refused in one line."""

from __future__ import annotations

import io
import json
import pickle
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import plugin_env, run_cli
from paratrain.config import load_config
from paratrain.errors import UserError
from paratrain.train.recovery.replica_heal import load_replica_state, replica_state, state_differences
from paratrain.train.recovery.replica_launch import check_heal_run

REPLICAS, STEPS, KILLED, KILL_AFTER, HOLD_AFTER, GLOBAL_BATCH = 3, 10, 1, 3, 6, 12


def step_log(path: Path) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in line.split()) for line in path.read_text().splitlines()]


@pytest.mark.timeout(180)
def test_lost_replica_is_healed_from_a_peer_without_a_restart(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    env = plugin_env("support.replica_faults:plugin", PARATRAIN_TEST_REPLICA_DIR=str(marks),
                     PARATRAIN_TEST_KILL_REPLICA=f"{KILLED}:{KILL_AFTER + 1}:compute",
                     PARATRAIN_TEST_HOLD_AFTER=str(HOLD_AFTER))
    run = run_cli("train", "--strategy", "ddp", "--nproc", str(REPLICAS), "--heal-replicas",
                  "--max-restarts", "1", "--steps", str(STEPS), "--global-batch", str(GLOBAL_BATCH),
                  "--seq-len", "32", "--timeout-s", "60", "--out", str(tmp_path / "run"), "--json",
                  env=env, timeout=150)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = run.json()
    assert summary["steps"] == STEPS and summary["replica_restarts"] == 1
    assert summary["replicas_finished"] == [0, 1, 2]
    # the run's summary and its first line describe the whole run (3 replicas), not replica 0's world of 1
    assert summary["world_size"] == REPLICAS and summary["dims"]["dp_replicate"] == REPLICAS
    assert summary["layout"]["micro_batch"] == GLOBAL_BATCH // REPLICAS
    assert run.stderr.splitlines()[0].startswith("paratrain: training tiny (")
    assert f"with ddp [{REPLICAS} replicas, --heal-replicas] on {REPLICAS} x cpu" in run.stderr.splitlines()[0]
    # torchft's checkpoint server (it served the heal) writes no access-log line to the user's terminal
    assert "HTTP/1." not in run.stderr + run.stdout and "GET /checkpoint" not in run.stderr
    # no checkpoint anywhere: the replacement's state can only have come from a peer
    assert not list(tmp_path.rglob("checkpoints")) and not list(tmp_path.rglob("step-*"))

    # the survivors: one process each, every step 1..STEPS in order; the step the kill broke is not committed, is
    # logged again under the step before it, and redone (never restarted, never rewound further)
    for index in (0, 2):
        log = step_log(marks / f"steps-r{index}.txt")
        assert len({pid for pid, _ in log}) == 1, log
        redone = [*range(1, KILL_AFTER + 1), KILL_AFTER, *range(KILL_AFTER + 1, STEPS + 1)]
        assert [step for _, step in log] == redone, log
        assert f"replica {index}: step {KILL_AFTER + 1} not committed" in run.stderr
    # the lost replica: its first process stops at the kill; the replacement starts at a later step and finishes
    log = step_log(marks / f"steps-r{KILLED}.txt")
    pids = list(dict.fromkeys(pid for pid, _ in log))
    assert len(pids) == 2, log
    first = [s for p, s in log if p == pids[0]]
    second = [s for p, s in log if p == pids[1]]
    assert first == list(range(1, KILL_AFTER + 1)), log
    rejoined = second[0]
    assert rejoined > HOLD_AFTER and second == list(range(rejoined, STEPS + 1)), log
    assert f"replica {KILLED} restarted" in run.stderr
    copied = f"replica {KILLED}: copied the weights, optimizer state and step {rejoined - 1} from replica"
    assert copied in run.stderr

    # every replica's summary: the same skipped-sample count, the local batch of each missing replica-step
    summaries = {p.name: json.loads(p.read_text()) for p in (tmp_path / "run" / "replicas").glob("summary-*.json")}
    assert sorted(summaries) == ["summary-r0-a0.json", "summary-r1-a1.json", "summary-r2-a0.json"]
    local = GLOBAL_BATCH // REPLICAS
    for name, s in summaries.items():
        assert s["samples_skipped"] == summary["samples_skipped"] > 0, name
        assert s["samples_skipped"] == local * sum(REPLICAS - n for _, n in s["short_steps"]), name
        short = {step for step, _ in s["short_steps"]}
        assert set(range(KILL_AFTER + 1, rejoined)) <= short, (name, s["short_steps"])
    assert summaries["summary-r1-a1.json"]["healed_at"]["step"] == rejoined - 1
    assert summaries["summary-r1-a1.json"]["healed_at"]["from_replica"] in (0, 2)
    # the run's own summary lists the heal: which replica (its second process), at which step, from whom
    healed_from = summaries["summary-r1-a1.json"]["healed_at"]["from_replica"]
    assert summary["healed_at"] == [{"replica": KILLED, "attempt": 1, "step": rejoined - 1,
                                     "from_replica": healed_from}]

    # the end: parameters and optimizer states bit-identical across the 3 replicas
    states = {p.name: torch.load(p, weights_only=True) for p in marks.glob("state-*.pt")}
    assert sorted(states) == ["state-r0-a0.pt", "state-r1-a1.pt", "state-r2-a0.pt"]
    reference = states["state-r0-a0.pt"]
    assert reference["step"] == STEPS and reference["optimizers"][0]["state"]
    for name, state in states.items():
        assert state_differences(reference, state) == [], name


def _sent(state: dict) -> dict:
    """The state as a joiner receives it: serialized and read back (torchft's transport), sharing no tensor."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _replica(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return SimpleNamespace(step_runner=SimpleNamespace(model_parts=[model]), optimizers=[opt], step=0)


def _train(replica, batches) -> None:
    model, opt = replica.step_runner.model_parts[0], replica.optimizers[0]
    for x in batches:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        replica.step += 1


def test_identical_state_check_fails_when_the_joiner_skips_the_optimizer_state():
    """Reference: a live replica trained 3 steps. A joiner that copies its whole state and then trains on the same
    batches stays bit-identical; one that copies only the weights (a planted fault) is caught, at the optimizer
    state first and then, one step on, at the weights too."""
    data = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    peer = _replica()
    _train(peer, data[:3])

    good = _replica(seed=1)
    load_replica_state(good, _sent(replica_state(peer)))
    assert state_differences(replica_state(peer), replica_state(good)) == []

    faulty = _replica(seed=1)
    copied = _sent(replica_state(peer))
    faulty.step_runner.model_parts[0].load_state_dict(copied["model"][0])  # the fault: no optimizer state copied
    faulty.step = copied["step"]
    found = state_differences(replica_state(peer), replica_state(faulty))
    assert found and all(path.startswith("/optimizers") for path in found), found

    for replica in (peer, good, faulty):
        _train(replica, data[3:])
    assert state_differences(replica_state(peer), replica_state(good)) == []
    found = state_differences(replica_state(peer), replica_state(faulty))
    assert any(path.startswith("/model") for path in found), found


class _RunsCode:
    """A payload that, unpickled without weights_only, touches `marker`: what a hostile peer could send."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # copied in on load (replica_worker.py)
def test_a_peer_state_arrives_weights_only_and_serving_it_logs_nothing(tmp_path, capfd):
    """Reference: the state a live replica sends (replica_state) arrives bit-identical over the transport a healing
    replica uses; a payload that would run code on unpickling is refused and does not run; torchft's checkpoint
    server writes no access-log line to the terminal."""
    from paratrain.train.recovery.replica_transport import peer_checkpoint_transport

    timeout = timedelta(seconds=30)
    peer, joiner = peer_checkpoint_transport(timeout), peer_checkpoint_transport(timeout)
    marker = tmp_path / "ran"
    try:
        state = replica_state(_replica())
        peer.send_checkpoint([1], 3, state, timeout)
        assert state_differences(state, joiner.recv_checkpoint(0, peer.metadata(), 3, timeout)) == []
        peer.send_checkpoint([1], 4, {"model": _RunsCode(marker)}, timeout)
        with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
            joiner.recv_checkpoint(0, peer.metadata(), 4, timeout)
    finally:
        peer.shutdown()
        joiner.shutdown()
    assert not marker.exists()
    captured = capfd.readouterr()
    # the access log's request lines ("GET /checkpoint/3/full HTTP/1.1" 200 -), not torchft's own log records (an
    # earlier in-process run's handler may print "Started CheckpointServer on http://.../checkpoint/" as a logging error)
    assert "GET /checkpoint/" not in captured.err + captured.out, captured.err


def test_heal_replicas_refuses_what_it_cannot_heal():
    """One UserError line each (the CLI prints it and exits 2): a sharded strategy, one replica, a comm hook."""
    cases = [({"strategy": "zero3"}, 3, r"takes no parallel degree \(got --strategy zero3\): ask for 3 replicas "
                                         "with --strategy ddp --nproc 3"),
             ({"strategy": "ddp", "tp": 2, "nproc": 4}, 4, r"\(got --tp 2\): .* --strategy ddp --nproc 4$"),
             ({}, 1, "--heal-replicas needs --nproc 2 or more"),
             ({"ddp_comm_hook": "powersgd"}, 3, "it takes no --ddp-comm-hook"),
             ({"global_batch": 16}, 3, "must be divisible by the 3 replicas"),
             ({"micro_batch": 3}, 3, r"each replica's batch \(4\) is not divisible by --micro-batch 3")]
    for overrides, world, message in cases:
        cfg = load_config(None, {"heal_replicas": True, "global_batch": 12, **overrides})
        with pytest.raises(UserError, match=message):
            check_heal_run(cfg, world, None)
