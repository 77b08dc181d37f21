"""Precision a run computes in: fp8 and CUDA-graph refusals (one line, exit 2), TF32 for fp32 and the peak MFU is
measured against, and GPU names matched by exact model (an unknown GPU has no peak, so MFU is unknown)."""

from __future__ import annotations

import pytest

from paratrain import gpu_catalog as cat
from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.parallel.layout import Layout
from paratrain.train import precision
from paratrain.train.precision import check_precision, peak_dtype
from paratrain.train.validate import validate_run

H100 = ("NVIDIA H100 80GB HBM3", (9, 0))
A100 = ("NVIDIA A100-SXM4-80GB", (8, 0))


@pytest.mark.parametrize("args, needle", [
    (("--dtype", "fp8"), "--dtype fp8 needs a CUDA GPU with FP8 tensor cores"),
    (("--cuda-graphs",), "--cuda-graphs captures the step's CUDA kernels and needs a CUDA GPU; this run is on cpu"),
], ids=["fp8", "cuda-graphs"])
def test_fp8_and_cuda_graphs_exit_2_on_cpu_with_one_line(cli_inproc, args, needle):
    res = cli_inproc("train", "--strategy", "single", "--steps", "1", *args)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr


def test_fp8_needs_fp8_tensor_cores_torchao_and_no_tp(monkeypatch):
    cfg = TrainConfig(dtype="fp8", strategy="single")
    with pytest.raises(UserError, match=r"NVIDIA A100-SXM4-80GB is 8\.0: use --dtype bf16"):
        check_precision(cfg, Layout(), "cuda", gpu=A100)
    with pytest.raises(UserError, match=r"tensor parallel \(tp=2\)"):
        check_precision(cfg, Layout(tp=2), "cuda", gpu=H100)
    monkeypatch.setattr(precision.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="needs torchao"):
        check_precision(cfg, Layout(dp_shard=2, zero_stage=3), "cuda", gpu=H100)
    monkeypatch.setattr(precision.importlib.util, "find_spec", lambda name: object())
    check_precision(cfg, Layout(dp_shard=2, zero_stage=3), "cuda", gpu=H100)  # Hopper + torchao + FSDP: fine
    check_precision(cfg, Layout(), "cuda", gpu=("NVIDIA L4", (8, 9)))  # Ada has FP8 tensor cores too


def test_cuda_graphs_only_on_one_gpu():
    cfg = TrainConfig(cuda_graphs=True, strategy="ddp")
    check_precision(cfg, Layout(), "cuda", gpu=H100)
    with pytest.raises(UserError, match="ddp over 2 processes launches collectives"):
        check_precision(cfg, Layout(dp_replicate=2), "cuda", gpu=H100)
    with pytest.raises(UserError, match="--cuda-graphs"):
        validate_run(TrainConfig(cuda_graphs=True, strategy="single", device="cpu"), 1)


def test_mfu_uses_the_peak_of_what_runs():
    assert peak_dtype("fp32", tf32=True) == "fp32"  # the catalog's fp32 is the TF32 tensor-core peak
    assert peak_dtype("fp32", tf32=False) == "fp32_simt"
    assert peak_dtype("bf16", tf32=True) == "bf16" and peak_dtype("fp8", tf32=False) == "fp8"
    assert precision.enable_tf32("cpu", "fp32", True) is False  # nothing to switch on a CPU
    h100 = cat.CATALOG["h100-sxm"]
    assert h100.peak_tflops[peak_dtype("fp32", True)] == 494 and h100.peak_tflops[peak_dtype("fp32", False)] == 67


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-40GB", "a100-40"), ("NVIDIA A100-SXM4-80GB", "a100-80"), ("NVIDIA A100 80GB PCIe", "a100-80"),
    ("NVIDIA A100-PCIE-40GB", "a100-40"), ("NVIDIA RTX A6000", "a6000"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"),
    # siblings that used to borrow a peak by substring: each is another model with other figures
    ("NVIDIA L40", None), ("NVIDIA H100 NVL", None), ("NVIDIA H800", None), ("NVIDIA H200 NVL", None),
    ("NVIDIA RTX 6000 Ada Generation", None), ("NVIDIA GeForce RTX 4090 D", None), ("NVIDIA A10", None),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", None), ("Some Future GPU", None),
])
def test_gpu_names_match_by_exact_model(name, key):
    assert cat.catalog_name_for(name) == key


def test_unknown_gpu_or_dtype_has_no_peak(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40")
    assert cat.device_peak_tflops("cuda", "bf16") is None  # not the L4's 121, not the L40S's 362
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40S")
    assert cat.device_peak_tflops("cuda", "bf16") == cat.CATALOG["l40s"].peak_tflops["bf16"]
    assert cat.device_peak_tflops("cuda", "no-such-dtype") is None


def test_whole_model_compile_keeps_names_and_cuda_graphs_mark_each_step(monkeypatch):
    """One device: the whole model is compiled in place (parameter names unchanged, so checkpoints load either
    way); --cuda-graphs starts a new captured step before every micro-batch's forward."""
    import torch

    from paratrain.models.presets import build_model, get_preset
    from paratrain.parallel.compile import apply_compile, is_whole_compiled
    from paratrain.train.data.indexed_sets import Batch
    from paratrain.train.step import PlainStep

    model = build_model(get_preset("gpt2-tiny"), seed=0)
    names = [n for n, _ in model.named_parameters()]
    compiled = apply_compile(model, whole=True, mode="reduce-overhead")
    # the forward is compiled, not Module.__call__: hooks on the model itself stay eager (the doctor's timers
    # synchronize the GPU, which a fullgraph trace refuses)
    assert compiled is model and is_whole_compiled(model) and model._compiled_call_impl is None
    assert [n for n, _ in model.named_parameters()] == names
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    eager = build_model(get_preset("gpt2-tiny"), seed=0)
    step = PlainStep(eager, torch.device("cpu"), "fp32", False, mark_graph_steps=True)
    tokens = torch.randint(0, 256, (2, 9))
    step.forward_backward([Batch(tokens[:, :-1], tokens[:, 1:])] * 3)
    assert len(marks) == 3
