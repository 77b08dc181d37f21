"""--hf-config: GPT-2 and Llama configs become ModelArgs the planner traces (and paratrain can build)."""

from __future__ import annotations

import json

import pytest

from paratrain.errors import UserError
from paratrain.models.hf_shape import args_from_hf_config
from paratrain.models.presets import build_model, count_params
from paratrain.plan.inputs.hf_config import load_hf_config

GPT2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None, "vocab_size": 50257,
        "n_positions": 1024}
LLAMA = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
         "rope_theta": 500000.0}


def test_gpt2_config():
    args = args_from_hf_config(GPT2)
    assert args.family == "gpt2" and args.ffn_dim == 4 * 768 and args.tie_embeddings
    assert count_params(args) == 124_439_808  # GPT-2 small


def test_llama_config_with_grouped_query_heads():
    args = args_from_hf_config(LLAMA)
    assert (args.family, args.kv_heads, args.ffn_dim, args.rope_theta) == ("llama", 8, 14336, 500000.0)
    model = build_model(args, "meta", seed=None)
    assert sum(p.numel() for p in model.parameters()) == count_params(args)


def test_load_from_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2))
    assert load_hf_config(path).n_layers == 12


@pytest.mark.parametrize("doc", [{"model_type": "bert"}, {"model_type": "gpt2", "n_layer": 2}, [1, 2]])
def test_bad_configs(tmp_path, doc):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError):
        load_hf_config(path)


def test_train_and_plan_read_one_config_alike(tmp_path):
    """One parser (models/hf_shape.py): the trainer's hf: args equal the planner's, with transformers' defaults
    for what the file leaves out, and transformers 5's nested rope_parameters read."""
    from paratrain.models.hf_shape import hf_model_args

    doc = {k: v for k, v in LLAMA.items() if k != "rope_theta"} | {"rope_parameters": {"rope_theta": 250000.0}}
    (tmp_path / "config.json").write_text(json.dumps(doc))
    trained, planned = hf_model_args(f"hf:{tmp_path}"), load_hf_config(tmp_path)
    assert trained.norm_eps == planned.norm_eps == 1e-6 and trained.rope_theta == planned.rope_theta == 250000.0
    assert (trained.dim, trained.n_layers, trained.kv_heads, trained.ffn_dim) == \
        (planned.dim, planned.n_layers, planned.kv_heads, planned.ffn_dim)


def meta_count(model_class, config) -> int:
    """transformers' own parameter count of `config`, built on the meta device (nothing allocated)."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in model_class(config).parameters())


def test_head_dim_sets_the_attention_width_as_transformers_builds_it():
    """A config's head_dim (query width = heads x head_dim, here twice hidden_size) counts as transformers builds
    it: a Llama (read from the bare JSON) exactly; a Qwen3 (through its config class) but for its q/k norms."""
    import transformers

    llama = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 2,
             "num_attention_heads": 8, "head_dim": 128, "num_key_value_heads": 2, "vocab_size": 1000}
    args = args_from_hf_config(llama)
    assert args.head_dim == 128
    expected = meta_count(transformers.LlamaForCausalLM, transformers.LlamaConfig(**llama))
    assert count_params(args) == expected
    assert sum(p.numel() for p in build_model(args, "meta", seed=None).parameters()) == expected
    qwen3 = {**llama, "model_type": "qwen3", "tie_word_embeddings": True}
    args = args_from_hf_config(qwen3)
    norms = 2 * 128 * 2  # q_norm and k_norm per layer (Qwen3), which paratrain's Llama has not
    assert count_params(args) + norms == meta_count(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**qwen3))


@pytest.mark.parametrize("doc,refused", [
    ({**LLAMA, "hidden_size": 64, "num_attention_heads": 96, "num_key_value_heads": 96},
     "hidden_size 64 is narrower than its 96 heads and the config gives no head_dim"),
    ({**LLAMA, "head_dim": 45}, "heads of 45 (head_dim) must have an even size for rotary positions"),
    ({**LLAMA, "num_key_value_heads": 5}, "32 heads / 5 kv heads do not divide"),
])
def test_head_counts_that_cannot_build_are_one_line(doc, refused):
    with pytest.raises(UserError) as err:
        args_from_hf_config(doc)
    assert str(err.value) == f"config.json: {refused}"


def test_gpt_oss_and_glm45_shapes_plan_with_their_real_attention_widths(tmp_path, cli_inproc):
    """GPT-OSS-20B (64 heads of 64 on a 2880-wide residual) and GLM-4.5 (96 heads of 128 on 5120) in their own
    config classes: each plans, its total against transformers' meta-device count (GPT-OSS's attention sinks and
    biases, which the planner leaves out, are 0.03% of it)."""
    import transformers

    configs = {
        "gpt_oss": (transformers.GptOssConfig(
            hidden_size=2880, num_attention_heads=64, head_dim=64, num_key_value_heads=8, num_hidden_layers=24,
            num_local_experts=32, num_experts_per_tok=4, intermediate_size=2880, vocab_size=201088,
            layer_types=["sliding_attention", "full_attention"] * 12), 32, 5e-4),
        "glm4_moe": (transformers.Glm4MoeConfig(
            hidden_size=5120, num_attention_heads=96, head_dim=128, num_key_value_heads=8, num_hidden_layers=92,
            intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160, n_shared_experts=1,
            num_experts_per_tok=8, first_k_dense_replace=3, vocab_size=151552), 160, 0.0),
    }
    for kind, (config, experts, tolerance) in configs.items():
        config.save_pretrained(tmp_path / kind)
        res = cli_inproc("plan", "--hf-config", str(tmp_path / kind), "--gpu", "h100-sxm", "--gpus", "64",
                         "--seq-len", "4096", "--global-batch", "64", "--top", "1", "--json")
        assert res.returncode == 0, res.stderr
        plan = json.loads(res.stdout)
        assert plan["candidates"] and plan["model"]["experts"] == experts, plan["model"]
        expected = meta_count(transformers.AutoModelForCausalLM.from_config, config)
        assert abs(plan["model"]["params"] / expected - 1) <= tolerance, (kind, plan["model"]["params"], expected)
