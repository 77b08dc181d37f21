"""LoRA (models/lora.py, docs/lora.md): adapters beside the frozen base's unchanged names, their TP placement, the
optimizer holding the adapters alone, checkpoints, and verify's LoRA checks under every strategy against the
single-device reference (verify/parity.py; the 2- and 4-rank cases run inside the shared groups: tests/groups.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from groups import LORA, LORA2
from paratrain.config import TrainConfig
from paratrain.convert.export_plan import checkpoint_tensors
from paratrain.errors import UserError
from paratrain.models.lora import LoraSpec, attach_lora, lora_spec_for
from paratrain.models.presets import build_model, model_args_for
from reliability.inproc import make_trainer, one_rank, tiny_config


def tiny_model():
    return build_model(model_args_for(TrainConfig(model="tiny")), "cpu", seed=0)


def test_adapters_keep_every_base_name_and_start_at_the_base_output():
    model = tiny_model()
    base_keys = set(model.state_dict())
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(tokens)
    adapted = attach_lora(model, LoraSpec(4, 8.0, ("wq", "wv"), 0.0), seed=0)
    assert adapted == [f"layers.{i}.attention.{m}" for i in range(2) for m in ("wq", "wv")]
    keys = set(model.state_dict())
    assert base_keys < keys
    assert keys - base_keys == {f"{a}.lora_{x}.weight" for a in adapted for x in "AB"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == keys - base_keys
    wq = model.layers["0"].attention.wq
    assert torch.count_nonzero(wq.lora_B.weight) == 0
    bound = 1 / math.sqrt(wq.in_features)  # PEFT's kaiming-uniform(a=sqrt(5)) bound
    assert wq.lora_A.weight.abs().max() <= bound and wq.lora_A.weight.std() > bound / 3
    with torch.no_grad():
        assert torch.equal(model(tokens), before)
        wq.lora_B.weight.fill_(0.01)
        assert not torch.equal(model(tokens), before)


def test_same_seed_draws_the_same_adapters_on_every_rank():
    first, second = tiny_model(), tiny_model()
    for model in (first, second):
        attach_lora(model, LoraSpec(4, 4.0, ("wq",), 0.0), seed=3)
    assert torch.equal(first.layers["1"].attention.wq.lora_A.weight, second.layers["1"].attention.wq.lora_A.weight)


@pytest.mark.parametrize("fields, needle", [
    ({"lora_r": 4, "lora_targets": "nope"}, "names no module of this model"),
    ({"lora_r": 4, "fused_qkv": True}, "--fused-qkv runs wq, wk and wv as one GEMM"),
    ({"lora_alpha": 8.0}, "need --lora-r R"),
])
def test_bad_lora_options_are_one_line(fields, needle):
    with pytest.raises(UserError, match=needle):
        spec = lora_spec_for(TrainConfig(model="tiny", **fields), hf=False)
        attach_lora(tiny_model(), spec, 0)


def test_lora_targets_must_be_module_names():
    with pytest.raises(ValueError, match="expected module names"):
        TrainConfig(lora_r=4, lora_targets="wq,,wv")


@pytest.mark.parametrize("flags, needle", [(("--lora-targets", "q.proj"), "lora_targets"),
                                           (("--fused-qkv",), "--fused-qkv runs wq, wk and wv as one GEMM")])
def test_bad_lora_flag_exits_2_with_one_line(cli_inproc, flags, needle):
    result = cli_inproc("train", "--lora-r", "4", *flags, "--steps", "1", "--device", "cpu")
    assert result.returncode == 2 and needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("strategy", ["ddp", "tp"])
def test_verify_refuses_adapter_dropout_in_one_line(cli_inproc, strategy):
    """Dropout's masks come from each rank's random stream: no layout draws the reference's (measured: ddp and tp
    at --lora-dropout 0.1 diverge in the adapters' gradients from step 1), so verify says so before any rank starts."""
    result = cli_inproc("verify", "--strategy", strategy, "--nproc", "2", "--lora-r", "4", "--lora-dropout", "0.1",
                        "--device", "cpu")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "verify refuses --lora-dropout 0.1" in result.stderr and "--lora-dropout 0" in result.stderr


