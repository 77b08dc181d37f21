"""Tiny random transformers configs for the HF tests, built in code (nothing downloaded): importable as
`hf_configs` from the tests/models workers. Dropout is off so every strategy can match one device exactly."""

from __future__ import annotations

import json
from pathlib import Path

COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 256, "attention_dropout": 0.0}
CONFIGS = {
    "llama": {"model_type": "llama", **COMMON},
    "qwen2": {"model_type": "qwen2", **COMMON, "tie_word_embeddings": False, "use_sliding_window": False},
    "mistral": {"model_type": "mistral", **COMMON, "num_key_value_heads": 2, "sliding_window": None},
    # GPT-2 ties its head to the token table
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 256,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0},
}


def write_config(root: Path, kind: str, **changes) -> Path:
    """A directory holding `kind`'s config.json (no weights: the model is built from the seed)."""
    folder = Path(root) / kind
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**CONFIGS[kind], **changes}))
    return folder


# Llama 3.2 1B/3B style: the head tied to the token table; 4 layers, so interleaved pp=2 x 2 stages per rank fits.
# Apart from CONFIGS (whose every kind the other HF tests sweep): only test_hf_verify.py's tied runs use it
TIED_LLAMA = "llama-tied"


def write_tied_llama(root: Path) -> Path:
    folder = Path(root) / TIED_LLAMA
    folder.mkdir(parents=True, exist_ok=True)
    doc = {**CONFIGS["llama"], "num_hidden_layers": 4, "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(doc))
    return folder
