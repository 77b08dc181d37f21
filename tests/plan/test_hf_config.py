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
