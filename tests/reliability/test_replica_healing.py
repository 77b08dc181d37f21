"""train --heal-replicas (train/recovery/replica_heal.py): one DDP replica of 3 is SIGKILLed inside a step with no
checkpoint directory; the other two keep stepping in the same processes, the replacement copies its state from a live peer
over the replicas' process group, and at the end the 3 replicas hold bit-identical parameters and optimizer states;
all the while, every listening socket of the run but torchft's manager servers is on loopback. The reference is the replicas
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
from reliability.procnet import is_loopback
from reliability.runs import run_train

REPLICAS, STEPS, KILLED, KILL_AFTER, HOLD_AFTER, GLOBAL_BATCH = 3, 10, 1, 3, 6, 12


def step_log(path: Path) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in line.split()) for line in path.read_text().splitlines()]


def with_sockets_at_kill(sampled: dict, marks: Path) -> dict:
    """The run's listening sockets by process: sampled from outside every 0.1 s, plus what each process the fault
    plugin SIGKILLed recorded of its own just before (support/replica_faults.py). The killed replica's first process
    lives from its manager's start to its kill only (3 steps), and on a loaded machine one sample of the whole tree
    (every process's descriptors and the machine's TCP tables) can take longer than that: the watcher never saw it
    (a flake: 3 of the 4 replica processes seen)."""
    merged = {pid: set(found) for pid, found in sampled.items()}
    for record in marks.glob("listening-*.json"):
        pid = int(record.stem.split("-")[1])
        merged.setdefault(pid, set()).update(tuple(entry) for entry in json.loads(record.read_text()))
    return merged


@pytest.mark.timeout(180)
def test_lost_replica_is_healed_from_a_peer_without_a_restart(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    env = plugin_env("support.replica_faults:plugin", PARATRAIN_TEST_REPLICA_DIR=str(marks),
                     PARATRAIN_TEST_KILL_REPLICA=f"{KILLED}:{KILL_AFTER + 1}:compute",
                     PARATRAIN_TEST_HOLD_AFTER=str(HOLD_AFTER))
    run = run_train(["--strategy", "ddp", "--nproc", str(REPLICAS), "--heal-replicas", "--max-restarts", "1",
                     "--steps", str(STEPS), "--global-batch", str(GLOBAL_BATCH), "--seq-len", "32", "--timeout-s",
                     "60", "--out", str(tmp_path / "run"), "--json"], cwd=tmp_path, env=env, timeout=150, watch=True)
    assert run.returncode == 0, run.stderr[-3000:]
    sockets = with_sockets_at_kill(run.listeners_by_process, marks)
    # every socket the run listened on, in every process of it and all through the heal, is on loopback, except
    # each replica's torchft manager server: one socket on [::] per replica process (torchft binds it there and
    # offers no option; docs/reliability.md). The peer's state travels over the replicas' process group, with no
    # server of its own (torchft's HTTP transport would be a second [::] socket in the process that serves it)
    beyond = {pid: found for pid, found in sockets.items() if any(not is_loopback(a) for a, _ in found)}
    assert beyond and all(len([a for a, _ in found if not is_loopback(a)]) == 1 for found in beyond.values()), sockets
    assert all(a == "::" for found in beyond.values() for a, _ in found if not is_loopback(a)), sockets
    assert len(beyond) >= REPLICAS + 1  # the 3 first replica processes and the replacement
    (killed,) = [int(p.stem.split("-")[1]) for p in marks.glob("listening-*.json")]
    assert killed in beyond, sockets  # the lost process's own record: its manager's socket, and only that, on [::]
    assert any(is_loopback(a) for found in sockets.values() for a, _ in found)  # the lighthouse, the stores
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


GROUPS, SHARDS, GROUP_STEPS, GROUP_KILL_AFTER, GROUP_HOLD_AFTER = 2, 2, 8, 2, 5


@pytest.mark.timeout(150)
def test_lost_rank_takes_its_hsdp_group_down_and_the_group_heals_from_a_live_one(tmp_path):
    """hsdp with --heal-replicas, 2 replicate groups x 2 shards (FSDP2 in each group, torchft across them): rank 1 of
    group 1 is SIGKILLed inside step 3 with no checkpoint; the supervisor stops the rest of group 1 and restarts the
    whole group, whose ranks each copy the same rank of group 0 (held after step 5 until then) and train on. The
    reference is the groups themselves: each rank's local shards, parameters and optimizer state, end bit-identical to
    the same rank's of the other group. Every listening socket but each group's torchft manager is on loopback, and
    the lost process's flight recorder is left behind."""
    marks = tmp_path / "marks"
    marks.mkdir()
    env = plugin_env("support.replica_faults:plugin", PARATRAIN_TEST_REPLICA_DIR=str(marks),
                     PARATRAIN_TEST_KILL_REPLICA=f"1/1:{GROUP_KILL_AFTER + 1}:compute",
                     PARATRAIN_TEST_HOLD_AFTER=str(GROUP_HOLD_AFTER))
    run = run_train(["--strategy", "hsdp", "--dp-replicate", str(GROUPS), "--dp-shard", str(SHARDS), "--nproc",
                     str(GROUPS * SHARDS), "--heal-replicas", "--max-restarts", "1", "--steps", str(GROUP_STEPS),
                     "--global-batch", "8", "--seq-len", "32", "--timeout-s", "60", "--out", str(tmp_path / "run"),
                     "--json"], cwd=tmp_path, env=env, timeout=140, watch=True)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = run.json()
    assert summary["steps"] == GROUP_STEPS and summary["replica_restarts"] == 1
    assert summary["replicas_finished"] == [0, 1] and summary["replicas"] == GROUPS
    assert summary["world_size"] == GROUPS * SHARDS
    assert (summary["dims"]["dp_replicate"], summary["dims"]["dp_shard"]) == (GROUPS, SHARDS)
    assert f"with hsdp [{GROUPS} replica groups x {SHARDS} shards, --heal-replicas] on 4 x cpu" in run.stderr
    # group 1 (its second processes) healed from group 0, after group 0 stepped past the hold, never from disk
    (heal,) = summary["healed_at"]
    assert heal["replica"] == 1 and heal["attempt"] == 1 and heal["from_replica"] == 0, heal
    assert GROUP_HOLD_AFTER <= heal["step"] < GROUP_STEPS, heal
    for rank in range(SHARDS):
        assert f"replica 1 rank {rank}: copied the weights, optimizer state and step {heal['step']} from replica 0" \
            in run.stderr
    assert not list(tmp_path.rglob("checkpoints")) and not list(tmp_path.rglob("step-*"))
    # group 0 stepped on alone from the broken step to the heal: each such step skipped group 1's 4 samples
    short = [step for step, groups in summary["short_steps"] if groups == 1]
    assert short == list(range(GROUP_KILL_AFTER + 1, heal["step"] + 1)), summary["short_steps"]
    assert summary["samples_skipped"] == 8 // GROUPS * len(short)
    # the survivors stepped on in one process each; the lost group's ranks both started over in new processes
    for rank in range(SHARDS):
        assert len({pid for pid, _ in step_log(marks / f"steps-r0-s{rank}.txt")}) == 1
        pids = list(dict.fromkeys(pid for pid, _ in step_log(marks / f"steps-r1-s{rank}.txt")))
        assert len(pids) == 2, pids

    # the end: rank r of group 1 holds bit for bit rank r of group 0's local shards (and the two ranks' differ)
    states = {p.name: torch.load(p, weights_only=True) for p in marks.glob("state-*.pt")}
    assert sorted(states) == [f"state-r{g}-a{g}-s{r}.pt" for g in range(GROUPS) for r in range(SHARDS)]
    for rank in range(SHARDS):
        mine, theirs = states[f"state-r0-a0-s{rank}.pt"], states[f"state-r1-a1-s{rank}.pt"]
        assert mine["step"] == GROUP_STEPS and mine["optimizers"][0]["state"]
        assert state_differences(mine, theirs) == [], rank
    assert state_differences(states["state-r0-a0-s0.pt"]["model"], states["state-r0-a0-s1.pt"]["model"])

    # sockets: beyond loopback only each group's torchft manager server, one [::] socket in its rank 0 process (the
    # first two groups' and the replacement's); the lost rank 1 listened on loopback alone
    sockets = with_sockets_at_kill(run.listeners_by_process, marks)
    beyond = {pid: [a for a, _ in found if not is_loopback(a)] for pid, found in sockets.items()}
    beyond = {pid: found for pid, found in beyond.items() if found}
    assert len(beyond) == GROUPS + 1 and all(found == ["::"] for found in beyond.values()), sockets
    (killed,) = [int(p.stem.split("-")[1]) for p in marks.glob("listening-*.json")]
    assert sockets[killed] and killed not in beyond, sockets
    # each replica process keeps a flight recorder (rank-N: N = group * 2 + rank): the lost group's two black boxes
    # stay (the killed rank's at its last completed step), the finished processes took theirs back
    boxes = sorted(p.relative_to(tmp_path / "run").as_posix() for p in (tmp_path / "run").rglob("hang/*"))
    assert boxes == [f"replicas/r1-a0/hang/rank-{n}.{ext}" for n in (2, 3) for ext in ("json", "step")], boxes
    box = json.loads((tmp_path / "run" / "replicas/r1-a0/hang/rank-3.json").read_text())
    assert box["pid"] == killed and box["rank"] == 3
    assert int((tmp_path / "run" / "replicas/r1-a0/hang/rank-3.step").read_text()) == GROUP_KILL_AFTER


ISLAND_STEPS, ISLAND_SYNC, ISLAND_KILL_AFTER = 24, 4, 3
# each lost-island run's semi-sync options: DiLoCo with an int4 outer sync (its encodings all-gathered over torchft's
# quorum), and Streaming DiLoCo with 2 fragments and --fragment-delay 1 in fp32 (torchft's all-reduce, started a step
# before it is applied; test_island_exchange.py has every dtype in-process)
ISLAND_RUNS = {"diloco-int4": ("diloco", 1, 0, "int4"), "streaming-delay-fp32": ("streaming-diloco", 2, 1, "fp32")}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("run_id", list(ISLAND_RUNS))
def test_lost_island_heals_from_a_live_one_and_the_global_copies_end_equal(tmp_path, run_id):
    """--semi-sync over 2 one-process islands with --heal-replicas: island 1 is SIGKILLed between two syncs (after
    step 3, H = 4) with no checkpoint; island 0 syncs on alone (from step 4 waiting for the replacement's model to
    be built, then pausing 50 ms a step until it took a step); the replacement waits for its next sync (where an
    all-reduce starts), copies its state there and syncs with it. The lost process's flight recorder is left behind. The reference is the islands
    themselves: at the end (a sync step) both hold bit-identical global copies and, without a delay (whose merge
    keeps half of each island's own), bit-identical parameters."""
    from paratrain.parallel.semi_sync.fragments import FragmentSchedule

    method, fragments, delay, dtype = ISLAND_RUNS[run_id]
    marks = tmp_path / "marks"
    marks.mkdir()
    env = plugin_env("support.replica_faults:plugin", PARATRAIN_TEST_REPLICA_DIR=str(marks),
                     PARATRAIN_TEST_KILL_REPLICA=f"1:{ISLAND_KILL_AFTER}", PARATRAIN_TEST_PACE_UNTIL_JOINED="4")
    streaming = ["--fragments", str(fragments), "--fragment-delay", str(delay)] if fragments > 1 else []
    run = run_cli("train", "--strategy", "ddp", "--nproc", "2", "--heal-replicas", "--max-restarts", "1",
                  "--semi-sync", method, "--sync-every", str(ISLAND_SYNC), *streaming, "--outer-dtype", dtype,
                  "--steps", str(ISLAND_STEPS), "--global-batch", "8", "--seq-len", "32", "--timeout-s", "60",
                  "--out", str(tmp_path / "run"), "--json", env=env, timeout=140)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = run.json()
    assert summary["steps"] == ISLAND_STEPS and summary["replica_restarts"] == 1
    assert summary["replicas_finished"] == [0, 1], run.stderr[-3000:]
    (heal,) = summary["healed_at"]
    # healed at one of island 0's syncs after the kill (where an all-reduce starts), from island 0
    schedule = FragmentSchedule(fragments, ISLAND_SYNC, delay)
    assert heal["replica"] == 1 and heal["from_replica"] == 0 and schedule.started_after(heal["step"]) is not None
    assert ISLAND_KILL_AFTER < heal["step"] < ISLAND_STEPS, heal
    assert "island 1: copied the parameters, the inner optimizer state, the global copy" in run.stderr
    assert not list(tmp_path.rglob("step-*"))  # no checkpoint: the state came from the live island
    states = {p.name: torch.load(p, weights_only=True) for p in marks.glob("state-*.pt")}
    assert sorted(states) == ["state-r0-a0.pt", "state-r1-a1.pt"]
    island0, island1 = states["state-r0-a0.pt"], states["state-r1-a1.pt"]
    assert island0["step"] == island1["step"] == ISLAND_STEPS
    assert state_differences(island0["global"], island1["global"]) == []
    # the last step synced: both restart from the global copy, or (delayed) merge half of it into their own
    assert (state_differences(island0["model"], island1["model"]) == []) == (delay == 0)
    log = step_log(marks / "steps-r1.txt")
    assert [s for _, s in log[:ISLAND_KILL_AFTER]] == list(range(1, ISLAND_KILL_AFTER + 1))  # the lost process's
    assert [s for _, s in log[ISLAND_KILL_AFTER:]] == list(range(heal["step"] + 1, ISLAND_STEPS + 1))  # replacement
    # each replica process kept a flight recorder: the lost one's black box is all that stays (the others, done,
    # took theirs back), naming its pid and its last completed step, as `paratrain doctor --hang` reads it
    boxes = sorted(p.relative_to(tmp_path / "run").as_posix() for p in (tmp_path / "run").rglob("hang/*"))
    assert boxes == ["replicas/r1-a0/hang/rank-1.json", "replicas/r1-a0/hang/rank-1.step"], boxes
    box = json.loads((tmp_path / "run" / "replicas/r1-a0/hang/rank-1.json").read_text())
    assert box["pid"] == log[0][0] and box["rank"] == 1
    assert int((tmp_path / "run" / "replicas/r1-a0/hang/rank-1.step").read_text()) == ISLAND_KILL_AFTER


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
    """A payload that, unpickled without an allow-list, touches `marker`: what a hostile peer could send."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def _transports(count: int, timeout: timedelta):
    """`count` replicas' transports over one torchft gloo group on a loopback store, as a quorum configures it."""
    import threading

    import torch.distributed as dist
    from torchft.process_group import ProcessGroupGloo

    from paratrain.train.recovery.replica_transport import peer_checkpoint_transport

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = [ProcessGroupGloo(timeout=timeout) for _ in range(count)]
    threads = [threading.Thread(target=g.configure, args=(f"127.0.0.1:{store.port}/quorum/0", str(i), i, count))
               for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [peer_checkpoint_transport(g, timeout, torch.device("cpu")) for g in groups], store


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # copied in on load (replica_worker.py)
@pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated:FutureWarning")  # torchft's own unpickling (ditto)
def test_a_peer_state_arrives_whole_over_the_process_group_and_a_hostile_description_is_refused(tmp_path):
    """Reference: the state a live replica sends (replica_state) arrives bit-identical over the process-group
    transport a healing replica uses; a state whose description names a class beyond the allow-list (one that would
    run code when unpickled) is refused, and does not run."""
    import threading

    from paratrain.train.recovery.replica_transport import load_description

    timeout = timedelta(seconds=30)
    (peer, joiner), store = _transports(2, timeout)
    marker = tmp_path / "ran"
    state = replica_state(_replica())
    sender = threading.Thread(target=peer.send_checkpoint, args=([1], 3, state, timeout))
    sender.start()
    got = joiner.recv_checkpoint(0, peer.metadata(), 3, timeout)
    sender.join()
    assert state_differences(state, got) == []
    sender = threading.Thread(target=peer.send_checkpoint, args=([1], 4, {"model": _RunsCode(marker)}, timeout))
    sender.start()
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global .*pathlib.Path.touch"):
        joiner.recv_checkpoint(0, peer.metadata(), 4, timeout)
    sender.join()
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):  # the allow-list on its own
        load_description(pickle.dumps(_RunsCode(marker)))
    assert not marker.exists()
    del store


