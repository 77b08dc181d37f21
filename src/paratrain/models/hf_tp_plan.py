"""A transformers model's own tensor-parallel plan (`base_model_tp_plan`), translated to DTensor styles.

The model's config class names, per decoder-block module, "colwise" or "rowwise" (Megatron's recipe). We take
those entries as they are, then give every module the plan leaves out a layout, so that each parameter is a
DTensor on the tp mesh (foreach optimizers, grad clipping and FSDP's 2-D sharding need that): the token table
vocab-sharded, the head column-parallel (vocab-sharded logits under loss parallel), and norms whole
(ReplicateParallel) or, with sequence parallel, sharded on the sequence. Sequence parallel also makes each
row-parallel output a sequence-sharded DTensor and gathers the sequence back at each sub-layer's entry.

MoE layers (transformers 5's fused experts, found by their shape: models/hf_moe_layout.py): the plan's
"moe_tp_experts" module, with its "packed_colwise" gate_up_proj and "rowwise" down_proj, becomes
models/hf_moe.py's SplitExpertsOverTP (the experts split over the tp ranks by expert, each routed copy computed
once) and the router is kept whole (ReplicateRouter); a model whose plan leaves its experts out (GPT-OSS) gets the
same. A shared expert the plan leaves out (Qwen2-MoE's) is split as the plan splits the dense MLP (column-parallel
in, row-parallel out). Entries for modules a layer does not have (DeepSeek-V3's dense MLP entries on its MoE
layers) are written per layer, for the layers that have them.

Attention the plan leaves out (GPT-OSS, DeepSeek-V3's multi-head latent attention) is split by heads as the other
families' plans split it: the per-head projections (q/k/v, or MLA's q_b_proj and kv_b_proj) column-parallel, o_proj
row-parallel, the shared low-rank projections and their norms whole, and the module's own per-head tensors
(GPT-OSS's attention sinks) split with their heads (HeadSplitParams). A module that still holds parameters no
entry places is kept whole on every rank (without sequence parallel; with it, refused).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from paratrain.errors import UserError
from paratrain.models.hf_files import config_value
from paratrain.models.lora import ADAPTER_MODULES
from paratrain.models.tp_styles import ReplicateParallel, TiedColwiseParallel, VocabParallelEmbedding

# transformers' style names we translate; the first four split a linear (their parents gather the sequence under SP)
KNOWN_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce",
                "sequence_parallel", "moe_tp_experts", "mla_kv_a_proj")
# the experts module's own weights: SplitExpertsOverTP places them (translated with their module, not alone)
EXPERT_WEIGHT_STYLES = ("packed_colwise", "packed_rowwise", "rowwise")
# the token table's own entry: hf_tp_plan places the table itself (vocabulary-sharded, tied or not)
EMBEDDING_STYLES = ("embedding_rowwise", "embedding_colwise")
# attention the plan leaves out, split by heads (module docstring): transformers' own projection names
HEAD_SPLIT = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "q_b_proj": "colwise",
              "kv_a_proj_with_mqa": "mla_kv_a_proj", "kv_b_proj": "colwise", "o_proj": "rowwise"}


class GatherSequenceInput(ParallelStyle):
    """At a sub-layer's entry (attention, MLP) under SP: every sequence-sharded DTensor argument, positional or
    keyword, becomes Replicate (SP's all-gather), whatever the model's call convention."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def whole(x):
            if isinstance(x, DTensor) and any(p.is_shard() for p in x.placements):
                return x.redistribute(x.device_mesh, [Replicate()])
            return x

        def hook(_module, args, kwargs):
            return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class HeadShardedNorm(ParallelStyle):
    """transformers' "replicated_with_grad_allreduce": a norm kept whole on every rank but applied to this rank's
    attention heads (per-head q/k norms). Its input is read as Shard on the heads dimension (-2 of
    (batch, seq, heads, head_dim)), so DTensor sums the weight's gradient over the tp ranks, as the name asks."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def heads_of_this_rank(_module, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Shard(x.ndim - 2)], run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def local(_module, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, input_fn=heads_of_this_rank, output_fn=local)


def model_tp_plan(hf_model: nn.Module) -> dict[str, str]:
    """The config class's `base_model_tp_plan` (module path under the base model -> style name), or refuse."""
    plan = getattr(hf_model.config, "base_model_tp_plan", None) or getattr(type(hf_model.config), "base_model_tp_plan", None)
    if plan and not set(plan.values()) - set(EMBEDDING_STYLES):
        plan = {}  # only the token table named (GPT-OSS): the rest is found by shape (hf_tp_plan)
    elif not plan:
        raise UserError(f"{type(hf_model).__name__} has no tensor-parallel plan in transformers (base_model_tp_plan); "
                        "run it with a data-parallel strategy (ddp, zero1/2/3, hsdp), or cp/pp")
    experts = [path for path, style in plan.items() if style == "moe_tp_experts"]
    plan = {path: style for path, style in plan.items() if style not in EMBEDDING_STYLES and
            not any(path.startswith(e + ".") and style in EXPERT_WEIGHT_STYLES for e in experts)}
    odd = sorted({style for style in plan.values() if style not in KNOWN_STYLES})
    if odd:
        raise UserError(f"{type(hf_model).__name__}'s tensor-parallel plan uses {', '.join(odd)}, which paratrain does "
                        f"not translate (it handles {', '.join(KNOWN_STYLES)}); use a data-parallel strategy")
    return dict(plan)


class MlaKvAProj(ReplicateParallel):
    """transformers' "mla_kv_a_proj": multi-head latent attention's shared down-projection (the key/value latent,
    then the rotary key part every head reads) whole on every tp rank. The rotary part goes to the heads straight,
    not through the column-parallel kv_b_proj that sums its input's gradient over the ranks, so its gradient is
    summed here: each rank's heads give only part of it."""

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from paratrain.models.hf_moe import grad_summed_over

        module = super()._apply(module, device_mesh)
        rope = self.rope_dim

        def sum_rope_grads(_module, _inputs, out):
            return torch.cat([out[..., :-rope], grad_summed_over(out[..., -rope:], device_mesh)], dim=-1)

        module.register_forward_hook(sum_rope_grads)
        return module


def translate(style: str, sp: bool, config=None) -> ParallelStyle:
    if style == "mla_kv_a_proj":
        return MlaKvAProj(config.qk_rope_head_dim)
    if style == "colwise":
        return ColwiseParallel()
    if style == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    # SP: a row-parallel output is reduce-scattered over the sequence and stays a DTensor (global shapes)
    rowwise_out = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    if style == "rowwise":
        return RowwiseParallel(**rowwise_out)
    if style == "rowwise_split_input":
        return RowwiseParallel(input_layouts=Replicate(), **rowwise_out)
    if style == "sequence_parallel":
        return SequenceParallel() if sp else ReplicateParallel()
    if style == "moe_tp_experts":
        from paratrain.models.hf_moe import SplitExpertsOverTP

        return SplitExpertsOverTP()
    return HeadShardedNorm()  # replicated_with_grad_allreduce


def hf_tp_plan(model: nn.Module, tp: int, sp: bool = False, loss_parallel: bool = False) -> dict:
    """The whole plan for an HFCausalLM (keys relative to it: "hf.model.layers.*.self_attn.q_proj")."""
    hf = model.hf
    base = f"hf.{hf.base_model_prefix}." if getattr(hf, hf.base_model_prefix, None) is not None else "hf."
    named_paths = [name for name, _ in model.named_modules()]
    # only entries naming modules this model has (an MoE model's plan also lists the dense MLPs of mixed models)
    styles = {path: style for path, style in model_tp_plan(hf).items() if _covered_any(base + path, named_paths)}
    plan: dict = {}
    if sp:
        # the parents of the split linears ("layers.*.self_attn", "layers.*.mlp") gather the sequence on entry
        for parent in dict.fromkeys(path.rpartition(".")[0] for path, s in styles.items() if s in KNOWN_STYLES[:4]):
            plan[base + parent] = GatherSequenceInput()
    plan.update({base + path: translate(style, sp, hf.config) for path, style in styles.items()})
    plan.update(found_by_shape(model, plan, sp))
    named = {id(m): n for n, m in model.named_modules()}
    embedding, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    stream = Shard(1) if sp else Replicate()
    table = VocabParallelEmbedding if tied else RowwiseParallel
    plan[named[id(embedding)]] = table(input_layouts=Replicate(), output_layouts=stream, use_local_output=not sp)
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own or module is head or module is embedding or _covered(name, plan):
            continue
        if name.rsplit(".", 1)[-1] in ADAPTER_MODULES:  # LoRA's: placed with their base linear (models/lora_tp.py)
            continue
        if isinstance(module, nn.Embedding):  # e.g. learned positions: whole on every rank
            plan[_wildcard(name)] = ReplicateParallel()
            continue
        if _is_router(module, plan, name):  # an MoE layer's router, beside its split experts
            from paratrain.models.hf_moe import ReplicateRouter

            plan[_wildcard(name)] = ReplicateRouter()
            continue
        if not _is_norm(module):
            if sp:
                raise UserError(f"{type(hf).__name__}: module {name} ({type(module).__name__}) holds parameters its "
                                "tensor-parallel plan does not place; run tp without sequence parallelism (--no-sp)")
            plan[name] = ReplicateParallel()  # kept whole on every rank: its input is whole without SP
            continue
        # under SP only the norms on the residual stream see sequence-sharded input; one inside a sub-layer
        # (e.g. OLMo2's q/k norms after a gathered projection) sees whole tensors
        plan[_wildcard(name)] = SequenceParallel() if sp and _on_residual_stream(name) else ReplicateParallel()
    if head is not None:
        out = dict(input_layouts=stream, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                   use_local_output=not loss_parallel)
        plan[named[id(head)]] = TiedColwiseParallel(embedding, **out) if tied else ColwiseParallel(**out)
    return per_layer_where_mixed(model, plan)


def found_by_shape(model: nn.Module, plan: dict, sp: bool) -> dict:
    """Entries for what the model's own plan leaves out (module docstring): its MoE layers' experts and routers,
    and attention split by heads."""
    from paratrain.models.hf_moe import ReplicateRouter, SplitExpertsOverTP
    from paratrain.models.hf_moe_layout import moe_layers

    out: dict = {}
    for layer in moe_layers(model.hf):
        if not _covered(f"hf.{layer.experts}", plan) and layer.split_refusal() is None:
            out[f"hf.{layer.experts}"] = SplitExpertsOverTP()
            out[f"hf.{layer.router}"] = ReplicateRouter()
        out.update(shared_expert_split(model.hf, layer, plan, sp))
    heads = config_value(model.hf.config, "num_attention_heads")
    for name, module in model.named_modules():
        if not _is_attention(module) or any(_covered(f"{name}.{child}", plan) for child in HEAD_SPLIT):
            continue
        if sp:
            raise UserError(f"{type(model.hf).__name__}: its tensor-parallel plan leaves out {name} "
                            f"({type(module).__name__}); run tp without sequence parallelism (--no-sp)")
        for child, style in HEAD_SPLIT.items():
            if isinstance(getattr(module, child, None), nn.Linear):
                out[f"{name}.{child}"] = translate(style, sp, model.hf.config)
        for child_name, child in module.named_children():  # a norm per head (its size: the head's) sees split heads
            if _is_norm(child) and getattr(child, "weight", None) is not None and \
                    child.weight.shape[0] == getattr(module, "head_dim", None):
                out[f"{name}.{child_name}"] = HeadShardedNorm()
        if any(p.shape[:1] == (heads,) for p in module.parameters(recurse=False)):
            out[name] = HeadSplitParams(model)
    return out


def shared_expert_split(hf: nn.Module, layer, plan: dict, sp: bool) -> dict:
    """Entries for the shared experts of one MoE layer that the plan leaves out (Qwen2-MoE's, behind its own
    sigmoid gate), split as the model's own plan splits a dense MLP in the same place (`layers.*.mlp.gate_proj`
    colwise, ...): only where the plan names every linear of the shared expert and those hold all its parameters.
    The row-parallel output is summed over the tp ranks before the block uses it, so a gate after it (kept whole,
    like any module the plan leaves out) sees the whole output."""
    prefix = f"{hf.base_model_prefix}."
    block = _wildcard(layer.block.removeprefix(prefix))
    styles = {path[len(block) + 1:]: style for path, style in model_tp_plan(hf).items()
              if path.startswith(block + ".") and "." not in path[len(block) + 1:] and style in ("colwise", "rowwise")}
    modules, out = dict(hf.named_modules()), {}
    for shared in layer.shared_experts:
        linears = {name: child for name, child in modules[shared].named_children() if isinstance(child, nn.Linear)}
        held = sum(p.numel() for child in linears.values() for p in child.parameters())
        if not linears or not set(linears) <= set(styles) or held != sum(p.numel() for p in modules[shared].parameters()) \
                or any(_covered(f"hf.{shared}.{name}", plan) for name in linears):
            continue
        out.update({f"hf.{shared}.{name}": translate(styles[name], sp) for name in linears})
    return out


def _is_attention(module: nn.Module) -> bool:
    """A transformers attention module: an output projection behind per-head query projections."""
    return isinstance(getattr(module, "o_proj", None), nn.Linear) and \
        any(isinstance(getattr(module, q, None), nn.Linear) for q in ("q_proj", "q_b_proj"))


class HeadSplitParams(ParallelStyle):
    """An attention module's own per-head tensors (GPT-OSS's sinks, one per head) split with its heads (Shard(0));
    the model's attention function then reads them through a view that hands it their local part, as the
    head-split projections hand it local heads (models/hf_attention_impl.py)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import distribute_tensor

        from paratrain.models.hf_attention_impl import local_params_attention

        heads = config_value(module.config, "num_attention_heads")
        for name, p in list(module.named_parameters(recurse=False)):
            placement = [Shard(0)] if p.shape[:1] == (heads,) else [Replicate()]
            module.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), device_mesh, placement),
                                                         requires_grad=p.requires_grad))
        self.model.use_attention(local_params_attention(self.model.attention), documents=False)
        return module


def per_layer_where_mixed(model: nn.Module, plan: dict) -> dict:
    """Wildcard entries that match in some decoder layers only (a dense MLP's entries beside MoE layers) written
    out per layer, so that parallelize_module never looks for a module a layer does not have."""
    names = [name for name, _ in model.named_modules()]
    out: dict = {}
    for key, style in plan.items():
        first = key.find("*")
        if first < 0:
            out[key] = style
            continue
        matched = [n for n in names if _covered(n, {key: None})]
        holders = [n for n in names if _covered(n, {key[:first + 1]: None})]
        if len({n.split(".")[key[:first].count(".")] for n in matched}) == len(holders):
            out[key] = style
        else:
            out.update(dict.fromkeys(matched, style))
    return out


def _covered(name: str, plan: dict) -> bool:
    from fnmatch import fnmatch

    parts = name.split(".")
    return any(len(k.split(".")) == len(parts) and all(fnmatch(a, b) for a, b in zip(parts, k.split(".")))
               for k in plan)


def _covered_any(path: str, names: list[str]) -> bool:
    return any(_covered(name, {path: None}) for name in names)


def _is_router(module: nn.Module, plan: dict, name: str) -> bool:
    """A module with top_k beside an experts module the plan splits (the block's `gate` in transformers 5)."""
    parent = name.rpartition(".")[0]
    return hasattr(module, "top_k") and _covered(parent + ".experts", plan)


def _wildcard(name: str) -> str:
    """hf.model.layers.3.input_layernorm -> hf.model.layers.*.input_layernorm (one entry for all blocks)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _on_residual_stream(name: str) -> bool:
    """A block's own norm (…layers.3.input_layernorm) or one outside the blocks (…norm), not one nested deeper."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return index is None or len(parts) - index == 2


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or "norm" in type(module).__name__.lower()
