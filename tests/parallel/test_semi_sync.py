"""--semi-sync diloco | streaming-diloco (parallel/semi_sync/).

The exact reductions run in the shared 4-rank group (semi_sync_worker.py, references named there): with a linear
inner optimizer (--optimizer sgd, --grad-clip 0), H = 1 with an outer SGD of lr 1 and momentum 0 is DDP; H = k over
one-rank islands is --local-sgd-period k after the same DDP warm-up; Streaming DiLoCo with one fragment and no delay
is DiLoCo. Each comes with a neighbour that must differ (the default outer Nesterov step, a sync off the schedule,
two fragments), so the comparisons can fail. A resume mid-way through an overlapped int4 all-reduce restores the
global copy, the outer momentum and the inner step exactly. verify --semi-sync passes 2 one-rank islands (the
2-rank group) and 2 x 2 islands (the 4-rank group) against their simulation on one device and fails a planted
outer-step fault. Here, in-process: the outer all-reduce's encodings, the fragment schedule, and the one-line
refusals.
"""

from __future__ import annotations

import pytest
import torch

from paratrain.errors import UserError
from paratrain.parallel.semi_sync.fragments import FragmentSchedule, split_into_fragments
from paratrain.parallel.semi_sync.outer_codec import ROW, decode, encode, encoded_bytes, overhead_bytes

EXACT = 1e-6


def test_h1_with_outer_sgd_lr1_momentum0_equals_ddp(four_ranks):
    checks = four_ranks["semi_sync"]
    assert checks["h1_param_diff"] <= EXACT and checks["h1_loss_diff"] <= EXACT, checks
    assert checks["h1_moved"] > 100 * EXACT  # the parameters did move from their initial values
    assert checks["nesterov_param_diff"] > 100 * EXACT  # the default outer step is not DDP


def test_hk_equals_local_sgd_period_k_after_the_same_ddp_warmup(four_ranks):
    checks = four_ranks["semi_sync"]
    assert checks["hk_param_diff"] <= EXACT and checks["hk_loss_diff"] <= EXACT, checks
    assert checks["off_schedule_param_diff"] > 100 * EXACT


def test_streaming_diloco_with_one_fragment_and_no_delay_equals_diloco(four_ranks):
    checks = four_ranks["semi_sync"]
    assert checks["one_fragment_param_diff"] <= EXACT and checks["one_fragment_loss_diff"] <= EXACT, checks
    assert checks["two_fragments_param_diff"] > 100 * EXACT


def test_resume_restores_global_copy_and_outer_momentum_exactly(four_ranks):
    checks = four_ranks["semi_sync"]
    assert checks["pending_at_save"] == [0]  # saved while fragment 0's int4 all-reduce was under way
    assert checks["outer_state_restored"] and checks["inner_steps_restored"] == 5
    assert checks["resumed_loss_diff"] == 0 and checks["end_param_diff"] == 0 and checks["end_outer_state_equal"]
    assert checks["islands_agree"]  # every island decoded the same bytes: bit-identical global copies
    assert checks["checkpoint_model_is_global"] == 0  # eval and export read the global parameters


@pytest.mark.parametrize("dtype, worst", [("bf16", 2**-8), ("int8", 0.5 / 127), ("int4", 0.5 / 7)])
def test_outer_encodings_round_trip_within_half_a_step_of_each_row(dtype, worst):
    x = torch.randn(4 * ROW, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 4 * ROW)
    x[ROW:2 * ROW] = 0  # an all-zero row decodes to zeros
    data = encode(x, dtype)
    assert data.dtype == torch.uint8 and data.numel() == encoded_bytes(x.numel(), dtype)
    back = decode(data, dtype, x.numel())
    rows_max = x.view(-1, ROW).abs().amax(dim=1, keepdim=True)
    assert torch.all((back - x).view(-1, ROW).abs() <= worst * rows_max + 1e-12)
    assert torch.equal(back[ROW:2 * ROW], torch.zeros(ROW))


def test_encoded_sizes_and_stated_overhead():
    n = 10 * ROW
    assert encoded_bytes(n, "int4") == n // 2 + 10 * 4 and encoded_bytes(n, "int8") == n + 40
    assert encoded_bytes(n, "bf16") == 2 * n
    # 1000 values over 2 islands: 2 chunks of 2 rows (1024 values), 24 values of padding
    assert overhead_bytes(1000, 2, "int8") == 24 + 4 * 4 and overhead_bytes(1000, 2, "fp32") == 0


def test_fragments_split_parameters_evenly_and_sync_in_turn():
    assert split_into_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_into_fragments([100, 1, 1], 3) == [[0], [1], [2]]  # never an empty fragment
    with pytest.raises(UserError, match="--fragments 4 is more than the model's 3 parameter tensors"):
        split_into_fragments([1, 1, 1], 4)
    schedule = FragmentSchedule(fragments=2, sync_every=4, delay=1)
    assert [schedule.started_after(s) for s in range(1, 9)] == [0, None, 1, None, 0, None, 1, None]
    assert [schedule.applied_after(s) for s in range(1, 9)] == [None, 0, None, 1, None, 0, None, 1]


