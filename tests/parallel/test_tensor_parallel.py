"""Tensor and sequence parallel: plans and their checks, parity against one device, and the CLI contract.

References: `paratrain verify` compares against a single-device run of the same seed and batches (fp32
tolerances of verify/parity.py); tp_parity_worker.py compares against the unsharded module, rtol 1e-5.
"""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from groups import verified
from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.models.plans import llama_tp_plan, tp_plan_for
from paratrain.models.presets import PRESETS, build_model
from paratrain.parallel.layout import Layout
from paratrain.parallel.tp.tensor_parallel import check_plan, match_modules
from paratrain.parallel.tp.tp_technique import check_tp_divides, check_tp_with_dp
from paratrain.train.validate import validate_run


# -- plans and their validation (no process group) -------------------------------------------------------
def test_llama_plan_shards_every_matmul_and_names_real_modules():
    model = build_model(PRESETS["tiny"], "meta")
    for sp in (False, True):
        plan = llama_tp_plan(model, tp=2, sp=sp)
        check_plan(model, plan, 2)
        covered = {name for path in plan for name, _ in match_modules(model, path)}
        linears = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
        assert linears <= covered
        assert isinstance(plan["layers.*.attention.wq"], ColwiseParallel)
        assert isinstance(plan["layers.*.feed_forward.w2"], RowwiseParallel)


def test_plan_errors_name_the_problem():
    model = build_model(PRESETS["tiny"], "meta")
    with pytest.raises(UserError, match="kv heads"):
        llama_tp_plan(model, tp=4)
    with pytest.raises(UserError, match="kv heads"):
        check_tp_divides(model.args, 4)
    with pytest.raises(UserError, match="'layers.*.mlp.up' matches no submodule"):
        check_plan(model, {"layers.*.mlp.up": ColwiseParallel()}, 2)
    with pytest.raises(UserError, match="not a ParallelStyle"):
        check_plan(model, {"output": "colwise"}, 2)
    odd = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 8))
    with pytest.raises(UserError, match="tp=4 does not divide 0's out_features"):
        check_plan(odd, {"0": ColwiseParallel(), "1": RowwiseParallel()}, 4)
    with pytest.raises(UserError, match="no built-in tensor-parallel plan for Sequential"):
        tp_plan_for(odd, 2)
    with pytest.raises(UserError, match="tp=2 with dp_replicate=2 would need DDP"):
        check_tp_with_dp(Layout(dp_replicate=2, tp=2))
    check_tp_with_dp(Layout(dp_shard=2, tp=2))  # 2-D with FSDP is fine


# -- parity: a user's own module + plan, built-in plans, loss parallel, bytes --------------------------------
@pytest.mark.timeout(500)
def test_tp_parity_worker_two_ranks(two_ranks):
    res = two_ranks["tp_parity"]  # tp_parity_worker.py's checks, run in the shared 2-rank group
    user = res["user_model"]
    # errors are in units of the tolerance (ATOL + RTOL*|ref|): <= 1 passes
    assert max(user["out"], user["grad"], user["param"]) <= 1.0, user
    assert "query.weight" in user["sharded"] and "down.weight" in user["sharded"]
    for key in ("tiny-loss-parallel", "tiny-sp-loss-parallel", "gpt2-tiny", "gpt2-tiny-sp", "gpt2-tiny-loss-parallel",
                "gpt2-tiny-sp-loss-parallel"):
        assert max(res[key]["loss"], res[key]["grad"]) <= 1.0, (key, res[key])
        assert res[key]["trainable"] == res[key]["trainable_ref"], key  # GPT-2's key bias stays frozen under TP
    for key in ("gpt2-tiny", "gpt2-tiny-sp", "gpt2-tiny-loss-parallel", "gpt2-tiny-sp-loss-parallel"):
        assert res[key]["tied"], key  # the head still *is* the (sharded) token table
    trainer = res["trainer_loss_parallel"]  # the trainer's TP step: vocab-sharded logits into the loss
    assert trainer["loss_parallel"] and trainer["all_gather"] == 0 and trainer["loss"] <= 1.0, trainer
    assert trainer["all_gather_without"] >= 2 * 16 * 256 * 4 // 2, trainer  # whole logits: gathered (the fault)
    naive = res["gpt2-tiny-naive-tied"]  # the injected fault (the tie lost under TP) is caught
    assert not naive["tied"] and naive["grad"] > 100, naive
    assert res["tiny-loss-parallel"]["logits_dtensor"]
    assert max(res["stage"].values()) <= 1.0, res["stage"]  # a middle pipeline stage, whole hidden states in/out
    # Megatron: per layer 4 all-reduces of b*s*h fp32 (fwd+bwd); SP: as many all-gathers and reduce-scatters,
    # plus the two norm-weight gradient all-reduces (h floats each)
    act = 2 * 16 * 64 * 4
    assert res["bytes_per_layer"]["tp"] == {"all_reduce": 4 * act, "all_gather": 0}
    sp = res["bytes_per_layer"]["tp-sp"]
    assert sp["all_gather"] == sp["reduce_scatter"] == 4 * act and sp["all_reduce"] == 2 * 64 * 4


# -- verify against one device (conftest.py's process groups) --------------------------------------------------
@pytest.mark.timeout(500)
@pytest.mark.parametrize("case, tp, world", [("tp2", 2, 2), ("tp-sp2", 2, 2), ("tp4", 4, 4), ("fsdp2xtp2", 2, 4)])
def test_verify_passes_fp32(two_ranks, four_ranks, case, tp, world):
    report = verified(two_ranks if world == 2 else four_ranks, case)
    assert report["passed"] and report["dtype"] == "fp32", report
    assert report["dims"]["tp"] == tp and report["world_size"] == world


@pytest.mark.timeout(60)
def test_tp3_on_four_heads_exits_2(cli_inproc):
    # the model check runs before the world-size check, so the root cause is named whatever --nproc is
    res = cli_inproc("verify", "--tp", "3", "--nproc", "2")
    assert res.returncode == 2
    assert "tp=3" in res.stderr and "attention heads (4)" in res.stderr
    with pytest.raises(UserError, match=r"tp=3 does not divide the model's attention heads \(4\)"):
        validate_run(TrainConfig(tp=3, nproc=3), 3)
