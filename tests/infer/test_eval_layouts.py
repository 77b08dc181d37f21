"""`paratrain eval` under every strategy equals one device within verify's loss tolerance, and equals the training
run's own val_loss at the saved step (issue 49). The runs are tests/infer/eval_worker.py's, inside the suite's
shared 2- and 4-rank groups (tests/groups.py): tiny4 trained under tp=2 with validation at step 2 and saved there,
then evaluated under single, ddp, zero1-3, tp, tp-sp, pp, cp-ring and an uneven 5:3 split (2 ranks), and under
dp_shard 2 x tp 2, hsdp 2 x 2 and an uneven 5:1:1:1 split (4 ranks); moe-tiny trained and evaluated under ep=2."""

from __future__ import annotations

import pytest

from paratrain.verify.compare import Tolerance

TOL = Tolerance()


def close(loss: float, ref: float) -> bool:
    return abs(loss - ref) <= TOL.loss_atol + TOL.loss_rtol * abs(ref)


@pytest.fixture(scope="module")
def evals(two_ranks) -> dict:
    return two_ranks["infer_eval"]


def test_every_two_rank_layout_equals_the_training_runs_val_loss(evals):
    assert set(evals["evals"]) == {"single", "ddp", "zero1", "zero2", "zero3", "tp", "tp-sp", "pp", "cp-ring",
                                   "ddp-5:3", "as-saved"}
    for layout, loss in evals["evals"].items():
        assert close(loss, evals["val_loss"]), (layout, loss, evals["val_loss"])
        assert close(loss, evals["evals"]["single"]), (layout, loss)
    # each layout read the checkpoint: at fresh weights the same eval is far off (so the comparison can fail)
    assert not close(evals["not_loaded"], evals["val_loss"])


def test_every_sample_counted_once_and_the_checkpoint_named(evals):
    # 2 validation batches x 8 sequences x 32 targets, whatever the split (5:3 included)
    assert set(evals["tokens"].values()) == {2 * 8 * 32}
    assert {path.rsplit("/", 2)[-2:] == ["tiny4", "step-2"] for path in evals["checkpoints"].values()} == {True}


def test_without_layout_flags_the_checkpoints_own_layout_runs(evals):
    assert evals["degrees"]["as-saved"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "pp": 1, "cp": 1}
    assert evals["degrees"]["single"]["tp"] == 1 and evals["degrees"]["zero3"]["dp_shard"] == 2


def test_moe_checkpoint_under_ep_equals_one_device_and_its_val_loss(evals):
    moe = evals["moe"]
    for layout in ("ep", "single"):
        assert close(moe["evals"][layout], moe["val_loss"]), (layout, moe)


def test_four_rank_meshes_equal_the_training_runs_val_loss(four_ranks, evals):
    got = four_ranks["infer_eval"]["evals"]
    assert set(got) == {"fsdp2xtp2", "hsdp2x2", "ddp-5:1:1:1"}
    for layout, loss in got.items():
        assert close(loss, evals["val_loss"]), (layout, loss, evals["val_loss"])
    assert set(four_ranks["infer_eval"]["tokens"].values()) == {2 * 8 * 32}
