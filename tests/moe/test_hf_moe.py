"""transformers' MoE models under --ep and --tp, and the export of MoE runs, against their references.

References: `verify` (verify/parity.py, fp32 tolerances) against one device, router decisions included, for tiny
Qwen3-MoE, Mixtral and OLMoE configs made with transformers' own config classes, and GPT-OSS, DeepSeek-V3 and
Qwen2-MoE ones made by interop/hf_tiny_config.py's rule (nothing downloaded); for
export, transformers itself: the key set its save_pretrained writes for the same config, from_pretrained loading
with nothing missing or unexpected, and its logits against paratrain's with the checkpoint's weights (atol 1e-5).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers  # the [hf] extra is part of [test]
from safetensors import safe_open

from paratrain.convert.hf_export import export_checkpoint
from paratrain.convert.moe_preset_export import check_mixtral_exportable
from paratrain.errors import UserError
from paratrain.interop.hf_tiny_config import tiny_config
from paratrain.models.hf_model import build_hf_model
from paratrain.models.presets import PRESETS, build_model
from paratrain.parallel.layout import Layout
from paratrain.train.hf_run_checks import check_hf_moe_run
from paratrain.train.recovery.safe_dcp import SafeFileSystemReader, SafeLoadPlanner
from reliability.inproc import launch_here

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=256, attention_dropout=0.0, tie_word_embeddings=False)
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))


def write_configs(root: Path) -> None:
    """4 experts, top-2, in each family's own config class (Mixtral's expert size is its intermediate_size)."""
    configs = {
        "qwen3_moe": transformers.Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=32,
                                                 num_experts=4, num_experts_per_tok=2),
        "mixtral": transformers.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                                              num_experts_per_tok=2),
        "olmoe": transformers.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                          eos_token_id=0, pad_token_id=1),
    }
    for kind in ("gpt_oss", "deepseek_v3", "qwen2_moe", "dots3_note_text"):  # interop/hf_tiny_config.py's rule
        configs[kind] = tiny_config(kind)
    for kind, config in configs.items():
        config.save_pretrained(root / kind)


def checkpoint_state(model: torch.nn.Module, step_dir: Path) -> torch.nn.Module:
    """`model` with the checkpoint's weights (DCP reassembles what ep or tp sharded)."""
    sd = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(sd, storage_reader=SafeFileSystemReader(step_dir), planner=SafeLoadPlanner(), no_dist=True)
    model.load_state_dict(sd["model"])
    return model.eval()


def check_export(out: Path, paratrain_model: torch.nn.Module) -> str:
    """The exported directory against transformers' own save_pretrained and from_pretrained; returns its class."""
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                                     dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    reference = out.parent / f"{out.name}-save_pretrained"
    transformers.AutoModelForCausalLM.from_config(loaded.config).save_pretrained(reference)

    def keys(folder: Path) -> set[str]:
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return set(f.keys())

    assert keys(out) == keys(reference)
    assert any(".experts.0." in k for k in keys(out))  # one weight per expert, as transformers saves them
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=TOKENS).logits, paratrain_model(TOKENS),
                                   atol=1e-5, rtol=0)
    return type(loaded).__name__


