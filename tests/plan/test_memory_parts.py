"""Memory that holds together (issue 51): each part of a candidate's memory grows with what it should. Activations
grow with the sequence and the micro-batch, under --ep too; FSDP's gradients are fp32 shards that shrink with the
shard degree (beside the unsharded ones of the group whose backward runs); the parts add up to the total. The peak
against a measured run (moe-tiny under --ep over 2 ranks among them) is tests/plan/test_memory_truth.py's."""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.models.presets import count_params, get_preset
from paratrain.parallel.layout import Layout
from paratrain.plan.costing.memory import GIB, chunk_memory, estimate_memory

PARTS = ("params", "grads", "optimizer", "activations", "other")
# the reported case: mixtral-8x7b under --ep 8 over 16 FSDP ranks, no recomputation
MIXTRAL_EP = ("--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--gpus", "16", "--dp-shard", "16", "--ep", "8",
              "--ac", "none")


def _candidate(cli_inproc, *flags) -> dict:
    res = cli_inproc("plan", *flags, "--json")
    assert res.returncode == 0, res.stderr
    return res.json()["candidates"][0]


def _memory(cli_inproc, *flags) -> dict:
    return _candidate(cli_inproc, *flags)["memory_gib"]


@pytest.mark.parametrize("model, seq", [
    (MIXTRAL_EP, 1024),  # at 512 the optimizer step is the peak (no activations then): the total still grows
    (("--model", "llama-162m", "--gpu", "h100-sxm", "--gpus", "8", "--dp-shard", "8", "--ac", "none"), 512)])
def test_activations_grow_with_the_sequence_and_the_micro_batch(cli_inproc, model, seq):
    short = _memory(cli_inproc, *model, "--seq-len", str(seq), "--global-batch", "16", "--micro-batch", "1")
    long = _memory(cli_inproc, *model, "--seq-len", str(4 * seq), "--global-batch", "16", "--micro-batch", "1")
    wide = _memory(cli_inproc, *model, "--seq-len", str(seq), "--global-batch", "32", "--micro-batch", "2")
    assert short["activations"] > 0
    # activations without recomputation grow with the tokens of a micro-batch (attention's scores are not kept:
    # flash attention): 4x the sequence, 2x the micro-batch (what is counted at the peak moves with them)
    assert 3 * short["activations"] < long["activations"] < 6 * short["activations"]
    assert 1.6 * short["activations"] < wide["activations"] < 3 * short["activations"]
    assert long["total"] > short["total"] and wide["total"] > short["total"]


def _llama8b_fsdp(f: int, microbatches: int = 1):
    args = get_preset("llama3-8b")
    lay = Layout(dp_shard=f, zero_stage=3, micro_batch=1, microbatches=microbatches, ac="full", dtype="bf16")
    return args, lay


def test_fsdp_gradients_are_fp32_shards_that_shrink_with_the_shard_degree():
    fp32_grads = 4 * count_params(get_preset("llama3-8b"))
    at_step = {}
    for f in (8, 64):
        args, lay = _llama8b_fsdp(f)
        at_step[f] = chunk_memory(args, lay, "whole", args.n_layers, 8192, "bf16", "cuda", []).grads
        assert at_step[f] == pytest.approx(fp32_grads / f, rel=1e-3)
        peak = estimate_memory(args, lay, 8192, "bf16", "cuda")
        # at the peak: the shards kept, and the unsharded gradients of the group whose backward runs (and of the one
        # before, whose reduce-scatter input FSDP2 keeps): far below the whole model's 29.9 GiB
        assert peak.grads < 0.1 * fp32_grads
    assert at_step[64] == pytest.approx(at_step[8] / 8)


def test_expert_gradients_are_sharded_over_the_ranks_that_hold_the_same_experts():
    """Under --ep 8 of 16 FSDP ranks each rank computes 1/8 of the experts and their gradients are reduce-scattered
    over the 2 ranks holding the same ones: every parameter's gradient is 1/16 on each rank at the step."""
    args = get_preset("mixtral-8x7b")
    lay = Layout(dp_shard=16, ep=8, zero_stage=3, micro_batch=1, microbatches=1, ac="none", dtype="bf16")
    grads = chunk_memory(args, lay, "whole", args.n_layers, 512, "bf16", "cuda", []).grads
    assert grads == pytest.approx(4 * count_params(args) / 16, rel=1e-3)


def test_accumulating_micro_batches_keep_unsharded_gradients_and_say_so():
    """paratrain's runtime skips FSDP's gradient sync on the micro-batches before the last (train/step.py): the
    unsharded fp32 gradients are held until then, and the plan says why its gradients are that large."""
    args, lay = _llama8b_fsdp(8, microbatches=2)
    notes: list[str] = []
    mem = estimate_memory(args, lay, 8192, "bf16", "cuda")
    chunk_memory(args, lay, "whole", args.n_layers, 8192, "bf16", "cuda", notes)
    assert mem.grads == pytest.approx(4 * count_params(args), rel=1e-3)
    assert any("without gradient sync" in n for n in notes)


@pytest.mark.parametrize("flags", [
    MIXTRAL_EP + ("--seq-len", "4096", "--global-batch", "16", "--micro-batch", "1"),
    ("--model", "llama-162m", "--gpu", "a100-80", "--gpus", "8", "--seq-len", "1024"),  # searched: FSDP, TP, DDP...
    ("--model", "llama-162m", "--gpu", "a100-80", "--gpus", "8", "--pp", "4", "--tp", "2", "--seq-len", "1024"),
])
def test_the_parts_add_up_to_the_total(cli_inproc, flags):
    res = cli_inproc("plan", *flags, "--json")
    assert res.returncode == 0, res.stderr
    for cand in res.json()["candidates"]:
        mem = cand["memory_gib"]
        assert all(mem[k] >= 0 for k in PARTS)
        assert sum(mem[k] for k in PARTS) == pytest.approx(mem["total"], abs=1e-3)


def test_the_model_states_grow_with_the_model_and_not_with_the_batch():
    args = get_preset("llama-162m")
    lay = Layout(dp_shard=8, zero_stage=3, micro_batch=1, microbatches=1, ac="none", dtype="bf16")
    small = estimate_memory(args, lay, 1024, "bf16", "cuda")
    big = estimate_memory(dataclasses.replace(args, n_layers=24), lay, 1024, "bf16", "cuda")
    wide = estimate_memory(args, dataclasses.replace(lay, micro_batch=4), 1024, "bf16", "cuda")
    assert big.params == pytest.approx(small.params * count_params(dataclasses.replace(args, n_layers=24))
                                       / count_params(args), rel=1e-3)
    assert (wide.params, wide.optimizer) == (small.params, small.optimizer)
    assert small.total / GIB < big.total / GIB