def test_heal_replicas_refuses_what_it_cannot_heal():
    """One UserError line each (the CLI prints it and exits 2): a sharded strategy but hsdp, hsdp with another degree
    (tp, pp, ep), hsdp short of two groups of two, --semi-sync under hsdp, one replica, a comm hook."""
    hsdp = {"strategy": "hsdp", "dp_replicate": 2, "dp_shard": 2}
    groups_only = r"hsdp's replicate groups, each FSDP over --dp-shard ranks and no other degree \(got {}\)"
    cases = [({"strategy": "zero3"}, 3, r"takes no other parallel degree \(got --strategy zero3\): ask for 3 "
                                         "replicas with --strategy ddp --nproc 3"),
             ({"strategy": "ddp", "tp": 2, "nproc": 4}, 4, r"\(got --tp 2\): .* --strategy ddp --nproc 4$"),
             ({**hsdp, "tp": 2, "nproc": 8}, 8, groups_only.format("--tp 2")),
             ({**hsdp, "pp": 2, "nproc": 8}, 8, groups_only.format("--pp 2")),
             ({**hsdp, "ep": 2, "nproc": 4}, 4, groups_only.format("--ep 2")),
             ({**hsdp, "dp_shard": 1, "nproc": 2}, 2, r"hsdp needs --dp-replicate >= 2 and --dp-shard >= 2"),
             ({**hsdp, "semi_sync": "diloco", "nproc": 4}, 4, "--semi-sync heals one-process islands"),
             ({}, 1, "--heal-replicas needs --nproc 2 or more"),
             ({"ddp_comm_hook": "powersgd"}, 3, "it takes no --ddp-comm-hook"),
             ({"global_batch": 16}, 3, "must be divisible by the 3 replicas"),
             ({"micro_batch": 3}, 3, r"each replica's batch \(4\) is not divisible by --micro-batch 3")]
    for overrides, world, message in cases:
        cfg = load_config(None, {"heal_replicas": True, "global_batch": 12, **overrides})
        with pytest.raises(UserError, match=message):
            check_heal_run(cfg, world, None)
