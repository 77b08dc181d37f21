"""Data-parallel family: ZeRO-1/2/3, HSDP, comm hooks, local SGD, collective accounting, model-state bytes.

Parity reference: verify/parity.py's single-device run of the same seed and batches, fp32 tolerances (loss 1e-5
relative, params 1e-5 + 1e-4 relative, grads 1e-4 relative). conftest.py's two launches (2 and 4 ranks, gloo)
run every multi-rank check through dp_worker.py; the approximate methods (fp16 / PowerSGD hooks, local SGD) must end
within 3% of DDP's loss (mean of the last 10 steps) after the same number of steps.
"""

from __future__ import annotations

import re

import pytest

from groups import APPROX_STEPS  # the shared two-rank group trains each approximate method this long

PSI = 131392  # parameters of the tiny preset
TINY_LAYERS = 2
HEAD = 256 * 64 + 64  # the tiny preset's output head (vocabulary x dim) and final norm


def dp_reports(group: dict) -> dict:
    """The data-parallel verify reports of a conftest.py group (it verifies TP and CP layouts too), by id."""
    return {r["id"]: r for r in group["verify"] if r["id"].startswith(("zero", "hsdp"))}


# -- parity -----------------------------------------------------------------------------------------------------
@pytest.mark.timeout(420)
def test_zero_stages_match_single_device_at_two_ranks(two_ranks):
    reports = dp_reports(two_ranks)
    assert sorted(reports) == ["zero1", "zero2", "zero3"]
    for report in reports.values():
        assert report["passed"], report
    assert [r["dims"]["dp_replicate"] * r["dims"]["dp_shard"] for r in reports.values()] == [2, 2, 2]


@pytest.mark.timeout(420)
def test_zero_stages_and_hsdp_match_single_device_at_four_ranks(four_ranks):
    reports = dp_reports(four_ranks)
    assert sorted(reports) == ["hsdp", "hsdp-tied", "zero1", "zero2", "zero3"]
    for report in reports.values():
        assert report["passed"], report
    assert reports["hsdp"]["dims"] == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "ep": 1,
                                        "tp": 1}


# `verify --json` carries the model-state bytes: checked on tests/bench/test_verify.py's CLI launch; the ZeRO
# stages' figures below come from the shared groups (the same verify_in_group the CLI runs)


# -- model-state bytes: exact for fp32 AdamW (step counters are the only extra) ----------------------------------
@pytest.mark.timeout(420)
@pytest.mark.parametrize("world", [2, 4])
def test_model_state_bytes_follow_zero_formulas(two_ranks, four_ranks, world):
    reports = {i: r["model_state_bytes"]["mean"] for i, r in dp_reports(two_ranks if world == 2 else four_ranks).items()}
    full, shard = 4 * PSI, 4 * PSI / world
    expect = {"zero1": (full, full, 2 * shard), "zero2": (full + shard, shard, 2 * shard),
              "zero3": (shard, shard, 2 * shard)}
    for strategy, (params, grads, optimizer) in expect.items():
        got = reports[strategy]
        assert got["params"] == pytest.approx(params, rel=1e-3), (strategy, got)
        assert got["grads"] == pytest.approx(grads, rel=1e-3), (strategy, got)
        assert got["optimizer"] == pytest.approx(optimizer, rel=1e-3), (strategy, got)


# -- collective accounting ---------------------------------------------------------------------------------------
@pytest.mark.timeout(420)
def test_collective_bytes_per_step(two_ranks):
    comm = two_ranks["comm"]
    grads = 4 * PSI
    # the DDP reducer's bucket all-reduces come from C++; the few extra bytes are the loss and grad-norm scalars
    assert grads <= comm["ddp"]["bytes"]["all_reduce"] <= grads + 256
    assert comm["zero1"]["bytes"]["broadcast"] == pytest.approx(grads, abs=512)  # each owner sends its shard
    assert comm["zero2"]["bytes"]["all_gather"] == grads and comm["zero2"]["bytes"]["reduce_scatter"] == grads
    # ZeRO-3 gathers every group for its forward and again for its backward, but the norm + head once: they stay
    # unsharded from their forward to their backward (parallel/dp/data_parallel.py apply_fsdp)
    assert comm["zero3"]["bytes"]["all_gather"] == 2 * grads - 4 * HEAD
    assert comm["zero3"]["bytes"]["reduce_scatter"] == grads
    assert comm["zero3"]["calls"]["all_gather"] == 2 * (TINY_LAYERS + 1) + 1  # embedding and blocks twice, head once
    ring = (2 - 1) / 2
    assert comm["zero3"]["wire"] == pytest.approx(1.5 * comm["ddp"]["wire"] - ring * 4 * HEAD, rel=1e-3)
    assert comm["ddp"]["wire"] == pytest.approx(2 * ring * grads, rel=1e-3)
    assert comm["identical"], "counting collectives changed the losses or parameters"
    assert not comm["mode_left_installed"]