def test_tp_styles_place_the_adapters_as_torchtitan():
    """Column-parallel base: A replicated, B Shard(0); row-parallel: A Shard(1), B replicated (a 1-rank tp mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from paratrain.models.lora_tp import with_adapter_styles

    with one_rank():
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        attach_lora(model, LoraSpec(2, 2.0, ("0", "1"), 0.0), seed=0)
        plan = with_adapter_styles(model, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        parallelize_module(model, mesh, plan)
        col, row = model[0], model[1]
        assert col.weight.placements == (Shard(0),) and row.weight.placements == (Shard(1),)
        assert (col.lora_A.weight.placements, col.lora_B.weight.placements) == ((Replicate(),), (Shard(0),))
        assert (row.lora_A.weight.placements, row.lora_B.weight.placements) == ((Shard(1),), (Replicate(),))
        assert not col.weight.requires_grad and col.lora_B.weight.requires_grad
        out = model(torch.ones(3, 8))
        assert out.shape == (3, 8)


def test_single_device_verify_passes_its_lora_checks():
    from paratrain.verify.parity import verify_in_group

    with one_rank() as rt:
        report = verify_in_group(tiny_config(lora_r=4, lora_alpha=8.0, steps=3), rt)
    assert report["passed"] and report["checks"]["lora"], report
    (rank,) = report["lora"]["per_rank"]
    assert rank["optimizer_state_elements"] == 2 * rank["adapter_elements"] == 2 * 1792
    assert report["lora"]["first_logits_equal_base"]


def test_lora_checks_fail_on_a_planted_base_update():
    """A hook that nudges one frozen weight and gives another a gradient before each optimizer step (both runs
    get it, so parity still holds): verify's LoRA check fails and names both."""
    from paratrain.train.hooks import default_hooks
    from paratrain.verify.parity import verify_in_group

    def plant(trainer):
        model = trainer.step_runner.model_parts[0]
        with torch.no_grad():
            model.norm.weight.add_(1e-3)
        model.output.weight.grad = torch.zeros_like(model.output.weight)

    handle = default_hooks().before_optimizer_step(plant)
    try:
        with one_rank() as rt:
            report = verify_in_group(tiny_config(lora_r=4, steps=2), rt)
    finally:
        handle.remove()
    assert report["checks"]["lora"] is False and not report["passed"]
    (rank,) = report["lora"]["per_rank"]
    # the optimizer, holding the adapters alone, never clears the planted gradient: step 2 sees it
    assert rank["base_changed"] == ["norm.weight"] and rank["frozen_with_grad"] == ["output.weight"]
    assert report["checks"]["params"]  # the reference was planted alike: only the LoRA check sees it


def test_lora_checkpoint_resumes_with_its_adapters(tmp_path):
    with one_rank() as rt:
        straight = make_trainer(rt, lora_r=4, steps=4, resume="never").fit()["losses"]
        make_trainer(rt, lora_r=4, steps=2, ckpt_every=2, ckpt_dir=str(tmp_path)).fit()
        resumed = make_trainer(rt, lora_r=4, steps=4, ckpt_dir=str(tmp_path), resume="auto").fit()["losses"]
    assert len(checkpoint_tensors(tmp_path / "step-2", adapters=True)) == 8  # wq, wv's A and B in 2 blocks
    assert resumed == straight[2:]  # the adapters and their moments came back (losses bitwise)


# -- the shared groups' cases (tests/groups.py: LORA2, and lora-fsdp2xtp2 at four ranks) ---------------------------
def lora_reports(group: dict) -> dict:
    return {r["id"]: r for r in group["verify"] if r["id"].startswith("lora-")}


def adapter_elements(tp: int, shard: int) -> int:
    """tiny's wq, wv adapters at rank 4 (dim 64; q 64 rows, v 32): A replicated over tp, B split; all over shard."""
    r, layers = LORA["lora_r"], 2
    a = r * 64 * 2
    b = r * (64 + 32) // tp
    return layers * (a + b) // shard


@pytest.mark.timeout(420)
def test_lora_verify_passes_under_every_strategy(two_ranks, four_ranks):
    reports = {**lora_reports(two_ranks), **lora_reports(four_ranks)}
    assert sorted(reports) == sorted([c["id"] for c in LORA2] + ["lora-fsdp2xtp2"])
    held = {"lora-ddp": adapter_elements(1, 1), "lora-zero3": adapter_elements(1, 2), "lora-tp": adapter_elements(2, 1),
            "lora-tp-sp": adapter_elements(2, 1), "lora-fsdp2xtp2": adapter_elements(2, 2)}
    for name, report in reports.items():
        assert report["passed"] and report["checks"]["lora"], (name, report)
        lora = report["lora"]
        assert lora["first_logits_equal_base"]
        for rank in lora["per_rank"]:
            assert rank["base_changed"] == [] and rank["frozen_with_grad"] == [] and rank["frozen_parameters"] > 0
            assert rank["optimizer_state_elements"] == 2 * rank["adapter_elements"]
            if name in held:
                assert rank["adapter_elements"] == held[name], (name, rank)
    # pp: each stage holds its own blocks' adapters, together all of them
    assert sum(r["adapter_elements"] for r in reports["lora-pp"]["lora"]["per_rank"]) == adapter_elements(1, 1)
