"""`paratrain export` of a paratrain MoE preset (moe-tiny, ...): a MixtralForCausalLM directory.

Mixtral is the Hugging Face architecture that computes exactly what paratrain's MoE decoder does: Llama attention
(no q/k norms, which Qwen3-MoE and OLMoE add), every layer an MoE layer, a softmax router whose top-k gates are
renormalised, SwiGLU experts, no shared experts. A preset outside that (a sigmoid router, shared experts, dense
first layers, unnormalised gates, a router bias or a capacity factor) has no transformers architecture that gives
the same logits, and is refused in one line rather than written approximately.

The tensors are written as transformers' own save_pretrained writes a Mixtral (one weight per expert under
`block_sparse_moe`, which from_pretrained fuses again): paratrain's experts are (E, in, out) tensors, each
expert's linear weight the transpose of its slice.
"""

from __future__ import annotations

from paratrain.errors import UserError
from paratrain.interop.hf_format import HFTensor, hf_config, llama_tensors
from paratrain.models.args import ModelArgs


def check_mixtral_exportable(args: ModelArgs) -> None:
    odd = [what for what, bad in (
        ("a sigmoid router", args.router != "softmax"), ("shared experts", args.n_shared_experts > 0),
        ("dense first layers", args.n_dense_layers > 0), ("unnormalised top-k gates", not args.norm_topk),
        ("a router bias (bias_update_rate)", args.bias_update_rate > 0),
        ("a capacity factor", args.capacity_factor > 0)) if bad]
    if odd:
        raise UserError(f"{args.name} has {', '.join(odd)}: no Hugging Face architecture computes that MoE exactly "
                        "(export writes MoE presets as MixtralForCausalLM: softmax top-k, renormalised, every layer MoE)")


def mixtral_tensors(args: ModelArgs) -> list[HFTensor]:
    """Llama's attention, norms, embeddings and head; each layer's router and experts in Mixtral's saved names."""
    d, f = args.dim, args.expert_dim
    out = [t for t in llama_tensors(args) if ".mlp." not in t.name]
    for i in range(args.n_layers):
        s, t = f"layers.{i}.feed_forward.", f"model.layers.{i}.block_sparse_moe."
        out.append(HFTensor(t + "gate.weight", (s + "router.gate.weight",), (args.n_experts, d), lambda w: w,
                            _export_only))
        for e in range(args.n_experts):
            for hf_name, source, shape in (("w1", "experts.w1", (f, d)), ("w3", "experts.w3", (f, d)),
                                           ("w2", "experts.w2", (d, f))):
                out.append(HFTensor(f"{t}experts.{e}.{hf_name}.weight", (s + source,), shape,
                                    lambda w, e=e: w[e].t().contiguous(), _export_only))
    return out


def mixtral_config(args: ModelArgs, dtype: str = "fp32") -> dict:
    llama = hf_config(args, dtype)
    drop = ("architectures", "model_type", "intermediate_size", "mlp_bias", "attention_bias")
    return {**{k: v for k, v in llama.items() if k not in drop}, "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral", "intermediate_size": args.expert_dim, "num_local_experts": args.n_experts,
            "num_experts_per_tok": args.top_k, "router_aux_loss_coef": args.aux_loss_coeff,
            "output_router_logits": False, "router_jitter_noise": 0.0, "sliding_window": None,
            "attention_dropout": 0.0}


def _export_only(tensor):
    raise NotImplementedError("a Mixtral directory is not imported into a paratrain preset")