@pytest.mark.timeout(420)
def test_zero3_runs_no_more_collectives_than_a_plain_fully_shard_loop(two_ranks):
    """benchmarks/peers.py's zero3 row: paratrain's step against its plain loop (fully_shard on each decoder layer,
    then the root) on the same transformers model, weights and rows; the third step's collectives, counted."""
    ours, plain = two_ranks["comm"]["zero3_vs_plain"]["paratrain"], two_ranks["comm"]["zero3_vs_plain"]["plain"]
    assert ours["losses"] == plain["losses"]  # the same step, bit for bit
    for op, calls in ours["calls"].items():
        assert calls <= plain["calls"].get(op, 0), (op, ours["calls"], plain["calls"])
    assert ours["bytes"] == plain["bytes"]


def test_ring_factors_and_disabled_counter_installs_nothing():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from paratrain.parallel.collective_bytes import count_collectives, ring_factor

    assert ring_factor("all_reduce", 4) == 1.5 and ring_factor("all_gather", 4) == 0.75
    assert ring_factor("reduce_scatter", 1) == 0.0 and ring_factor("p2p", 8) == 1.0
    with count_collectives(enabled=False) as stats:
        assert _get_current_dispatch_mode() is None
    assert stats.total_bytes == 0 and dict(stats.calls_by_op) == {}


# -- checkpoints -------------------------------------------------------------------------------------------------
@pytest.mark.timeout(420)
def test_zero1_checkpoint_resumes_at_another_world_size(two_ranks, four_ranks):
    full, resumed = two_ranks["checkpoint"]["full_run_loss"], four_ranks["checkpoint"]
    # saved at step 3 by 2 ranks; resumed by 4 ranks as zero1 (states resharded) and as plain DDP/AdamW
    assert resumed["resumed_zero1_loss"] == pytest.approx(full, rel=1e-5)
    assert resumed["resumed_ddp_loss"] == pytest.approx(full, rel=1e-5)


# -- approximations: not parity, but close to DDP ----------------------------------------------------------------
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", ["fp16", "powersgd", "local_sgd"])
def test_approximate_methods_end_within_3_percent_of_ddp(two_ranks, name):
    losses = two_ranks["approx"]
    assert len(losses[name]) == APPROX_STEPS

    def final(run):
        return sum(losses[run][-10:]) / 10

    assert abs(final(name) - final("ddp")) <= 0.03 * final("ddp"), (name, final(name), final("ddp"))


# -- wrong combinations: one line, exit 2, before any process starts ---------------------------------------------
WRONG = {
    "offload-ddp": ({"strategy": "ddp", "cpu_offload": True}, 2, "--cpu-offload needs a sharded strategy"),
    "offload-cpu": ({"strategy": "zero3", "cpu_offload": True, "device": "cpu"}, 2, "has no CUDA device"),
    "bf16-gloo": ({"strategy": "ddp", "ddp_comm_hook": "bf16", "device": "cpu"}, 2, "bf16 needs NCCL"),
    "hook-fsdp": ({"strategy": "zero3", "ddp_comm_hook": "fp16"}, 2, "needs DDP"),
    "localsgd-zero1": ({"strategy": "zero1", "local_sgd_period": 4}, 2, "needs plain ddp"),
    "localsgd-and-hook": ({"strategy": "ddp", "local_sgd_period": 4, "ddp_comm_hook": "fp16"}, 2, "pick one"),
    "hsdp-product": ({"strategy": "hsdp", "dp_replicate": 2, "dp_shard": 3}, 4, "multiply to 6"),
    "hsdp-1d": ({"strategy": "hsdp", "dp_replicate": 4}, 4, "hsdp needs --dp-replicate >= 2 and --dp-shard"),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_wrong_combinations_are_user_errors(name):
    from paratrain.config import TrainConfig
    from paratrain.errors import UserError
    from paratrain.train.validate import validate_run

    overrides, world, needle = WRONG[name]
    with pytest.raises(UserError, match=re.escape(needle)):
        validate_run(TrainConfig(**overrides), world)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,needle", [
    (("--strategy", "zero3", "--cpu-offload", "--device", "cpu"), "has no CUDA device"),
    (("--strategy", "hsdp", "--dp-replicate", "2", "--dp-shard", "3", "--nproc", "4"), "multiply to 6"),
], ids=["offload-cpu", "hsdp-product"])
def test_wrong_combinations_exit_2_with_one_line(cli_inproc, args, needle):
    res = cli_inproc("train", *args, "--steps", "2")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr
