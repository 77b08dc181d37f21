"""Mixture of Experts: the block, its parameter counts and planning, --ep, and verify against one device.

References: the MoE block against a per-token loop over its chosen experts (the definition of top-k routing);
`verify` (verify/parity.py, fp32 tolerances) against one device, router decisions included; parameter counts
against the published 30.5 B / 3.3 B of Qwen3-30B-A3B, 46.7 B / 12.9 B of Mixtral-8x7B, 671 B / 37 B of
DeepSeek-V3.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from groups import verified
from helpers import plugin_env
from paratrain.errors import UserError
from paratrain.models.args import ModelArgs
from paratrain.models.hf_shape import args_from_hf_config
from paratrain.models.moe import MoE
from paratrain.models.presets import PRESETS, build_model, count_params
from paratrain.parallel.dims import dim_named
from paratrain.parallel.ep.expert_parallel import check_ep
from paratrain.parallel.layout import Layout

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN3_30B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
             "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
             "tie_word_embeddings": False, "rope_theta": 1000000.0}


def per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its k chosen experts one by one, weighted by its gates."""
    gates, ids, _ = moe.router(x)
    e = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            i = int(ids[t, j])
            out[t] += gates[t, j] * (F.silu(x[t] @ e.w1[i]) * (x[t] @ e.w3[i])) @ e.w2[i]
    return out


def random_moe(**shape) -> MoE:
    """A small MoE layer with weights large enough that routing and every expert matter."""
    torch.manual_seed(0)
    moe = MoE(ModelArgs(dim=16, n_experts=4, top_k=2, moe_ffn_dim=8, **shape))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_moe_block_matches_per_token_routing(router):
    moe = random_moe(router=router)
    x = torch.randn(12, 16)
    torch.testing.assert_close(moe.eval()(x), per_token_reference(moe, x), rtol=1e-5, atol=1e-6)
    assert int(moe.last_load.sum()) == 12 * 2  # dropless: every routed copy reached an expert


