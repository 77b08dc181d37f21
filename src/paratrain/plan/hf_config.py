"""Read a Hugging Face `config.json` into ModelArgs (plan --hf-config FILE|DIR, plan --model hf:PATH).

gpt2, llama, mistral and qwen2 configs are read from the bare JSON (no transformers needed); any other
decoder-only causal LM transformers ships is read through its own config class (models/hf_args.py). Only the
shape is read, as data (json), never code; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from paratrain.errors import UserError, read_json_file
from paratrain.models.args import ModelArgs

LLAMA_TYPES = ("llama", "mistral", "qwen2")  # qwen2: + q/k/v biases, a rounding error in the count


def _need(doc: dict, key: str, path: str):
    if key not in doc or doc[key] is None:
        raise UserError(f"{path}: a {doc.get('model_type')} config needs {key!r}")
    value = doc[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{path}: {key!r} must be a positive integer, got {value!r}")
    return value


def args_from_hf_config(doc: dict, path: str = "config.json") -> ModelArgs:
    kind = doc.get("model_type")
    # the model's own name when the config records it; else the file (a folder's name is no model name: a
    # config in /tmp would be called "tmp")
    name = str(doc.get("_name_or_path") or path)
    if kind == "gpt2":
        dim = _need(doc, "n_embd", path)
        inner = doc.get("n_inner")
        return ModelArgs(name=name, family="gpt2", vocab_size=_need(doc, "vocab_size", path), dim=dim,
                         n_layers=_need(doc, "n_layer", path), n_heads=_need(doc, "n_head", path),
                         ffn_dim=int(inner) if inner else 4 * dim, max_seq_len=_need(doc, "n_positions", path),
                         norm_eps=float(doc.get("layer_norm_epsilon", 1e-5)),
                         tie_embeddings=bool(doc.get("tie_word_embeddings", True)))
    if kind in LLAMA_TYPES:
        heads = _need(doc, "num_attention_heads", path)
        kv = doc.get("num_key_value_heads") or heads
        args = ModelArgs(name=name, family="llama", vocab_size=_need(doc, "vocab_size", path),
                         dim=_need(doc, "hidden_size", path), n_layers=_need(doc, "num_hidden_layers", path),
                         n_heads=heads, n_kv_heads=int(kv), ffn_dim=_need(doc, "intermediate_size", path),
                         max_seq_len=int(doc.get("max_position_embeddings") or 4096),
                         norm_eps=float(doc.get("rms_norm_eps", 1e-5)), rope_theta=float(doc.get("rope_theta", 10000.0)))
        if args.dim % heads or heads % args.kv_heads:
            raise UserError(f"{path}: hidden_size {args.dim} / {heads} heads / {args.kv_heads} kv heads do not divide")
        return args
    from paratrain.models.hf_args import args_from_doc

    return args_from_doc(doc, name)


def load_hf_config(path: str | Path) -> ModelArgs:
    """A config.json file, a directory holding one, or `hf:PATH`."""
    from paratrain.models.hf_files import hf_location, read_hf_config

    config_path, _ = hf_location(str(path))
    doc = read_json_file(config_path, "--hf-config")
    if not isinstance(doc, dict):
        raise UserError(f"--hf-config {path} must hold a JSON object")
    if doc.get("model_type") in ("gpt2", *LLAMA_TYPES):
        return args_from_hf_config(doc, str(path))
    read_hf_config(str(path))  # refuses remote code and configs without a model_type
    return args_from_hf_config(doc, str(path))


def plans_hf_model(model: str | None) -> bool:
    """`plan --model hf:PATH` names a transformers model rather than a preset."""
    from paratrain.models.hf_files import is_hf_model

    return is_hf_model(model)
