"""--ep in the planner's open search: an MoE model gets expert-parallel candidates ranked with the rest (each one
a layout the runtime accepts), a dense model never does, and a fixed --ep stays fixed."""

from __future__ import annotations

import json

import pytest

from paratrain.models.presets import get_preset
from paratrain.parallel.checks import check_layout
from paratrain.parallel.layout import Layout
from paratrain.plan.search import Job, base_layouts


def test_base_layouts_search_ep_for_moe_models_only():
    moe = Job(args=get_preset("moe-tiny"), model_name="moe-tiny", gpus=8, seq_len=64, global_batch=16)
    layouts = base_layouts(moe, {}, 8)
    eps = {lay.ep for lay in layouts}
    assert eps == {1, 2, 4}, eps  # moe-tiny has 4 experts: ep must divide them and dp_shard x cp
    for lay in layouts:
        if lay.ep > 1:
            assert (lay.dp_shard * lay.cp) % lay.ep == 0 and not lay.sp, lay.label()
    dense = Job(args=get_preset("tiny"), model_name="tiny", gpus=8, seq_len=64, global_batch=16)
    assert {lay.ep for lay in base_layouts(dense, {}, 8)} == {1}
    assert {lay.ep for lay in base_layouts(moe, {"ep": 2}, 8)} == {2}  # fixed by the user: not searched


