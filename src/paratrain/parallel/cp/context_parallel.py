# Context parallelism: shard every sequence across the cp ranks and swap the model's attention for a
# distributed one (ring or Ulysses). Data side (sequence_sharder) and model side (apply_cp) share one layout.
"""Context parallel entry points: sequence_sharder(layout) for the trainer, apply_cp() for parallelize().

Layout (load-balanced for the causal mask): the sequence is cut into 2*cp chunks and cp rank r holds chunks
r and 2*cp-1-r, so every rank owns as many early (cheap) as late (expensive) queries. RoPE gets the global
positions of the local tokens. Each rank's loss is the mean over its local tokens; all ranks hold the same
number of tokens, so averaging gradients over the cp ranks (DDP over dp_cp, or FSDP over dp_shard_cp) gives
exactly the gradient of the global mean. Sequence lengths must be multiples of 2*cp (no padding).
"""

from __future__ import annotations

import functools
import logging

from torch import nn

from paratrain.errors import UserError
from paratrain.parallel.cp.ring_attention import ring_attention, zigzag_positions
from paratrain.parallel.cp.ulysses import ulysses_attention
from paratrain.parallel.options import CP_IMPLS

log = logging.getLogger("paratrain")

# the attention function of each implementation name in parallel/options.py
CP_ATTENTION = dict(zip(CP_IMPLS, (ring_attention, ulysses_attention), strict=True))


def sequence_sharder(layout):
    """prepare(inputs, targets) -> (local inputs, local targets, {"positions": global positions (seq_local,)})

    for this rank's two chunks of the load-balanced layout.
    """
    cp, rank = layout.cp, layout.submesh("cp").get_local_rank()

    def prepare(inputs, targets):
        positions = zigzag_positions(inputs.shape[1], cp, rank, inputs.device)
        return inputs.index_select(1, positions), targets.index_select(1, positions), {"positions": positions}

    return prepare


def apply_cp(model: nn.Module, cp_mesh, impl: str = CP_IMPLS[0]) -> nn.Module:
    """Swap every block's attention hook for `impl` attention over the cp group (in place)."""
    if impl not in CP_ATTENTION:  # parallelize()'s own callers skip check_layout
        raise UserError(f"unknown --cp-impl {impl!r}; choose one of {', '.join(CP_IMPLS)}")
    attn_fn = functools.partial(CP_ATTENTION[impl], group=cp_mesh.get_group())
    if hasattr(model, "use_attention"):  # a transformers model: through its own attention-function registry
        from paratrain.parallel.hf_attention import register_attention

        model.use_attention(register_attention(f"paratrain-cp-{impl}", attn_fn))
        log.info("applied context parallel (%s attention) over %d ranks through transformers' attention registry",
                 impl, cp_mesh.size())
        return model
    layers = getattr(model, "layers", None) or {}
    for block in layers.values():
        block.attention.attn_fn = attn_fn
    log.info("applied context parallel (%s attention) over %d ranks to %d blocks", impl, cp_mesh.size(),
             len(layers))
    return model
