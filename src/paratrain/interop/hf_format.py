"""The Hugging Face layout of paratrain's model families: config.json and a table of tensors.

One table drives export, import and the shape checks. Each HF tensor names the paratrain tensors it is
built from, with a function each way:
- Llama family -> `LlamaForCausalLM`. paratrain's RoPE rotates interleaved pairs (2i, 2i+1) of each head;
  HF's `rotate_half` rotates (i, i + d/2). So q_proj / k_proj rows are permuted per head on export (and back on
  import). q.k is unchanged when q and k get the same permutation, so the logits are identical.
- GPT-2 family -> `GPT2LMHeadModel`. HF's Conv1D stores weights as (in, out), the transpose of nn.Linear;
  q, k and v are fused into c_attn (weights and biases; paratrain keeps GPT-2's key bias, frozen: softmax
  cancels it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from paratrain.errors import UserError
from paratrain.models.llama import ModelArgs


@dataclass(frozen=True)
class HFTensor:
    name: str  # the HF state-dict key
    sources: tuple[str, ...]  # paratrain FQNs it is built from
    shape: tuple[int, ...]
    build: Callable[..., torch.Tensor]  # *source tensors -> HF tensor
    split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # HF tensor -> source tensors


def _same(name: str, source: str, shape: tuple[int, ...]) -> HFTensor:
    return HFTensor(name, (source,), shape, lambda t: t, lambda t: (t,))


def renamed(name: str, source: str, shape: tuple[int, ...]) -> HFTensor:
    """A tensor written as it is, under another name (a transformers model's own, or a custom model's)."""
    return _same(name, source, shape)


def _transposed(name: str, source: str, out_in: tuple[int, int]) -> HFTensor:
    """An nn.Linear weight (out, in) stored as HF Conv1D (in, out)."""
    return HFTensor(name, (source,), (out_in[1], out_in[0]), lambda t: t.t().contiguous(),
                    lambda t: (t.t().contiguous(),))


def rope_to_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k projection rows: interleaved rotary pairs (paratrain) -> rotate_half halves (HF)."""
    head_dim = w.shape[0] // heads
    return w.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


def rope_to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    head_dim = w.shape[0] // heads
    return w.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


def _rope(name: str, source: str, heads: int, shape: tuple[int, int]) -> HFTensor:
    return HFTensor(name, (source,), shape, lambda t: rope_to_half(t, heads),
                    lambda t: (rope_to_interleaved(t, heads),))


def llama_tensors(a: ModelArgs) -> list[HFTensor]:
    d, hd, f = a.dim, a.head_dim, a.ffn_dim
    out = [_same("model.embed_tokens.weight", "tok_embeddings.weight", (a.vocab_size, d))]
    for i in range(a.n_layers):
        s, t = f"layers.{i}.", f"model.layers.{i}."
        out += [
            _same(t + "input_layernorm.weight", s + "attention_norm.weight", (d,)),
            _rope(t + "self_attn.q_proj.weight", s + "attention.wq.weight", a.n_heads, (a.n_heads * hd, d)),
            _rope(t + "self_attn.k_proj.weight", s + "attention.wk.weight", a.kv_heads, (a.kv_heads * hd, d)),
            _same(t + "self_attn.v_proj.weight", s + "attention.wv.weight", (a.kv_heads * hd, d)),
            _same(t + "self_attn.o_proj.weight", s + "attention.wo.weight", (d, a.n_heads * hd)),
            _same(t + "post_attention_layernorm.weight", s + "ffn_norm.weight", (d,)),
            _same(t + "mlp.gate_proj.weight", s + "feed_forward.w1.weight", (f, d)),
            _same(t + "mlp.up_proj.weight", s + "feed_forward.w3.weight", (f, d)),
            _same(t + "mlp.down_proj.weight", s + "feed_forward.w2.weight", (d, f)),
        ]
    out += [_same("model.norm.weight", "norm.weight", (d,)),
            _same("lm_head.weight", "output.weight", (a.vocab_size, d))]
    return out