@pytest.mark.parametrize("args, message", [
    (["--semi-sync", "diloco", "--nproc", "2", "--strategy", "zero3"],
     "--semi-sync diloco needs two or more islands: --dp-replicate N"),
    (["--semi-sync", "diloco", "--nproc", "2", "--local-sgd-period", "2"],
     "--semi-sync diloco and --local-sgd-period both average"),
    (["--semi-sync", "diloco", "--nproc", "4", "--dp-replicate", "2", "--pp", "2"],
     "--semi-sync diloco does not run with a pipeline (--pp 2)"),
    (["--semi-sync", "diloco", "--nproc", "2", "--dp-replicate", "2", "--strategy", "zero1"],
     "--semi-sync diloco does not run with zero1"),
    (["--sync-every", "5", "--nproc", "2"], "--sync-every is an option of semi-synchronous training"),
    (["--semi-sync", "diloco", "--nproc", "2", "--dp-replicate", "2", "--fragments", "2", "--sync-every", "4"],
     "--fragments is an option of --semi-sync streaming-diloco"),
    (["--semi-sync", "streaming-diloco", "--nproc", "2", "--dp-replicate", "2", "--fragments", "3",
      "--sync-every", "4"], "--sync-every 4 must be a multiple of --fragments 3"),
    (["--semi-sync", "streaming-diloco", "--nproc", "2", "--dp-replicate", "2", "--fragments", "2",
      "--sync-every", "4", "--fragment-delay", "2"], "--fragment-delay 2 must be below --sync-every / --fragments"),
    (["--semi-sync", "diloco", "--nproc", "2", "--dp-replicate", "2", "--outer-dtype", "int2"],
     "invalid value for 'outer_dtype'"),
])
def test_what_semi_sync_cannot_run_is_refused_in_one_line(cli_inproc, args, message):
    result = cli_inproc("train", "--device", "cpu", "--steps", "2", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_verify_passes_islands_against_their_one_device_simulation(two_ranks, four_ranks):
    """Reference: the islands simulated on one device (verify/semi_sync_parity.py). 2 one-rank islands with two
    fragments, a delay and int4 outer gradients match it bit for bit; 2 x 2 islands (FSDP inside) within verify's
    fp32 tolerances, every rank's gradients and parameters and the global copies after each sync."""
    from groups import verified

    one_rank = verified(two_ranks, "semi-sync-islands2")
    assert one_rank["passed"] and one_rank["checks"]["global_params"], one_rank
    assert one_rank["semi_sync"]["syncs"] == 3 and one_rank["semi_sync"]["outer_dtype"] == "int4"
    assert one_rank["max_grad_rel_diff"] == 0 and one_rank["max_param_abs_diff"] == 0
    assert one_rank["semi_sync"]["max_global_param_rel_diff"] == 0
    clean = four_ranks["semi_sync"]["verify_clean"]
    assert clean["passed"] and all(clean["checks"].values()) and clean["first_divergence"] is None, clean
    assert clean["semi_sync"]["syncs"] == 2 and clean["semi_sync"]["max_global_param_rel_diff"] > 0  # compared
    assert clean["margins"]["global_params"] > 10, clean["margins"]


def test_verify_catches_an_island_left_out_of_the_outer_step(four_ranks):
    """A planted fault (tests/support/faults.py (j)): island 1 sends zeros into the outer all-reduce. The islands'
    inner steps still match up to the first sync (step 2); there the global parameters differ."""
    faulty = four_ranks["semi_sync"]["verify_faulty"]
    assert not faulty["passed"] and not faulty["checks"]["global_params"], faulty
    first = faulty["first_divergence"]
    assert first["step"] == 2 and first["differs"] == "global_params" and first["ranks"] == [0, 1, 2, 3], first


@pytest.mark.parametrize("args, message", [
    (["--nproc", "4", "--strategy", "hsdp", "--dp-replicate", "2", "--dp-shard", "2", "--outer-dtype", "int8"],
     "verify --semi-sync diloco --outer-dtype int8: islands of 2 ranks encode their local shards"),
    (["--nproc", "2", "--dp-replicate", "2", "--steps", "3"],
     "verify --semi-sync diloco: the first sync comes after step 4, so 3 steps would verify no outer step"),
    (["--nproc", "2", "--dp-replicate", "2", "--dtype", "bf16"],
     "verify --semi-sync diloco compares at fp32's tolerances: run it with --dtype fp32"),
])
def test_verify_refuses_what_it_cannot_compare_for_islands(cli_inproc, args, message):
    result = cli_inproc("verify", "--device", "cpu", "--semi-sync", "diloco", "--sync-every", "4", "--steps", "4",
                        *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr


def test_a_malformed_semi_sync_record_makes_the_checkpoint_incomplete(tmp_path):
    """A crafted manifest's "semi_sync" record is judged with the rest of the manifest: --resume auto skips it."""
    import json

    from paratrain.parallel.semi_sync.checkpoint_state import record_problem
    from paratrain.train.recovery.checkpoint import MANIFEST, check_complete

    good = {"islands": 2, "island_size": 2, "inner_steps": 5, "pending": [0], "momentum": True}
    assert record_problem(good) is None
    for bad in ({**good, "islands": 1}, {**good, "pending": ["0"]}, {**good, "momentum": 1}, [], "x"):
        assert record_problem(bad), bad
    step = tmp_path / "step-5"
    step.mkdir()
    (step / ".metadata").write_bytes(b"")
    manifest = {"step": 5, "files": {".metadata": 0}, "extra": {"data": {"step": 5}, "semi_sync": good}}
    (step / MANIFEST).write_text(json.dumps(manifest))
    assert check_complete(step) is None
    manifest["extra"]["semi_sync"] = {**good, "inner_steps": -1}
    (step / MANIFEST).write_text(json.dumps(manifest))
    assert "'extra.semi_sync' is not a semi-sync record" in check_complete(step)
