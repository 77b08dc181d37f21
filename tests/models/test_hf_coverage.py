"""A sample of benchmarks/hf_coverage.py's run over the transformers families, in this one process (no launch):
tiny configs made by interop/hf_tiny_config.py's rule through `paratrain verify --strategy single`, the families'
scope, their MoE layers as models/hf_moe_layout.py reads them on the meta device, and the one-line refusals where
a layout cannot split a family's experts or run its attention.

Reference for "pass": verify's own parity check (verify/parity.py) at fp32 tolerances, exit 0. The sample covers
what the rule and the runtime had to learn: attention without SDPA (GPT-OSS's sinks, Gemma 2's soft-capping: eager),
a sub-configured MoE whose transformers defaults needed completing, with experts stacked in 2-D tensors (DBRX),
per-layer widths and key/value sharing (Gemma 3n), a heterogeneous per-layer config (dots3 note). GPT-OSS,
DeepSeek-V3 and Qwen2-MoE under ep, tp and zero3: tests/moe/test_hf_moe.py's launch.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from paratrain.interop.hf_families import scope_by_modules, scope_by_registration  # noqa: E402
from paratrain.interop.hf_tiny_config import tiny_config  # noqa: E402
from paratrain.models.hf_model import meta_model  # noqa: E402
from paratrain.models.hf_moe_layout import moe_layers  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_coverage.py"
SAMPLE = ("gpt_oss", "gemma2", "dbrx", "gemma3n_text", "dots3_note_text")


def coverage():
    spec = importlib.util.spec_from_file_location("hf_coverage", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_sample_of_families_passes_verify_single_in_one_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    bench = coverage()
    bench.quiet_transformers()
    rows = [bench.check_family(kind, tmp_path, steps=1, ep=False) for kind in SAMPLE]
    doc = bench.summary(rows, [])
    assert doc["single"] == {"pass": len(SAMPLE), "refused": 0, "failed": 0}, doc["failures"]
    moe = {r["model_type"]: r["moe"] for r in rows if r.get("moe_layers")}
    assert sorted(moe) == ["dbrx", "dots3_note_text", "gpt_oss"], moe
    assert moe["dbrx"]["layout"] == "other" and moe["gpt_oss"]["router"].endswith("mlp.router")


def test_scope_is_read_from_the_family():
    """Out of scope with the reason: an encoder-decoder's decoder, an encoder, a multimodal model, a recurrent
    model; in scope: a decoder-only attention family."""
    assert scope_by_registration("bart", "BartForCausalLM").startswith("encoder-decoder decoder")
    assert scope_by_registration("bert", "BertLMHeadModel").startswith("encoder:")
    assert scope_by_registration("gemma3", "Gemma3ForConditionalGeneration").startswith("multimodal:")
    assert scope_by_modules(meta_model(tiny_config("mamba"))).startswith("recurrent: layers mix tokens through Mamba")
    assert scope_by_registration("llama", "LlamaForCausalLM") is None
    assert scope_by_modules(meta_model(tiny_config("llama"))) is None


def test_moe_layers_are_read_from_their_shape_on_the_meta_device():
    """DeepSeek-V3: a dense first layer, sigmoid group-limited routing with a selection bias, a shared expert;
    Qwen2-MoE: a shared expert behind its own gate; GPT-OSS: transposed experts with biases, a learned logit bias;
    Llama 4: experts that take pre-routed inputs (not splittable, said in one line)."""
    deepseek = moe_layers(meta_model(tiny_config("deepseek_v3")))
    assert [layer.layer for layer in deepseek] == [1, 2]  # first_k_dense_replace=1 of 3 layers
    first = deepseek[0]
    assert (first.n_experts, first.top_k, first.router_scores, first.group_limited, first.routing_bias) == \
        (8, 2, "sigmoid", True, "selection")
    assert first.shared_experts == ("model.layers.1.mlp.shared_experts",) and first.split_refusal() is None
    width = tiny_config("deepseek_v3").moe_intermediate_size
    assert first.expert_params == ("gate_up_proj", "down_proj") and first.expert_numel == 8 * 3 * width * 64
    qwen2 = moe_layers(meta_model(tiny_config("qwen2_moe")))[0]
    assert qwen2.shared_gate == "model.layers.0.mlp.shared_expert_gate" and qwen2.router_scores == "softmax"
    gpt_oss = moe_layers(meta_model(tiny_config("gpt_oss")))[0]
    assert gpt_oss.expert_params == ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    assert gpt_oss.routing_bias == "logits" and gpt_oss.shared_experts == ()
    llama4 = moe_layers(meta_model(tiny_config("llama4_text")))[0]
    assert "Llama4TextExperts" in llama4.split_refusal() and "top-k expert ids" in llama4.split_refusal()


def test_layouts_that_cannot_apply_are_refused_in_one_line(tmp_path):
    """--ep on experts that take pre-routed inputs, cp on attention with sinks and sliding windows, cp on
    multi-head latent attention: exit 2, one line naming the module or the attention's terms, before any rank."""
    from reliability.inproc import run_cli_inproc

    for kind in ("llama4_text", "gpt_oss", "deepseek_v3"):
        tiny_config(kind).save_pretrained(tmp_path / kind)
    run = ["--steps", "1", "--seq-len", "32", "--global-batch", "4", "--device", "cpu"]
    cases = [(["--model", f"hf:{tmp_path / 'llama4_text'}", "--strategy", "ep", "--ep", "2"],
              "--ep cannot split the experts of this llama4_text model: model.layers.0.feed_forward.experts "
              "(Llama4TextExperts)"),
             (["--model", f"hf:{tmp_path / 'gpt_oss'}", "--strategy", "cp-ring"],
              "context parallelism (cp) on gpt_oss: its attention has per-head attention terms (sinks: attention "
              "sinks); sliding-window attention (window 8)"),
             (["--model", f"hf:{tmp_path / 'deepseek_v3'}", "--strategy", "cp-ulysses"],
              "query/key heads of 24 and value heads of 16 (multi-head latent attention)")]
    for argv, expected in cases:
        code, out, err = run_cli_inproc(["verify", *argv, *run, "--json"], cwd=tmp_path)
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert code == 2 and len(lines) == 1 and expected in lines[0], err
        assert "Traceback" not in err and not out


def test_tiny_config_keeps_the_family_structure():
    """The rule's output for GPT-OSS (20B: 24 alternating sliding/full layers, 32 experts top-4, sinks): 2 layers of
    both types, 8 experts top-2, heads of 16 (its 64 scaled), a window of 8; DeepSeek-V3: its head parts in
    proportion (nope 128 : rope 64 : value 128 -> 16 : 8 : 16), 4 groups of 2 experts, 2 usable."""
    config = tiny_config("gpt_oss")
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.sliding_window == 8
    assert (config.num_local_experts, config.num_experts_per_tok, config.head_dim) == (8, 2, 16)
    deepseek = tiny_config("deepseek_v3")
    assert (deepseek.qk_nope_head_dim, deepseek.qk_rope_head_dim, deepseek.v_head_dim) == (16, 8, 16)
    assert (deepseek.n_group, deepseek.topk_group, deepseek.first_k_dense_replace) == (4, 2, 1)
    assert json.loads(config.to_json_string())["hidden_size"] == 64
