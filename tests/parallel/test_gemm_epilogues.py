"""--fused-bias-gelu: Inductor's autotuned GEMM templates with fused epilogues, set before the first compile on
CUDA only (parallel/compile.py). On CPU Inductor trains with ATen's GEMMs either way, so the flag changes nothing
there; its speed is the GPU suite's rows (benchmarks/gpu_suite_rows.py)."""

import torch._inductor.config as inductor

from paratrain.config import load_config
from paratrain.parallel.compile import fuse_gemm_epilogues

SETTINGS = ("max_autotune_gemm", "max_autotune_gemm_backends", "epilogue_fusion")


def test_cuda_turns_on_autotuned_gemm_templates_and_cpu_changes_nothing():
    before = {k: getattr(inductor, k) for k in SETTINGS}
    try:
        assert fuse_gemm_epilogues("cpu") is False
        assert {k: getattr(inductor, k) for k in SETTINGS} == before
        assert fuse_gemm_epilogues("cuda") is True
        assert inductor.max_autotune_gemm is True and "TRITON" in inductor.max_autotune_gemm_backends
        assert inductor.epilogue_fusion is True
    finally:
        for key, value in before.items():
            setattr(inductor, key, value)


def test_the_flag_is_a_config_field_off_by_default():
    assert load_config(None, {}).fused_bias_gelu is False
    assert load_config(None, {"fused_bias_gelu": True, "compile": True}).fused_bias_gelu is True
