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