def _candidates(cli, model: str) -> list[dict]:
    res = cli("plan", "--model", model, "--gpu", "h100-sxm", "--gpus", "4", "--seq-len", "64", "--global-batch", "8",
              "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["candidates"]


def test_plan_json_ranks_ep_candidates_and_the_chosen_one_runs(cli_inproc):  # planning starts no process
    cands = _candidates(cli_inproc, "moe-tiny")
    with_ep = [c for c in cands if c["dims"]["ep"] > 1]
    assert with_ep, [c["dims"] for c in cands]
    args = get_preset("moe-tiny")
    for cand in [cands[0], *with_ep]:  # the recommended layout and every expert-parallel one: runnable as planned
        d = cand["dims"]
        lay = Layout(**d, zero_stage=3 if d["dp_shard"] > 1 else 0, micro_batch=cand["micro_batch"],
                     microbatches=8 // (d["dp_replicate"] * d["dp_shard"]) // cand["micro_batch"])
        check_layout(lay, args, 64, 8, "cuda")
        assert f"--ep {d['ep']}" in cand["command"]
    assert all(c["dims"]["ep"] == 1 for c in _candidates(cli_inproc, "tiny"))


def test_inter_node_all_to_all_pays_each_ranks_own_nic():
    """An all-to-all over 64 ranks, 8 to a node: each rank sends 56/64 of its payload through its own NIC (a ring's
    rails do not apply: no NIC is borrowed), the rest over NVLink meanwhile."""
    from paratrain.costs.collectives import collective_time
    from paratrain.costs.hardware import profile_from_spec
    from paratrain.gpu_catalog import get_gpu

    prof = profile_from_spec(get_gpu("h100-sxm"))
    payload = 1e9
    t = collective_time(prof, "all_to_all", payload, 64, "inter", rails=8)
    latency = prof.latency_us.get("inter", 10.0) * 1e-6 * 63
    assert t - latency == pytest.approx(payload * 56 / 64 / (prof.link_gbs["inter"] * 1e9))
    # a ring collective still spreads over the node's NICs
    assert collective_time(prof, "all_gather", payload, 64, "inter", rails=8) < t


def test_activation_checkpointing_replays_the_expert_exchange():
    """The runtime re-runs each MoE layer's forward exchanges when AC replays the block's forward (counted on 2
    gloo ranks: moe_dispatch 2 -> 4 per step with --ac full; --ac selective recomputes them too), so the planner
    prices 6 row all-to-alls, not 4, and the split counts and the copies' (row, gate) pairs twice (their gradient
    once).
    A token goes once to each rank holding any of its experts: r rows per token, fewer than its k copies."""
    from paratrain.costs.expert_spread import ranks_per_token
    from paratrain.costs.hardware import profile_from_spec
    from paratrain.gpu_catalog import get_gpu
    from paratrain.parallel.ep.ep_cost import moe_all_to_all
    from paratrain.plan.costing.time import TimeEstimate

    prof = profile_from_spec(get_gpu("h100-sxm"))
    args = get_preset("qwen3-30b-a3b")
    r = ranks_per_token(args.n_experts, args.top_k, 8)
    assert 5.3 < r < 5.4  # 8 distinct experts of 128 drawn at random reach 5.34 of 8 ranks
    tokens, layers, mbs = 4096, 48, 2
    rows, copies = tokens * r * args.dim * 2, tokens * args.top_k
    splits = (args.n_experts + 8) * 8
    sent = {}
    for ac in ("none", "full", "selective"):
        est = TimeEstimate()
        lay = Layout(dp_shard=8, ep=8, zero_stage=3, micro_batch=1, microbatches=mbs, ac=ac)
        moe_all_to_all(prof, args, lay, tokens, "bf16", layers, est)
        sent[ac] = est.comm_by_kind["all_to_all"] / (layers * mbs)
    assert sent["none"] == pytest.approx(4 * rows + splits + 2 * copies * 16)
    assert sent["full"] == pytest.approx(6 * rows + 2 * splits + 3 * copies * 16)
    assert sent["selective"] == pytest.approx(sent["full"])


def test_the_traced_stand_in_routes_in_bf16_and_prices_no_exchange_as_compute():
    """Under autocast the runtime casts the routed copies to bf16 before it gathers them (models/moe.py:
    routed_input), with or without --ep; the stand-in gathers the same bf16 copies. The all-to-all buffers are
    allocated as communication (CommLog.simulating), and balanced routing needs no padding copy."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from paratrain.models.moe import MoE
    from paratrain.plan.tracing.local_model import CommLog
    from paratrain.plan.tracing.moe_trace import balanced_forward

    class Ops(TorchDispatchMode):
        def __init__(self, log):
            super().__init__()
            self.log, self.seen = log, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.seen.append((func.__name__, out.dtype, self.log.in_comm))
            return out

    args = get_preset("moe-tiny")
    for ep, routed_dtype in ((1, torch.bfloat16), (2, torch.bfloat16)):
        moe, log = MoE(args), CommLog()
        forward = balanced_forward(moe, ep, log)
        with Ops(log) as ops, torch.autocast("cpu", dtype=torch.bfloat16):
            forward(torch.randn(2, 16, args.dim))
        gathers = [dtype for name, dtype, _ in ops.seen if name.startswith("index_select") and dtype.is_floating_point]
        assert gathers and set(gathers) == {routed_dtype}, ops.seen
        assert not any(name.startswith("constant_pad_nd") for name, _, _ in ops.seen)
        in_comm = [name for name, _, comm in ops.seen if comm]
        assert in_comm == (["clone.default"] * 3 if ep > 1 else []), in_comm  # (row, gate) pairs, rows, sums


def _tiny_qwen3_moe_dir(path, **shape) -> str:
    """A Qwen3-MoE config.json written by transformers' own config class (no weights, nothing downloaded)."""
    from transformers import Qwen3MoeConfig

    fields = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
              "num_experts_per_tok": 2, "vocab_size": 256, "max_position_embeddings": 128, **shape}
    Qwen3MoeConfig(**fields).save_pretrained(str(path))
    return f"hf:{path}"


def test_plan_marks_what_the_runtime_refuses_for_an_hf_moe_model(tmp_path, cli_inproc):
    """An hf: MoE model runs as transformers' modules, whose experts split with FSDP only (train/hf_run_checks.py
    check_hf_moe_run): the planner marks --ep with tp, pp or cp runtime_unsupported with the runtime's own words,
    and never recommends it, while paratrain's own MoE of the same shape may."""
    from paratrain.errors import UserError
    from paratrain.train.hf_run_checks import check_hf_moe_run

    tiny = _tiny_qwen3_moe_dir(tmp_path / "tiny")
    res = cli_inproc("plan", "--model", tiny, "--gpu", "h100-sxm", "--gpus", "8", "--seq-len", "64",
                     "--global-batch", "16", "--ep", "2", "--tp", "2", "--json")
    doc = json.loads(res.stdout)
    with pytest.raises(UserError) as refusal:
        check_hf_moe_run(Layout(dp_shard=4, ep=2, tp=2), "qwen3_moe", 4)
    assert doc["no_fit_reason"] == "runtime_unsupported" and doc["candidates"], doc
    assert all(c["runtime_unsupported"] for c in doc["candidates"])
    assert {c["runtime_unsupported"] for c in doc["candidates"] if c["dims"]["dp_replicate"] == 1} == \
        {str(refusal.value)}  # (with dp_replicate, --ep's own rule refuses it first)
    # left open on a Qwen3-30B-A3B shape, 64 GPUs: expert parallelism wins, with FSDP only
    big = _tiny_qwen3_moe_dir(tmp_path / "big", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                              num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                              num_experts=128, num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960)
    res = cli_inproc("plan", "--model", big, "--gpu", "h100-sxm", "--gpus", "64", "--seq-len", "4096",
                     "--global-batch", "64", "--json")
    cands = [c for c in json.loads(res.stdout)["candidates"] if not c["runtime_unsupported"]]
    assert cands and cands[0]["dims"]["ep"] > 1, [c["dims"] for c in cands]
    for cand in cands:
        d = cand["dims"]
        assert d["ep"] == 1 or d["tp"] == d["pp"] == d["cp"] == 1, d


def test_plan_marks_experts_the_runtime_cannot_split_as_train_refuses_them(tmp_path, cli_inproc):
    """JetMoE keeps its experts' weights in two modules (models/hf_moe_layout.py split_refusal): train refuses
    --ep on it before any process starts, and plan marks the same layout runtime_unsupported in the same words
    (both through train/hf_run_checks.py), recommending none of the --ep candidates."""
    from paratrain.interop.hf_tiny_config import tiny_config

    tiny_config("jetmoe").save_pretrained(str(tmp_path / "jetmoe"))
    spec = f"hf:{tmp_path / 'jetmoe'}"
    shape = ["--seq-len", "64", "--global-batch", "8"]
    refused = cli_inproc("train", "--model", spec, "--strategy", "ep", "--ep", "2", "--nproc", "4", "--device", "cpu",
                         *shape)
    assert refused.returncode == 2 and "JetMoeParallelExperts" in refused.stderr, refused.stderr
    rule = refused.stderr.strip().splitlines()[-1].removeprefix("error: ")
    doc = json.loads(cli_inproc("plan", "--model", spec, "--gpu", "h100-sxm", "--gpus", "4", *shape, "--ep", "2",
                                "--json").stdout)
    fsdp_only = [c for c in doc["candidates"] if c["dims"]["dp_shard"] == 4]
    assert fsdp_only and all(c["runtime_unsupported"] == rule for c in fsdp_only), doc["candidates"]
    assert doc["no_fit_reason"] == "runtime_unsupported"


def test_plan_marks_pp_with_tp_on_an_hf_dense_model_runtime_unsupported(tmp_path, cli_inproc):
    """A transformers model's pipeline stages compose with data parallelism only (train/hf_run_checks.py
    check_hf_pipeline_layout): the planner marks pp x tp with the runtime's own words, as train refuses it."""
    from transformers import Qwen2Config

    from paratrain.errors import UserError
    from paratrain.train.hf_run_checks import check_hf_pipeline_layout

    Qwen2Config(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256, max_position_embeddings=128).save_pretrained(str(tmp_path))
    res = cli_inproc("plan", "--model", f"hf:{tmp_path}", "--gpu", "h100-sxm", "--gpus", "4", "--seq-len", "64",
                     "--global-batch", "8", "--pp", "2", "--tp", "2", "--json")
    doc = json.loads(res.stdout)
    with pytest.raises(UserError) as refusal:
        check_hf_pipeline_layout(Layout(pp=2, tp=2))
    assert doc["candidates"] and {c["runtime_unsupported"] for c in doc["candidates"]} == {str(refusal.value)}
    res = cli_inproc("plan", "--model", f"hf:{tmp_path}", "--gpu", "h100-sxm", "--gpus", "4", "--seq-len", "64",
                     "--global-batch", "8", "--pp", "2", "--json")
    assert all(not c["runtime_unsupported"] for c in json.loads(res.stdout)["candidates"])


def test_ranks_a_token_reaches_by_routing():
    """r, the rows --ep sends per token: a uniformly random top-k against a simulation of it, and AutoModel's
    balanced benchmark gate (k consecutive experts from t*k) counted by hand."""
    import torch

    from paratrain.costs.expert_spread import ranks_per_token
    from paratrain.errors import UserError

    gen = torch.Generator().manual_seed(0)
    for experts, k, ep in ((128, 8, 8), (256, 8, 64), (4, 2, 2)):
        picks = torch.rand(20000, experts, generator=gen).topk(k, dim=-1).indices // (experts // ep)
        ranks = picks.sort(-1).values
        simulated = (1 + (ranks[:, 1:] != ranks[:, :-1]).sum(-1)).float().mean().item()
        assert ranks_per_token(experts, k, ep) == pytest.approx(simulated, rel=0.01)
    assert ranks_per_token(128, 8, 8, "consecutive") == 1.0  # 16 experts per rank: all 8 on one
    assert ranks_per_token(256, 8, 64, "consecutive") == 2.0  # 4 per rank: two ranks
    assert ranks_per_token(384, 8, 32, "consecutive") == pytest.approx(4 / 3)  # 12 per rank: 1, 2, 1, ...
    assert ranks_per_token(128, 8, 1) == 1.0
    with pytest.raises(UserError, match="unknown MoE routing"):
        ranks_per_token(128, 8, 8, "sticky")