@pytest.mark.timeout(300)
def test_hf_moe_ep_tp_zero3_planted_faults_and_export(tmp_path):
    write_configs(tmp_path)
    if HERE not in sys.path:
        sys.path.insert(0, HERE)  # the ranks import the worker by name (they get this sys.path)
    from hf_moe_worker import run as run_worker

    # 2 ranks forked from this process's warm forkserver (reliability/inproc.py): no interpreter start per rank
    results = {r["id"]: r for r in launch_here(run_worker, (str(tmp_path),), 2, timeout_s=120.0)["verify"]}
    for kind in ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"):
        for layout, dims in (("ep2", {"ep": 2, "dp_shard": 2}), ("tp2", {"tp": 2}), ("zero3", {"dp_shard": 2})):
            r = results[f"{kind}-{layout}"]
            assert r["passed"] and r["expert_assignments_match"] is True, r
            assert all(r["dims"][k] == v for k, v in dims.items()), r
    assert results["qwen2_moe-tp2"]["passed"] and results["qwen2_moe-tp2"]["expert_assignments_match"] is True
    assert results["dots3_note_text-ddp"]["passed"], results["dots3_note_text-ddp"]  # gradient-free indexer
    pipelined, one_micro_batch = results["qwen3_moe-pp2"], results["qwen3_moe-pp2-gpipe1"]
    assert pipelined["passed"] and pipelined["expert_assignments_match"] is None, pipelined
    assert one_micro_batch["passed"] and one_micro_batch["expert_assignments_match"] is True, one_micro_batch
    for fault in ("moe-wrong-splits", "moe-swapped-ids", "moe-dropped-expert-grad"):
        r = results[f"qwen3_moe-{fault}"]
        assert not r["passed"] and r["first_step"] == 1 and r["first_divergence"]["step"] == 1, r
        # misrouted tokens are seen as such at step 1; a dropped gradient reroutes only after the update
        routed_step = (r["first_assignment_mismatch"] or {}).get("step")
        assert (routed_step == 1) is (fault != "moe-dropped-expert-grad"), r
    # the swapped ids are the router's own decisions: the first layer differs at step 1
    assert results["qwen3_moe-moe-swapped-ids"]["first_assignment_mismatch"]["layer"] == "hf.model.layers.0.mlp.experts"

    # export: the hf: runs back in their own format (from an ep and a tp checkpoint), moe-tiny as Mixtral
    for run, kind, architecture in (("qwen3_moe-ep2", "qwen3_moe", "Qwen3MoeForCausalLM"),
                                    ("mixtral-tp2", "mixtral", "MixtralForCausalLM")):
        step = tmp_path / f"ck-{run}" / "step-2"
        doc = export_checkpoint(step, tmp_path / f"out-{run}")
        assert doc["kind"] == "hf" and doc["architecture"] == architecture, doc
        ours = checkpoint_state(build_hf_model(f"hf:{tmp_path / kind}", seed=None), step)
        assert check_export(tmp_path / f"out-{run}", ours) == architecture
    step = tmp_path / "ck-moe-tiny-ep2" / "step-2"
    doc = export_checkpoint(step, tmp_path / "out-moe-tiny")
    assert doc["kind"] == "preset" and doc["architecture"] == "MixtralForCausalLM", doc
    ours = checkpoint_state(build_model(PRESETS["moe-tiny"], "cpu", seed=0), step)
    assert check_export(tmp_path / "out-moe-tiny", ours) == "MixtralForCausalLM"
    for mode in {(tmp_path / run / f).stat().st_mode & 0o777 for run in ("out-qwen3_moe-ep2", "out-moe-tiny")
                 for f in ("model.safetensors", "config.json")}:  # one mode for every file, as open() gives
        assert mode == 0o666 & ~_umask(), oct(mode)

    # every export trained again as hf:EXPORT under another strategy: its first loss is transformers' own loss
    # of the exported model on that first batch (the weights went in, in the layout transformers loads)
    from hf_moe_worker import RETRAIN, retrain

    launch_here(retrain, (str(tmp_path),), 2, timeout_s=120.0)
    for case in RETRAIN:
        first = json.loads((tmp_path / f"run-{case['id']}" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
        assert first == pytest.approx(export_loss_on_first_batch(tmp_path / case["out"]), rel=1e-5), case["id"]

    # per-layer expert load in metrics.jsonl, and the doctor's rule on it: the biased layer named, a clean run not
    biased, clean = (expert_imbalance(tmp_path / f"run-{run}") for run in ("qwen3_moe-ep2-biased", "qwen3_moe-ep2"))
    assert biased is not None and biased.severity == "high", biased
    assert biased.evidence.startswith("hf.model.layers.0.mlp.experts: expert 0 takes 2.00x the mean"), biased
    assert clean is None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def export_loss_on_first_batch(out: Path) -> float:
    """transformers' next-token loss of the exported model on the first batch of a 4-row, 32-token run."""
    from paratrain.train.data.indexed_sets import BatchSource, make_dataset

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    batch = BatchSource(make_dataset("synthetic", model.config.vocab_size, 32, 0), 4, 0, 1, 4).rank_batch(0)
    with torch.no_grad():
        logits = model(batch.inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()))


def expert_imbalance(run: Path):
    """The doctor's expert_imbalance finding (doctor/rules.py) on a run's metrics.jsonl steps, or None."""
    from types import SimpleNamespace

    from paratrain.doctor.rules import check_expert_imbalance

    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in steps if "step" in row]
    assert steps and all(len(row.get("expert_load", [])) == 2 for row in steps), steps  # both MoE layers, each step
    return check_expert_imbalance(SimpleNamespace(captures=[{"steps": steps}]))


def test_hf_experts_forward_is_transformers_own(tmp_path):
    """paratrain's experts forward (experts_implementation="paratrain") gives transformers' eager logits, in every
    experts layout: concatenated (Qwen, Mixtral, OLMoE, DeepSeek-V3), transposed with biases and an interleaved,
    clamped gate (GPT-OSS), transposed without biases (Aria)."""
    write_configs(tmp_path)
    tiny_config("aria_text").save_pretrained(tmp_path / "aria_text")
    for kind in ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "qwen2_moe", "aria_text"):
        model = build_hf_model(f"hf:{tmp_path / kind}", seed=0)
        for p in model.parameters():  # larger than the default init, so that routing and experts matter
            torch.nn.init.normal_(p, std=0.2)
        assert model.hf.get_experts_implementation()[""] == "paratrain"
        with torch.no_grad():
            ours = model(TOKENS)
            model.hf.set_experts_implementation("eager")
            torch.testing.assert_close(model(TOKENS), ours, rtol=1e-5, atol=1e-5)


