"""Tensor-parallel plans: each model family's sharding as a dict of module path -> DTensor ParallelStyle.

Read a plan as Megatron's recipe: column-parallel in, row-parallel out, so a block needs one reduction per
sub-layer. With sequence parallel (SP) the activations between sub-layers stay sharded on the sequence.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from paratrain.errors import UserError
from paratrain.models.llama import Transformer
from paratrain.models.tp_styles import ReplicateParallel, TiedColwiseParallel, VocabParallelEmbedding


def block_plan(sp: bool, attention_extra_args: int = 2, gated_mlp: bool = True) -> dict:
    """One decoder block. Its residual stream is Replicate (plain TP) or Shard(1) on the sequence (SP).

    attention_extra_args: plain tensors the attention takes after x (Llama's RoPE cos/sin), left untouched.
    """
    stream = Shard(1) if sp else Replicate()
    extra = (None,) * attention_extra_args
    plan = {
        # one layout change per sub-layer input: Shard(1) -> Replicate is SP's all-gather
        "attention": PrepareModuleInput(input_layouts=(stream, *extra), desired_input_layouts=(Replicate(), *extra)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        # SP keeps the residual a DTensor so that x.shape (and the model's RoPE length) stays global
        "attention.wo": RowwiseParallel(output_layouts=stream, use_local_output=not sp),
        "feed_forward": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=stream, use_local_output=not sp),
    }
    if gated_mlp:
        plan["feed_forward.w3"] = ColwiseParallel()
    # norms: sequence-sharded under SP; otherwise whole, but as DTensors like every other parameter
    norm_style = SequenceParallel if sp else ReplicateParallel
    plan["attention_norm"] = norm_style()
    plan["ffn_norm"] = norm_style()
    return plan


def head_plan(sp: bool, loss_parallel: bool) -> dict:
    """Final norm and output projection."""
    stream = Shard(1) if sp else Replicate()
    # loss parallel keeps the logits vocab-sharded; the loss must then run under loss_parallel()
    return {"norm": SequenceParallel() if sp else ReplicateParallel(),
            "output": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                      use_local_output=not loss_parallel)}


def stage_edge_plan(model: nn.Module, sp: bool, block_extra_args: int) -> dict:
    """Under SP, a pipeline stage without the embedding (or head) takes (or hands on) whole hidden states:
    keep this rank's slice of the sequence on the way in (free), all-gather it on the way out."""
    if not sp or len(model.layers) == 0:
        return {}
    first, last, extra = next(iter(model.layers)), list(model.layers)[-1], (None,) * block_extra_args
    into = dict(input_layouts=(Replicate(), *extra), desired_input_layouts=(Shard(1), *extra))
    out_of = dict(output_layouts=Shard(1), desired_output_layouts=Replicate())
    takes_whole, hands_whole = model.tok_embeddings is None, model.output is None
    if takes_whole and hands_whole and first == last:
        return {f"layers.{first}": PrepareModuleInputOutput(**into, **out_of)}
    plan = {}
    if takes_whole:
        plan[f"layers.{first}"] = PrepareModuleInput(**into)
    if hands_whole:
        plan[f"layers.{last}"] = PrepareModuleOutput(**out_of)
    return plan


def moe_block_plan(sp: bool) -> dict:
    """A block whose feed-forward is MoE (models/moe.py): attention as block_plan; the router and experts whole
    on every tp rank (as torchtitan without expert-tensor parallelism), fed the whole sequence under SP."""
    stream = Shard(1) if sp else Replicate()
    plan = {path: style for path, style in block_plan(sp).items() if not path.startswith("feed_forward")}
    plan["feed_forward"] = PrepareModuleInputOutput(
        input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(stream,), use_local_output=not sp)
    for part in ("feed_forward.router.gate", "feed_forward.experts", "feed_forward.shared"):
        plan[part] = ReplicateParallel(local_inputs=part.endswith("experts"))
    return plan


def llama_tp_plan(model: Transformer, tp: int, sp: bool = False, loss_parallel: bool = False) -> dict:
    """The whole Llama model's plan, keyed by paths parallelize_module understands ("layers.*.attention.wq")."""
    model.args.check_tp_divides(tp)
    if model.args.moe:
        plan = {}
        for index, block in model.layers.items():
            moe = model.args.is_moe_layer(int(index))
            for path, style in (moe_block_plan(sp) if moe else block_plan(sp)).items():
                if path != "feed_forward.shared" or getattr(block.feed_forward, "shared", None) is not None:
                    plan[f"layers.{index}.{path}"] = style
    else:
        plan = {f"layers.*.{path}": style for path, style in block_plan(sp).items()}
    plan.update(stage_edge_plan(model, sp, block_extra_args=2))
    if model.tok_embeddings is not None:
        # vocab-sharded table: each rank looks up its rows, the partial sums are reduced (or reduce-scattered)
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate(),
                                                 use_local_output=not sp)
    if model.output is not None:
        plan.update(head_plan(sp, loss_parallel))
    return plan


def gpt2_tp_plan(model: nn.Module, tp: int, sp: bool = False, loss_parallel: bool = False) -> dict:
    """GPT-2: as Llama, but an ungated MLP, no RoPE arguments, and learned positions beside the token table."""
    model.args.check_tp_divides(tp)
    plan = {f"layers.*.{path}": style for path, style in block_plan(sp, 0, gated_mlp=False).items()}
    plan.update(stage_edge_plan(model, sp, block_extra_args=0))
    tied = model.tok_embeddings is not None and model.output is not None and \
        model.output.weight is model.tok_embeddings.tokens.weight
    if model.tok_embeddings is not None:
        # a tied table: vocabulary rows sharded for the lookup and the head alike (one Shard(0) parameter)
        table = VocabParallelEmbedding if tied else RowwiseParallel
        plan["tok_embeddings.tokens"] = table(input_layouts=Replicate(), output_layouts=Replicate())
        plan["tok_embeddings.positions"] = ReplicateParallel()
        if sp:
            # tokens + positions is whole on every rank: keeping this rank's slice of the sequence is free
            plan["tok_embeddings"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                         use_local_output=False)
    if model.output is not None:
        plan.update(head_plan(sp, loss_parallel))
        if tied:  # after the embedding (dict order is the order parallelize_module applies the plan in)
            head = plan.pop("output")
            plan["output"] = TiedColwiseParallel(model.tok_embeddings.tokens, input_layouts=head.input_layouts[0],
                                                 output_layouts=head.output_layouts[0],
                                                 use_local_output=head.use_local_output)
    return plan


def tp_plan_for(model: nn.Module, tp: int, sp: bool = False, loss_parallel: bool = False) -> dict:
    """The built-in plan of a paratrain model family; other models must bring their own."""
    speed = getattr(model, "speed", None)
    if speed is not None:  # built with speed options (models/speed.py) the plan may not split
        speed.refuse_head_split(tp)
    if isinstance(model, Transformer):
        return llama_tp_plan(model, tp, sp, loss_parallel)
    if getattr(getattr(model, "args", None), "family", None) == "gpt2":
        return gpt2_tp_plan(model, tp, sp, loss_parallel)
    raise UserError(f"no built-in tensor-parallel plan for {type(model).__name__}; "
                    "pass tp_plan={'module.path': ColwiseParallel(), ...} to paratrain.parallelize")
