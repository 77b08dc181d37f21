# Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023): all-to-all from sequence-sharded to
# head-sharded, full-sequence causal attention on 1/cp of the heads, all-to-all back.
"""Ulysses attention over a context-parallel group (gloo supports all_to_all_single, so CPU runs it as is).

Ranks hold the sequence in the zigzag layout of ring_attention (chunks r and 2cp-1-r), so after the
all-to-all the gathered sequence is permuted; it is put into natural order before causal attention and
back into the zigzag layout afterwards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paratrain.errors import UserError
from paratrain.parallel.cp.cp_comm import CPComm, cp_comm
from paratrain.parallel.cp.ring_attention import zigzag_positions


class _AllToAll(torch.autograd.Function):
    """x: (cp, ...): slot j goes to rank j; slot j of the result came from rank j. Its own adjoint."""

    @staticmethod
    def forward(ctx, x, comm: CPComm):
        ctx.comm = comm
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.comm), None


def _layout_positions(seq_local: int, cp: int, device) -> torch.Tensor:
    """Global position of each token in the gathered order [rank 0's tokens | rank 1's | ...]."""
    seq_len = seq_local * cp
    return torch.cat([zigzag_positions(seq_len, cp, r, device) for r in range(cp)])


def check_ulysses_heads(heads: int, cp: int) -> None:
    if heads % cp:
        raise UserError(f"cp-ulysses splits attention heads across ranks: heads={heads} is not divisible by "
                        f"cp={cp}; use --cp-impl ring or a cp that divides {heads}")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, doc_ids=None) -> torch.Tensor:
    """Causal attention over the whole sequence; q, k, v: (batch, heads, seq_local, dim), zigzag-sharded.
    `group`: the cp process group, or a CPComm standing for one. doc_ids: (batch, seq) document ids of the whole
    row in natural order (packed data): attention also stays inside each document."""
    comm = cp_comm(group)
    cp = comm.size
    heads, seq_local = q.shape[1], q.shape[2]
    check_ulysses_heads(heads, cp)
    layout = _layout_positions(seq_local, cp, q.device)
    natural = torch.argsort(layout)

    # Phase 1: sequence-sharded -> head-sharded. Slot j carries head group j to rank j.
    qkv = torch.stack([q, k, v])  # (3, b, h, s_local, d)
    send = qkv.unflatten(2, (cp, heads // cp)).movedim(2, 0)  # (cp, 3, b, h/cp, s_local, d)
    recv = _AllToAll.apply(send, comm)  # slot j: rank j's tokens of our head group
    full = recv.movedim(0, 3).flatten(3, 4)  # (3, b, h/cp, s, d) in the gathered (zigzag) order
    full = full.index_select(3, natural)

    # Phase 2: plain causal attention over the full sequence for our heads.
    if doc_ids is None:
        out = F.scaled_dot_product_attention(full[0], full[1], full[2], is_causal=True)
    else:
        seq = doc_ids.shape[-1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        mask = (doc_ids[:, None, :, None] == doc_ids[:, None, None, :]) & causal
        out = F.scaled_dot_product_attention(full[0], full[1], full[2], attn_mask=mask)

    # Phase 3: head-sharded -> sequence-sharded. Slot j carries rank j's tokens back to it.
    out = out.index_select(2, layout).unflatten(2, (cp, seq_local)).movedim(2, 0)  # (cp, b, h/cp, s_local, d)
    back = _AllToAll.apply(out, comm)  # slot j: head group j of our tokens
    return back.movedim(0, 1).flatten(1, 2)  # (b, h, s_local, d)