def test_a_shared_expert_the_plan_leaves_out_is_split_as_the_dense_mlp(tmp_path):
    """Qwen2-MoE's tp plan names its dense MLP (gate_proj, up_proj colwise; down_proj rowwise) but not the shared
    expert beside the experts: it is split the same way, its own sigmoid gate kept whole (parity under tp=2: the
    launch above). Reference: the model's base_model_tp_plan entries for layers.*.mlp."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from paratrain.models.hf_tp_plan import hf_tp_plan
    from paratrain.models.tp_styles import ReplicateParallel

    tiny_config("qwen2_moe").save_pretrained(tmp_path)
    plan = hf_tp_plan(build_hf_model(f"hf:{tmp_path}", seed=None), 2)
    block = "hf.model.layers.0.mlp"
    assert {name: type(plan[f"{block}.shared_expert.{name}"]) for name in ("gate_proj", "up_proj", "down_proj")} == \
        {"gate_proj": ColwiseParallel, "up_proj": ColwiseParallel, "down_proj": RowwiseParallel}
    assert type(plan[f"{block}.shared_expert_gate"]) is ReplicateParallel


def test_unsupported_moe_layouts_are_refused_in_one_line():
    with pytest.raises(UserError, match="composes with FSDP only"):
        check_hf_moe_run(Layout(dp_shard=2, tp=2, ep=2), "mixtral", 4)
    with pytest.raises(UserError, match="sequence parallelism"):
        check_hf_moe_run(Layout(tp=2, sp=True), "qwen3_moe", 4)
    with pytest.raises(UserError, match="does not divide the model's 6 experts"):
        check_hf_moe_run(Layout(tp=4), "qwen3_moe", 6)
    with pytest.raises(UserError, match="--ep cannot split the experts of this llama4_text model: .*Llama4Text"):
        check_hf_moe_run(Layout(dp_shard=2, ep=2), "llama4_text", 8, split_refusal=moe_refusal("llama4_text"))
    with pytest.raises(UserError, match="--tp cannot split .*longcat_flash.*not one fused"):
        check_hf_moe_run(Layout(tp=2), "longcat_flash", 8, split_refusal=moe_refusal("longcat_flash"))
    check_hf_moe_run(Layout(dp_shard=2, ep=2), "olmoe", 4)  # allowed
    check_hf_moe_run(Layout(dp_shard=2, ep=2), "deepseek_v3", 8, split_refusal=moe_refusal("deepseek_v3"))
    for change, what in (({"router": "sigmoid"}, "a sigmoid router"), ({"n_shared_experts": 1}, "shared experts"),
                         ({"capacity_factor": 1.0}, "a capacity factor")):
        args = PRESETS["moe-tiny"].__class__(**{**PRESETS["moe-tiny"].to_dict(), **change})
        with pytest.raises(UserError, match=what):
            check_mixtral_exportable(args)


def moe_refusal(kind: str) -> str | None:
    """Why --ep / --tp cannot split the experts of `kind`'s tiny model (its layers read on the meta device)."""
    from paratrain.models.hf_model import meta_model
    from paratrain.models.hf_moe_layout import split_refusals

    refusals = split_refusals(meta_model(tiny_config(kind)))
    return refusals[0] if refusals else None


def test_router_aux_loss_coef_trains_as_transformers_own_loss(tmp_path, caplog):
    """With output_router_logits, transformers' labels= loss adds router_aux_loss_coef x its balancing loss:
    paratrain's training gradient (next-token loss on the logits, the balancing loss riding on the backward) is
    that loss's gradient. Without output_router_logits transformers leaves it out, and one line says so."""
    from types import SimpleNamespace

    from paratrain.train.step import lm_loss

    transformers.Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, output_router_logits=True,
                                router_aux_loss_coef=0.5).save_pretrained(tmp_path / "aux")
    model = build_hf_model(f"hf:{tmp_path / 'aux'}", seed=0).train()
    for p in model.parameters():  # larger than the default init, so that the router's choices matter
        torch.nn.init.normal_(p, std=0.2)
    lm_loss(model(TOKENS)[:, :-1], TOKENS[:, 1:]).backward()
    ours = {name: p.grad.clone() for name, p in model.hf.named_parameters()}
    model.zero_grad()
    model.hf(input_ids=TOKENS, labels=TOKENS, output_router_logits=True).loss.backward()
    for name, p in model.hf.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert ours["model.layers.0.mlp.gate.weight"].abs().sum() > 0

    from paratrain.train.hf_run_checks import warn_unapplied_balancing_loss

    transformers.Qwen3MoeConfig(**COMMON, num_experts=4, router_aux_loss_coef=0.25).save_pretrained(tmp_path / "off")
    warn_unapplied_balancing_loss(Layout(), SimpleNamespace(model=f"hf:{tmp_path / 'off'}"))
    assert [r.getMessage() for r in caplog.records if "router_aux_loss_coef" in r.getMessage()] == [
        f"hf:{tmp_path / 'off'}: router_aux_loss_coef 0.25 is not applied: the config's output_router_logits is "
        "false, and transformers adds the balancing loss only with it (set it true to train with that loss)"]
