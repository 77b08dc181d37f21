"""A Hugging Face config.json (already read, as data) -> ModelArgs: the one parser, for train and plan alike.

gpt2, llama, mistral and qwen2 configs, and six MoE families (MOE_TYPES), are read from the bare JSON (no
transformers, no torch: a plan answered from the trace cache imports neither); any other decoder-only causal LM
goes through transformers' own config class (hf_args.py), whose attribute_map gives every architecture the common
names, and whose MoE layers are found by their shape on the meta device (models/hf_moe_layout.py).
"""

from __future__ import annotations

from paratrain.errors import UserError
from paratrain.models.args import ModelArgs
from paratrain.models.head_dim import head_dim_of
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
        dim = _need(doc, "hidden_size", where)
        args = ModelArgs(name=name, family="llama", vocab_size=_need(doc, "vocab_size", where),
                         dim=dim, n_layers=_need(doc, "num_hidden_layers", where),
                         n_heads=heads, n_kv_heads=int(kv), attn_head_dim=head_dim_of(doc.get("head_dim"), dim, heads, where),
                         ffn_dim=_need(doc, "intermediate_size", where),
                         max_seq_len=max(positions, seq_len or 0),
                         norm_eps=float(doc.get("rms_norm_eps", LLAMA_NORM_EPS)), rope_theta=_rope_theta(doc),
                         tie_embeddings=bool(doc.get("tie_word_embeddings", False)))
        if heads % args.kv_heads:
            raise UserError(f"{where}: {heads} heads / {args.kv_heads} kv heads do not divide")
        return args
    if kind in MOE_TYPES:
        return moe_args_from_hf_config(doc, where, name, seq_len)
    from paratrain.models.hf_args import args_from_doc  # transformers' config classes: imported only here

    return args_from_doc(doc, name, seq_len)


# model_type -> (experts key, expert hidden size key, router): the MoE fields of the families read without
# transformers (the planner's fast path); the runtime finds every family's experts by their shape
MOE_TYPES = {"qwen3_moe": ("num_experts", "moe_intermediate_size", "softmax"),
             "mixtral": ("num_local_experts", "intermediate_size", "softmax"),
             "olmoe": ("num_experts", "intermediate_size", "softmax"),
             "deepseek_v3": ("n_routed_experts", "moe_intermediate_size", "sigmoid"),
             "gpt_oss": ("num_local_experts", "intermediate_size", "softmax"),
             "glm4_moe": ("n_routed_experts", "moe_intermediate_size", "sigmoid")}


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _mla_head_dim(doc: dict, heads: int, kv: int, dim: int) -> int:
    """DeepSeek's multi-head latent attention as grouped-query attention of (about) its parameters: the head
    size whose q, k, v and o projections hold as many weights as MLA's low-rank ones."""
    q_head = int(doc.get("qk_nope_head_dim", 128)) + int(doc.get("qk_rope_head_dim", 64))
    q_rank, kv_rank, v_head = int(doc.get("q_lora_rank") or 0), int(doc.get("kv_lora_rank", 512)), \
        int(doc.get("v_head_dim", 128))
    q = dim * q_rank + q_rank * heads * q_head if q_rank else dim * heads * q_head
    kv_params = dim * (kv_rank + int(doc.get("qk_rope_head_dim", 64))) + \
        kv_rank * heads * (int(doc.get("qk_nope_head_dim", 128)) + v_head)
    o = heads * v_head * dim
    return max(2, round((q + kv_params + o) / (2 * dim * (heads + kv)) / 2) * 2)


def _qwen3_moe_dense_layers(doc: dict, layers: int) -> int:
    """Qwen3-MoE's dense layers: those in mlp_only_layers and those off its decoder_sparse_step."""
    step = int(doc.get("decoder_sparse_step") or 1)
    only = set(doc.get("mlp_only_layers") or ())
    return sum(1 for i in range(layers) if i in only or (i + 1) % step)


def moe_args_from_hf_config(doc: dict, where: str, name: str, seq_len: int | None) -> ModelArgs:
    """Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, GPT-OSS and GLM-4.5 configs: the attention of a Llama, MoE
    feed-forwards (GPT-OSS's attention sinks and biases and GLM's q/k/v biases left out: under 0.1% of either)."""
    kind = doc["model_type"]
    experts_key, hidden_key, router = MOE_TYPES[kind]
    heads = _need(doc, "num_attention_heads", where)
    kv = int(doc.get("num_key_value_heads") or heads)
    dim = _need(doc, "hidden_size", where)
    if kind == "deepseek_v3":
        head_dim = _mla_head_dim(doc, heads, kv, dim)
        head_dim = None if head_dim * heads == dim else head_dim
    else:
        head_dim = head_dim_of(doc.get("head_dim"), dim, heads, where)
    dense_layers = int(doc.get("first_k_dense_replace", 0) or 0)
    if kind == "qwen3_moe":  # dense layers between MoE ones: counted (the runtime finds each layer's own kind)
        dense_layers = _qwen3_moe_dense_layers(doc, _need(doc, "num_hidden_layers", where))
    # transformers 5 writes some families' expert count under another name (qwen3_moe: num_local_experts)
    experts_key = next((k for k in (experts_key, *EXPERT_COUNT_KEYS) if doc.get(k) is not None), experts_key)
    expert_dim = _need(doc, hidden_key, where)
    args = ModelArgs(name=name, family="llama", vocab_size=_need(doc, "vocab_size", where), dim=dim,
                     n_layers=_need(doc, "num_hidden_layers", where), n_heads=heads, n_kv_heads=kv,
                     attn_head_dim=head_dim,
                     ffn_dim=int(doc.get("intermediate_size") or expert_dim), moe_ffn_dim=expert_dim,
                     max_seq_len=max(int(doc.get("max_position_embeddings") or 4096), seq_len or 0),
                     norm_eps=float(doc.get("rms_norm_eps", LLAMA_NORM_EPS)), rope_theta=_rope_theta(doc),
                     tie_embeddings=bool(doc.get("tie_word_embeddings", False)),
                     n_experts=_need(doc, experts_key, where), top_k=_need(doc, "num_experts_per_tok", where),
                     n_shared_experts=int(doc.get("n_shared_experts") or 0), n_dense_layers=dense_layers,
                     router=router, norm_topk=bool(doc.get("norm_topk_prob", kind != "olmoe")),
                     aux_loss_coeff=float(doc.get("router_aux_loss_coef", 0.01) or 0.0))
    if heads % kv:
        raise UserError(f"{where}: {heads} heads / {kv} kv heads do not divide")
    return args


def hf_model_args(spec: str, seq_len: int | None = None) -> ModelArgs:
    """ModelArgs of `hf:PATH` (its name is the spec), with room for `seq_len`."""
    return args_from_hf_config(read_hf_config(spec), spec, name=spec, seq_len=seq_len)
