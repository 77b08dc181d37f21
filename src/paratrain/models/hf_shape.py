"""A Hugging Face config.json (already read, as data) -> ModelArgs: the one parser, for train and plan alike.

gpt2, llama, mistral and qwen2 configs are read from the bare JSON (no transformers, no torch: a plan answered
from the trace cache imports neither); any other decoder-only causal LM goes through transformers' own config
class (hf_args.py), whose attribute_map gives every architecture the common names.
"""

from __future__ import annotations

from paratrain.errors import UserError
from paratrain.models.args import ModelArgs
from paratrain.models.hf_files import read_hf_config

LLAMA_TYPES = ("llama", "mistral", "qwen2")  # qwen2: + q/k/v biases, a rounding error in the count
LLAMA_NORM_EPS = 1e-6  # what transformers' Llama, Mistral and Qwen2 configs assume when rms_norm_eps is absent


def _rope_theta(doc: dict) -> float:
    """rope_theta at the top level (transformers 4) or inside rope_parameters (transformers 5)."""
    nested = doc.get("rope_parameters") if isinstance(doc.get("rope_parameters"), dict) else {}
    return float(doc.get("rope_theta") or nested.get("rope_theta") or 10000.0)


def _need(doc: dict, key: str, where: str):
    if key not in doc or doc[key] is None:
        raise UserError(f"{where}: a {doc.get('model_type')} config needs {key!r}")
    value = doc[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{where}: {key!r} must be a positive integer, got {value!r}")
    return value


def args_from_hf_config(doc: dict, where: str = "config.json", name: str | None = None,
                        seq_len: int | None = None) -> ModelArgs:
    """ModelArgs of a config document. `name`: what the model is called (default: the config's own
    _name_or_path, else `where`); `seq_len`: room for that many positions (refused past GPT-2's learned table)."""
    kind = doc.get("model_type")
    name = name or str(doc.get("_name_or_path") or where)
    if kind == "gpt2":
        dim = _need(doc, "n_embd", where)
        inner = doc.get("n_inner")
        positions = _need(doc, "n_positions", where)
        if seq_len and seq_len > positions:
            raise UserError(f"{name}: --seq-len {seq_len} is longer than the model's {positions} learned positions")
        return ModelArgs(name=name, family="gpt2", vocab_size=_need(doc, "vocab_size", where), dim=dim,
                         n_layers=_need(doc, "n_layer", where), n_heads=_need(doc, "n_head", where),
                         ffn_dim=int(inner) if inner else 4 * dim, max_seq_len=positions,
                         norm_eps=float(doc.get("layer_norm_epsilon", 1e-5)),
                         tie_embeddings=bool(doc.get("tie_word_embeddings", True)))
    if kind in LLAMA_TYPES:
        heads = _need(doc, "num_attention_heads", where)
        kv = doc.get("num_key_value_heads") or heads
        positions = int(doc.get("max_position_embeddings") or 4096)
        args = ModelArgs(name=name, family="llama", vocab_size=_need(doc, "vocab_size", where),
                         dim=_need(doc, "hidden_size", where), n_layers=_need(doc, "num_hidden_layers", where),
                         n_heads=heads, n_kv_heads=int(kv), ffn_dim=_need(doc, "intermediate_size", where),
                         max_seq_len=max(positions, seq_len or 0),
                         norm_eps=float(doc.get("rms_norm_eps", LLAMA_NORM_EPS)), rope_theta=_rope_theta(doc),
                         tie_embeddings=bool(doc.get("tie_word_embeddings", False)))
        if args.dim % heads or heads % args.kv_heads:
            raise UserError(f"{where}: hidden_size {args.dim} / {heads} heads / {args.kv_heads} kv heads do not divide")
        return args
    from paratrain.models.hf_args import args_from_doc  # transformers' config classes: imported only here

    return args_from_doc(doc, name, seq_len)


def hf_model_args(spec: str, seq_len: int | None = None) -> ModelArgs:
    """ModelArgs of `hf:PATH` (its name is the spec), with room for `seq_len`."""
    return args_from_hf_config(read_hf_config(spec), spec, name=spec, seq_len=seq_len)
