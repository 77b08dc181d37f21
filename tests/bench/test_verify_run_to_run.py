"""verify on a device whose kernels do not repeat exactly (a GPU): the fp32 bounds widen to a multiple of the
single-device run's own run-to-run spread, and only there; on CPU they stay the fixed fp32 constants."""

import torch

from paratrain.verify.compare import FLOOR_MULTIPLE, Tolerance
from paratrain.verify.parity import run_to_run_varies


def test_only_devices_that_vary_measure_a_run_to_run_floor():
    assert not run_to_run_varies(torch.device("cpu"))
    assert run_to_run_varies(torch.device("cuda", 0))


def test_a_zero_floor_keeps_the_fp32_constants_and_a_measured_one_widens_them():
    zero = dict.fromkeys(("loss", "grad", "grad_norm", "param", "act"), 0.0)
    same = Tolerance.from_floor(zero, FLOOR_MULTIPLE, basis="run-to-run noise floor")
    fixed = Tolerance()
    assert (same.grad_rtol, same.loss_rtol, same.param_rtol) == (fixed.grad_rtol, fixed.loss_rtol, fixed.param_rtol)
    assert same.basis == f"{FLOOR_MULTIPLE:g} x run-to-run noise floor"
    # the H100's fp32 single-device run against itself: 4.1e-4 relative in attention gradients at step 3, which
    # the fixed 1e-4 refused; the same spread measured as the floor lets it through, and 10x more does not
    h100 = Tolerance.from_floor({**zero, "grad": 4.1e-4}, FLOOR_MULTIPLE)
    assert fixed.grad_rtol < 4.1e-4 <= h100.grad_rtol < 4.1e-3