def gpt2_tensors(a: ModelArgs) -> list[HFTensor]:
    d, f = a.dim, a.ffn_dim
    out = [_same("transformer.wte.weight", "tok_embeddings.tokens.weight", (a.vocab_size, d)),
           _same("transformer.wpe.weight", "tok_embeddings.positions.weight", (a.max_seq_len, d))]
    for i in range(a.n_layers):
        s, t = f"layers.{i}.", f"transformer.h.{i}."
        out += [
            _same(t + "ln_1.weight", s + "attention_norm.weight", (d,)),
            _same(t + "ln_1.bias", s + "attention_norm.bias", (d,)),
            HFTensor(t + "attn.c_attn.weight",
                     (s + "attention.wq.weight", s + "attention.wk.weight", s + "attention.wv.weight"), (d, 3 * d),
                     lambda q, k, v: torch.cat([q, k, v]).t().contiguous(),
                     lambda w: tuple(p.contiguous() for p in w.t().split(d))),
            HFTensor(t + "attn.c_attn.bias", (s + "attention.wq.bias", s + "attention.wk.bias",
                                              s + "attention.wv.bias"), (3 * d,),
                     lambda q, k, v: torch.cat([q, k, v]), lambda b: tuple(p.contiguous() for p in b.split(d))),
            _transposed(t + "attn.c_proj.weight", s + "attention.wo.weight", (d, d)),
            _same(t + "attn.c_proj.bias", s + "attention.wo.bias", (d,)),
            _same(t + "ln_2.weight", s + "ffn_norm.weight", (d,)),
            _same(t + "ln_2.bias", s + "ffn_norm.bias", (d,)),
            _transposed(t + "mlp.c_fc.weight", s + "feed_forward.w1.weight", (f, d)),
            _same(t + "mlp.c_fc.bias", s + "feed_forward.w1.bias", (f,)),
            _transposed(t + "mlp.c_proj.weight", s + "feed_forward.w2.weight", (d, f)),
            _same(t + "mlp.c_proj.bias", s + "feed_forward.w2.bias", (d,)),
        ]
    out += [_same("transformer.ln_f.weight", "norm.weight", (d,)),
            _same("transformer.ln_f.bias", "norm.bias", (d,))]
    if not a.tie_embeddings:  # tied: HF ties lm_head to wte itself
        out.append(_same("lm_head.weight", "output.weight", (a.vocab_size, d)))
    return out


def hf_tensors(args: ModelArgs) -> list[HFTensor]:
    return gpt2_tensors(args) if args.family == "gpt2" else llama_tensors(args)


TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def hf_config(args: ModelArgs, dtype: str = "fp32") -> dict:
    """config.json for transformers (LlamaForCausalLM or GPT2LMHeadModel), plus our own args under "paratrain"."""
    common = {"vocab_size": args.vocab_size, "torch_dtype": TORCH_DTYPE_NAMES[dtype], "bos_token_id": None,
              "eos_token_id": None, "pad_token_id": None, "use_cache": True, "paratrain": args.to_dict()}
    if args.family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": args.dim,
                "n_layer": args.n_layers, "n_head": args.n_heads, "n_inner": args.ffn_dim,
                "n_positions": args.max_seq_len, "layer_norm_epsilon": args.norm_eps,
                "activation_function": "gelu_new", "tie_word_embeddings": args.tie_embeddings,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **common}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
            "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
            "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "initializer_range": 0.02, **common}


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if params.get("rope_type", "default") != "default":
        raise UserError(f"RoPE scaling {params.get('rope_type')!r} is not supported by paratrain's Llama model")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def model_shape_from_config(cfg: dict) -> dict:
    """The fields of ModelArgs that a HF config.json fixes (family, shapes, eps, rope theta)."""
    kind = cfg.get("model_type")
    if kind == "llama":
        heads = int(cfg["num_attention_heads"])
        if cfg.get("head_dim") not in (None, int(cfg["hidden_size"]) // heads):
            raise UserError(f"head_dim {cfg['head_dim']} != hidden_size / num_attention_heads is not supported")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise UserError("Llama configs with attention_bias or mlp_bias are not supported")
        return {"family": "llama", "vocab_size": int(cfg["vocab_size"]), "dim": int(cfg["hidden_size"]),
                "n_layers": int(cfg["num_hidden_layers"]), "n_heads": heads,
                "kv_heads": int(cfg.get("num_key_value_heads") or heads), "ffn_dim": int(cfg["intermediate_size"]),
                "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)), "rope_theta": _rope_theta(cfg)}
    if kind == "gpt2":
        dim = int(cfg["n_embd"])
        return {"family": "gpt2", "vocab_size": int(cfg["vocab_size"]), "dim": dim, "n_layers": int(cfg["n_layer"]),
                "n_heads": int(cfg["n_head"]), "ffn_dim": int(cfg.get("n_inner") or 4 * dim),
                "norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5)),
                "tie_embeddings": bool(cfg.get("tie_word_embeddings", True))}
    raise UserError(f"model_type {kind!r} is not supported (llama or gpt2)")


def model_shape(args: ModelArgs) -> dict:
    shape = {"family": args.family, "vocab_size": args.vocab_size, "dim": args.dim, "n_layers": args.n_layers,
             "n_heads": args.n_heads, "ffn_dim": args.ffn_dim, "norm_eps": args.norm_eps}
    if args.family == "gpt2":
        return {**shape, "tie_embeddings": args.tie_embeddings}
    return {**shape, "kv_heads": args.kv_heads, "rope_theta": args.rope_theta}