def test_moe_gradients_match_per_token_routing():
    """The expert loop (unbound weights) and the batched combine give the per-token definition's gradients."""
    moe = random_moe()
    x = torch.randn(12, 16, requires_grad=True)
    grads = []
    for forward in (moe.eval(), lambda t: per_token_reference(moe, t)):
        moe.zero_grad()
        x.grad = None
        forward(x).square().sum().backward()
        grads.append([x.grad.clone(), *(p.grad.clone() for p in moe.experts.parameters()),
                      moe.router.gate.weight.grad.clone()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_routed_copies_are_cast_to_the_autocast_dtype_before_dispatch():
    """Under autocast the experts compute in bf16: the copies leave in bf16 (half the bytes gathered and sent)."""
    from paratrain.models.moe import local_dispatch

    moe = random_moe()
    seen = []

    def recording_dispatch(x, *rest):
        seen.append(x.dtype)
        return local_dispatch(x, *rest)

    moe.dispatch = recording_dispatch
    x = torch.randn(12, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe.eval()(x)
    moe(x)
    assert seen == [torch.bfloat16, torch.float32]
    torch.testing.assert_close(out.float(), per_token_reference(moe, x), rtol=0.05, atol=0.05)


def test_capacity_factor_drops_overflow_and_bias_update_balances():
    args = ModelArgs(dim=8, n_experts=4, top_k=1, moe_ffn_dim=8, capacity_factor=1.0, bias_update_rate=0.1)
    moe = MoE(args)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0] = 1.0  # every token with a positive sum prefers expert 0
    x = torch.ones(8, 8)
    moe.train()(x).sum().backward()
    assert moe.last_dropped == 8 - 2  # capacity 1.0 x 8 tokens x 1 / 4 experts = 2 copies
    bias = moe.router.expert_bias
    assert bias[0] < 0 and (bias[1:] > 0).all()  # the overloaded expert is pushed down, the idle ones up


def test_capacity_is_per_sequence_so_drops_do_not_depend_on_the_batch():
    """A sequence's drops are its own: run alone or next to another sequence (as a data rank or a single device
    batches it), its output is the same. At factor 0.5 at most half the copies fit, so drops are certain."""
    moe = random_moe(capacity_factor=0.5).eval()
    x = torch.randn(2, 16, 16)
    together = moe(x)
    dropped_together = moe.last_dropped
    alone = torch.cat([moe(x[:1]), moe(x[1:])])
    assert dropped_together >= 2 * 16 * 2 // 2  # factor 0.5: at least half of the 64 copies
    torch.testing.assert_close(together, alone, rtol=0, atol=0)


def test_aux_loss_reaches_router_gradient():
    args = ModelArgs(dim=8, n_experts=4, top_k=2, moe_ffn_dim=8, aux_loss_coeff=1.0)
    grads = []
    for coeff in (0.0, 1.0):
        torch.manual_seed(0)
        moe = MoE(ModelArgs(**{**args.to_dict(), "aux_loss_coeff": coeff}))
        moe(torch.randn(16, 8)).sum().backward()
        grads.append(moe.router.gate.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])


def test_published_parameter_counts():
    for name, total, active in (("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9),
                                ("deepseek-v3-like", 671e9, 37e9)):
        args = PRESETS[name]
        assert abs(count_params(args) / total - 1) < 0.02, name
        assert abs(count_params(args, active=True) / active - 1) < 0.02, name
    model = build_model(PRESETS["moe-tiny"], "meta")
    assert sum(p.numel() for p in model.parameters()) == count_params(PRESETS["moe-tiny"])


def test_hf_moe_configs_parse_their_experts():
    qwen = args_from_hf_config(QWEN3_30B)
    assert (qwen.n_experts, qwen.top_k, qwen.expert_dim, qwen.head_dim) == (128, 8, 768, 128)
    assert abs(count_params(qwen) / 30.5e9 - 1) < 0.02 and abs(count_params(qwen, active=True) / 3.3e9 - 1) < 0.02
    renamed = {k: v for k, v in QWEN3_30B.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert args_from_hf_config(renamed).n_experts == 128  # transformers 5 saves qwen3_moe's count so
    mixtral = args_from_hf_config({"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
                                   "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                                   "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000})
    assert abs(count_params(mixtral) / 46.7e9 - 1) < 0.02
    olmoe = args_from_hf_config({"model_type": "olmoe", "hidden_size": 2048, "num_hidden_layers": 16,
                                 "num_attention_heads": 16, "intermediate_size": 1024, "num_experts": 64,
                                 "num_experts_per_tok": 8, "vocab_size": 50304})
    assert abs(count_params(olmoe) / 6.9e9 - 1) < 0.03 and abs(count_params(olmoe, active=True) / 1.3e9 - 1) < 0.03


def test_plan_json_reports_total_and_active_params(tmp_path, cli_inproc):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B))
    res = cli_inproc("plan", "--model", f"hf:{tmp_path}", "--gpu", "h100-sxm", "--gpus", "64", "--seq-len", "4096",
                     "--global-batch", "64", "--top", "1", "--json")
    model = json.loads(res.stdout)["model"]
    assert abs(model["params"] / 30.5e9 - 1) < 0.02 and abs(model["active_params"] / 3.3e9 - 1) < 0.02
    assert model["experts"] == 128 and model["top_k"] == 8
    assert "30.5 B total, 3.35 B active" in res.stderr


def test_ep_is_one_registered_dimension_that_adds_no_ranks():
    ep = dim_named("ep")
    assert ep.flag == "--ep" and not ep.world_factor and ep.within == ("dp_shard", "cp")
    assert Layout(dp_shard=4, ep=2).world == 4
    with pytest.raises(UserError, match="must divide"):
        Layout(dp_shard=2, ep=4)
    with pytest.raises(UserError, match="Mixture-of-Experts"):
        check_ep(PRESETS["tiny"], Layout(dp_shard=2, ep=2))
    with pytest.raises(UserError, match="does not divide the model's 4 experts"):
        check_ep(PRESETS["moe-tiny"], Layout(dp_shard=3, ep=3))


def test_ep2_on_two_ranks_matches_one_device(two_ranks):
    report = verified(two_ranks, "moe-ep2")
    assert report["passed"] and report["dims"]["ep"] == 2 and report["dims"]["dp_shard"] == 2, report
    # with a capacity factor (per sequence: each rank drops what one device drops for its sequences)
    report = verified(two_ranks, "moe-ep2-capacity")
    assert report["passed"] and report["expert_assignments_match"] is True, report


def test_capacity_factor_is_refused_where_it_cannot_apply(cli_inproc):
    for args, words in ((("--model", "tiny"), "needs a Mixture-of-Experts model"),
                        (("--model", "moe-tiny", "--strategy", "cp-ring"), "with --cp is not supported")):
        res = cli_inproc("train", *args, "--moe-capacity-factor", "1.0", "--nproc", "2", "--steps", "1")
        assert res.returncode == 2 and words in res.stderr, res.stderr


@pytest.mark.timeout(500)
def test_ep_layouts_planted_faults_and_resume_at_another_ep_on_four_ranks(four_ranks):
    report = four_ranks["moe"]  # moe_worker.py's checks, in the shared 4-rank group (tests/conftest.py)
    results = {r["id"]: r for r in report["verify"]}
    for case, ep in (("ep2-dp_shard4", 2), ("ep4-ac-selective", 4), ("ep2-dp_shard2-tp2", 2), ("ep2-pp2", 2),
                     ("ep2-dp_shard2-cp2", 2)):
        r = results[case]
        assert r["passed"] and r["expert_assignments_match"] is True and r["dims"]["ep"] == ep, r
    for fault in ("moe-wrong-splits", "moe-swapped-ids", "moe-dropped-expert-grad", "moe-aux-per-rank"):
        r = results[fault]
        assert not r["passed"] and r["first_step"] == 1, r
    # no "2 sequential all_reduce operations" from DTensor on any rank: the grad norm of a weight on two mesh dims
    # (FSDP x TP) finds their flattened view (parallel/layout.py) and sums in one all-reduce
    assert all(r["redistribute_warnings"] == [] for r in results.values()), results
    # misrouting is seen as misrouting: the router's own decisions differ at step 1, the first layer named
    assert results["moe-swapped-ids"]["first_assignment_mismatch"]["layer"] == "layers.0.feed_forward"
    assert results["moe-swapped-ids"]["first_assignment_mismatch"]["step"] == 1
    # a token travels once to each rank holding any of its experts (parallel/ep/ep_exchange.py): the rows the
    # ranks sent are the distinct (token, rank) pairs of their routers' choices, fewer than the routed copies
    rows = report["rows"]
    assert rows["rows"] == rows["pairs"] and 0 < rows["rows"] < rows["copies"], rows
    # a checkpoint saved at ep=2 resumes at ep=4 and at ep=1 (zero3) where the uninterrupted run is
    resume = report["resume"]
    for name in ("ep4_resumed", "ep1_resumed"):
        assert resume[name] == pytest.approx(resume["ep2_full"], rel=1e-5), resume


def test_doctor_names_a_collapsed_router_and_not_a_clean_one(cli_here, tmp_path):
    """A router biased to expert 0 (tests/support/moe_faults.py) is named expert_imbalance; the same run with
    its own router is not; metrics.jsonl carries the per-layer load either way."""
    found = {}
    for fault in ("moe-biased-router", ""):
        env = plugin_env("support.moe_faults:plugin", PARATRAIN_TEST_MOE_FAULT=fault)
        res = cli_here("doctor", "--model", "moe-tiny", "--strategy", "single", "--steps", "4", "--json", env=env)
        assert res.returncode == 0, res.stderr[-2000:]
        found[fault] = {f["cause"]: f for f in json.loads(res.stdout)["findings"]}
    biased = found["moe-biased-router"]["expert_imbalance"]
    assert biased["severity"] == "high" and "expert 0 takes 2.00x the mean" in biased["evidence"], biased
    assert "expert_imbalance" not in found[""], found[""]
    run = tmp_path / "run"
    res = cli_here("train", "--model", "moe-tiny", "--strategy", "single", "--steps", "2", "--out", str(run))
    assert res.returncode == 0, res.stderr[-2000:]
    load = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["expert_load"]
    assert [layer["layer"] for layer in load] == ["layers.0.feed_forward", "layers.1.feed_forward"]
    copies = {sum(layer["tokens_per_expert"]) for layer in load}
    assert len(copies) == 1 and copies.pop() % 2 == 0  # every token's top-2 copies, in every layer (dropless)
    assert all(layer["max_over_mean"] < 1.4 and layer["dropped"] == 0 for layer in load), load


def test_moe_routing_traces_under_torch_compile():
    """The routing has no data-dependent shapes (counts by scatter_add, sorts undone by gathers): dynamo and AOT
    autograd trace it; the CPU expert loop, which reads its split sizes on the host, is a graph break. Losses
    and gradients equal eager's."""
    torch.manual_seed(0)
    model = build_model(PRESETS["moe-tiny"])
    tokens = torch.randint(0, 256, (2, 16))
    results = []
    for forward in (model, torch.compile(model, backend="aot_eager", fullgraph=False)):
        model.zero_grad()
        loss = F.cross_entropy(forward(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        results.append([loss.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
