"""`plan --lora-r` (plan/inputs/lora_count.py, plan/tracing/lora_trace.py): the adapters counted on the model itself,
their gradients and AdamW state the only ones priced, per rank as the runtime places them, and a lower peak than
full fine-tuning. References: the model built for real with models/lora.py's attach_lora (a preset, and a
transformers Llama from a config), and TP's placements as models/lora_tp.py gives them. The peak against a
measured LoRA run is in test_memory_truth.py."""

from __future__ import annotations

import pytest

from models.hf_configs import write_config
from paratrain.models.lora import LoraSpec, adapter_numels, attach_lora

PLAN = ("plan", "--gpu", "h100-sxm", "--seq-len", "64", "--global-batch", "8", "--micro-batch", "8", "--ac", "none",
        "--json")


def _plan(cli_inproc, model: tuple, *extra: str) -> dict:
    res = cli_inproc(*PLAN, *model, *extra)
    assert res.returncode == 0, res.stderr
    return res.json()


def _adapters(model, spec: LoraSpec) -> dict:
    attach_lora(model, spec, seed=0)
    return adapter_numels(model)


def _compare(with_lora: dict, without: dict, adapters: dict, tp: int = 1) -> None:
    """The LoRA plan's adapter count and its first candidate's optimizer state against the real adapters."""
    assert with_lora["model"]["lora"]["trainable_params"] == sum(adapters.values())
    assert with_lora["model"]["lora"]["adapter_tensors"] == len(adapters)
    lora, full = with_lora["candidates"][0], without["candidates"][0]
    assert lora["dims"] == full["dims"] and lora["feasible"]
    opt = lora["memory_bytes"]["optimizer"]
    # AdamW's two fp32 moments per adapter element on the rank, and its step count per tensor
    assert opt == 2 * 4 * sum(adapters.values()) + 4 * len(adapters), (opt, adapters)
    assert lora["memory_bytes"]["grads"] <= 4 * sum(adapters.values())
    assert lora["memory_bytes"]["total"] < full["memory_bytes"]["total"]
    assert lora["memory_bytes"]["params"] > full["memory_bytes"]["params"]  # the base, plus the adapters
    assert lora["step_time_s"] > 0 and "--lora-r" in lora["command"]


@pytest.mark.timeout(300)
def test_preset_lora_prices_the_adapters_alone(cli_inproc):
    from paratrain.models.presets import build_model, get_preset

    model = ("--model", "tiny", "--gpus", "1")
    without, with_lora = _plan(cli_inproc, model), _plan(cli_inproc, model, "--lora-r", "8")
    _compare(with_lora, without, _adapters(build_model(get_preset("tiny"), "cpu", seed=0), LoraSpec(8, 8.0, ("wq", "wv"), 0.0)))


@pytest.mark.timeout(300)
def test_tp_prices_each_rank_its_placed_share(cli_inproc):
    """tp 2 on every linear: a column-parallel base's B and a row-parallel base's A are halved on each rank,
    the other factor whole (the runtime's TP plan and adapter_placements)."""
    from torch.distributed.tensor import Shard

    from paratrain.models.lora import has_adapter
    from paratrain.models.lora_tp import adapter_placements
    from paratrain.models.plans import tp_plan_for
    from paratrain.models.presets import build_model, get_preset
    from paratrain.parallel.tp.tensor_parallel import match_modules

    targets = "wq,wk,wv,wo,w1,w2,w3"
    fixed = ("--model", "tiny", "--gpus", "2", "--tp", "2", "--no-sp")
    without, with_lora = (_plan(cli_inproc, fixed), _plan(cli_inproc, fixed, "--lora-r", "4", "--lora-targets", targets))
    model = build_model(get_preset("tiny"), "cpu", seed=0)
    everywhere = _adapters(model, LoraSpec(4, 4.0, tuple(targets.split(",")), 0.0))
    per_rank = dict(everywhere)
    for path, style in tp_plan_for(model, 2, sp=False, loss_parallel=True).items():
        for name, module in match_modules(model, path):
            if has_adapter(module):
                for part, place in zip(("lora_A", "lora_B"), adapter_placements(style)):
                    per_rank[f"{name}.{part}.weight"] //= 2 if isinstance(place, Shard) else 1
    assert per_rank != everywhere and with_lora["model"]["lora"]["trainable_params"] == sum(everywhere.values())
    opt = with_lora["candidates"][0]["memory_bytes"]["optimizer"]
    assert opt == 2 * 4 * sum(per_rank.values()) + 4 * len(per_rank)
    assert with_lora["candidates"][0]["memory_bytes"]["total"] < without["candidates"][0]["memory_bytes"]["total"]


