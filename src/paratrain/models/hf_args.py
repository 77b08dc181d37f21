"""The shape of a Hugging Face causal LM as ModelArgs: what check_layout, FLOP counts and the planner read.

Read through transformers' own config class when it is installed (its attribute_map gives every architecture
the common names: hidden_size, num_hidden_layers, ...); gpt2, llama, mistral and qwen2 configs are also read
from the bare JSON, so `plan` works without the extra. MLP kind: gated (SwiGLU-like, three matrices) unless
the model type is in UNGATED, the GELU two-matrix MLP of GPT-2 and its kin.
"""

from __future__ import annotations

from dataclasses import replace

from paratrain.errors import UserError
from paratrain.models.head_dim import head_dim_of
from paratrain.models.hf_files import config_value
from paratrain.models.hf_model import hf_config_object
from paratrain.models.llama import ModelArgs

UNGATED = ("gpt2", "gpt_bigcode", "gpt_neox", "gptj", "opt", "phi", "falcon", "starcoder2", "bloom")


def _positive(value, key: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{where}: {key!r} must be a positive integer, got {value!r}")
    return value


def args_from_doc(doc: dict, name: str, seq_len: int | None = None) -> ModelArgs:
    """Any other architecture, through its transformers config class (hf_shape.py reads the common ones bare)."""
    config = hf_config_object(doc, name)
    kind = doc["model_type"]

    text = config.get_text_config()  # a config holding its text model's as a part (an assistant model's)

    def get(key: str, default=None):
        return config_value(text, key, default)

    dim = _positive(get("hidden_size"), "hidden_size", name)
    heads = _positive(get("num_attention_heads"), "num_attention_heads", name)
    kv = _positive(get("num_key_value_heads", heads), "num_key_value_heads", name)
    gated = kind not in UNGATED
    ffn = get("intermediate_size") or get("n_inner") or get("ffn_dim") or 4 * dim
    ffn = max(ffn) if isinstance(ffn, list) else ffn  # one per layer (Gemma 3n): the widest
    positions = get("max_position_embeddings") or get("n_positions") or 2048
    learned_positions = get("n_positions") is not None  # GPT-2 style: a table, no room beyond it
    if learned_positions and seq_len and seq_len > positions:
        raise UserError(f"{name}: --seq-len {seq_len} is longer than the model's {positions} learned positions")
    head_dim = head_dim_of(get("head_dim"), dim, heads, name) if gated else None
    if (not gated and dim % heads) or heads % kv:
        raise UserError(f"{name}: hidden_size {dim} / {heads} heads / {kv} kv heads do not divide")
    args = ModelArgs(name=name, family="llama" if gated else "gpt2",
                     vocab_size=_positive(get("vocab_size"), "vocab_size", name),
                     dim=dim, n_layers=_positive(get("num_hidden_layers"), "num_hidden_layers", name), n_heads=heads,
                     n_kv_heads=kv, attn_head_dim=head_dim, ffn_dim=_positive(int(ffn), "intermediate_size", name),
                     max_seq_len=max(int(positions), seq_len or 0),
                     tie_embeddings=bool(get("tie_word_embeddings", False)))
    return with_experts(args, config)


def counts_experts(config) -> bool:
    """Whether the config counts experts at all (a field naming experts, above 1): only then is the model built on
    the meta device to find its MoE layers (a second for a large config)."""
    def counts(doc: dict) -> bool:
        return any(counts(value) if isinstance(value, dict) else
                   "expert" in str(key) and isinstance(value, int) and not isinstance(value, bool) and value > 1
                   for key, value in doc.items())

    return counts(config.to_dict())  # sub-configs included (DBRX's ffn_config)


def with_experts(args: ModelArgs, config) -> ModelArgs:
    """`args` with the MoE fields of the model's own layers (models/hf_moe_layout.py, on the meta device): experts,
    top-k, each expert's hidden size and the shared ones' (from their parameter counts, three matrices each), the
    dense layers, the router's scores."""
    if not counts_experts(config):
        return args
    from paratrain.models.hf_model import meta_model
    from paratrain.models.hf_moe_layout import moe_layers

    layers = moe_layers(meta_model(config))
    if not layers:
        return args
    first = layers[0]
    expert_dim = max(1, round(first.expert_numel / (first.n_experts * 3 * args.dim)))
    return replace(args, n_experts=first.n_experts, top_k=first.top_k or 1, moe_ffn_dim=expert_dim,
                   n_shared_experts=round(first.shared_numel / (3 * args.dim * expert_dim)),
                   n_dense_layers=max(0, args.n_layers - len(layers)),
                   router="sigmoid" if first.router_scores == "sigmoid" else "softmax")
