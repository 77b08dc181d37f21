"""verify: DDP on 2 processes against the single-device reference (fp32, loss rtol 1e-5)."""

import pytest

CONTRACT = {"strategy", "dims", "world_size", "steps", "dtype", "tolerance", "max_loss_abs_diff", "max_grad_rel_diff",
            "max_param_abs_diff", "passed", "per_step"}


@pytest.mark.timeout(240)
def test_verify_ddp_two_ranks_passes(cli):
    res = cli("verify", "--strategy", "ddp", "--nproc", "2", "--steps", "5", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    report = res.json()
    assert CONTRACT <= set(report)
    assert set(report["tolerance"]) >= {"loss_atol", "loss_rtol", "param_atol", "param_rtol"}
    assert report["passed"] is True and report["world_size"] == 2 and report["dims"]["dp_replicate"] == 2
    for row in report["per_step"]:
        assert abs(row["loss"] - row["loss_ref"]) <= 1e-5 * abs(row["loss_ref"])
    assert len(report["per_step"]) == 5


def test_verify_detects_a_real_mismatch():
    """The comparison itself must be able to fail: perturb one tensor and check it is caught."""
    import torch

    from paratrain.bench.verify import compare_tensors

    ref = {"w": torch.ones(4, 4)}
    ok = compare_tensors(ref, {"w": torch.ones(4, 4) + 1e-7}, atol=1e-5, rtol=1e-4)
    bad = compare_tensors(ref, {"w": torch.ones(4, 4) + 1e-2}, atol=1e-5, rtol=1e-4)
    missing = compare_tensors(ref, {}, atol=1e-5, rtol=1e-4)
    assert ok[2] is True and bad[2] is False and missing[2] is False and missing[3] == ["w"]