@pytest.mark.timeout(300)
def test_hf_llama_lora_counts_the_transformers_model(cli_inproc, tmp_path):
    import transformers

    folder = write_config(tmp_path, "llama")
    model = ("--model", f"hf:{folder}", "--gpus", "1")
    without, with_lora = _plan(cli_inproc, model), _plan(cli_inproc, model, "--lora-r", "8", "--lora-targets",
                                                        "q_proj,v_proj,down_proj")
    config = transformers.AutoConfig.from_pretrained(folder)
    real = transformers.AutoModelForCausalLM.from_config(config)
    _compare(with_lora, without, _adapters(real, LoraSpec(8, 8.0, ("q_proj", "v_proj", "down_proj"), 0.0)))


def test_unknown_target_is_trains_one_line(cli_inproc):
    res = cli_inproc("plan", "--model", "tiny", "--gpu", "h100-sxm", "--gpus", "1", "--lora-r", "4",
                     "--lora-targets", "nope")
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert res.stderr.strip() == ("error: --lora-targets nope names no module of this model; its linears: output, w1, "
                                  "w2, w3, wk, wo, wq, wv")


def test_lora_step_skips_frozen_weight_gradients_and_reduces_adapters_alone():
    """The traced step: a frozen linear's backward computes its input's gradient only (half its matmul FLOPs:
    the weight-gradient GEMM is gone); DDP all-reduces and FSDP reduce-scatters the adapters' fp32 gradients
    alone, while FSDP still gathers the whole (frozen) base."""
    from paratrain.costs.hardware import profile_from_spec
    from paratrain.gpu_catalog import get_gpu
    from paratrain.models.presets import build_model, get_preset
    from paratrain.parallel.layout import Layout
    from paratrain.plan.costing.compose import trace
    from paratrain.plan.costing.memory import trace_key
    from paratrain.plan.costing.time import estimate_time

    args, targets = get_preset("tiny"), ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
    lora = {"lora_r": 2, "lora_targets": targets}
    elements = sum(_adapters(build_model(args, "cpu", seed=0), LoraSpec(2, 2.0, targets, 0.0)).values())

    def block_mm_flops(layout: Layout, phase: str) -> float:
        ut = trace(trace_key(args, layout, "whole", 64, "fp32", "cpu")).ut
        return sum(f * n for kind, f, _, n, _ in ut.ops[f"block/{phase}"] if kind == "mm")

    full, adapted = Layout(micro_batch=2), Layout(micro_batch=2, **lora)
    fwd_extra = block_mm_flops(adapted, "fwd") - block_mm_flops(full, "fwd")  # the adapters' own matmuls
    # backward: the base's input gradients (half the full backward) plus the adapters' (about twice their forward)
    assert block_mm_flops(adapted, "bwd") == pytest.approx(block_mm_flops(full, "bwd") / 2 + 2 * fwd_extra, rel=0.02)
    hw = profile_from_spec(get_gpu("h100-sxm"))
    ddp = estimate_time(hw, args, Layout(dp_replicate=2, **lora), 64, "fp32", "cuda")
    assert ddp.comm_by_kind == {"all_reduce": 4 * elements}
    fsdp, fsdp_full = (estimate_time(hw, args, Layout(dp_shard=2, zero_stage=2, **extra), 64, "fp32", "cuda")
                       for extra in (lora, {}))
    assert fsdp.comm_by_kind["reduce_scatter"] == 4 * elements
    assert fsdp.comm_by_kind["all_gather"] == pytest.approx(fsdp_full.comm_by_kind["all_gather"] + 4 * elements)
