# Ring attention (Liu et al. 2023) with the load-balanced "zigzag" layout: K/V blocks travel around the
# context-parallel ring while each rank keeps its queries; partial results merge exactly by log-sum-exp.
"""Ring attention as an autograd Function, written out forward and backward.

Layout: the sequence is cut into 2*cp chunks of c tokens; cp rank r holds chunks r and 2*cp-1-r (its local
sequence is [chunk r | chunk 2cp-1-r], 2c tokens). At ring step i rank r holds the K/V of rank
src=(r-i) mod cp, and the causal mask between its queries and that block takes one of three shapes:

    step 0   (src == r): the block is our own: the causal mask by global position (3 of 4 sub-blocks live);
    src <  r           : every query sees the source's *first* chunk, none of its second;
    src >  r           : only our *second* chunk of queries sees the block, and sees all of it.

Steps after the first therefore cost exactly two c x c sub-blocks on every rank: equal work everywhere.
The blockwise attention is plain fp32 math (matmul + logsumexp), so the LSE is exact and it runs on CPU.
"""

from __future__ import annotations

import torch

from paratrain.errors import UserError
from paratrain.parallel.cp.cp_comm import CPComm, cp_comm, wait_all

_KV_TAG, _DKV_TAG = 71, 72  # distinct tags keep the K/V and dK/dV streams apart on gloo (NCCL ignores tags)
# query rows are processed in tiles of at most this many score elements (8 MiB in fp32), so a block's
# transient scores/probabilities stay small next to the activations however long the local sequence is
TILE_SCORES = 1 << 21


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens cp rank `rank` holds: chunks rank and 2*cp-1-rank of 2*cp chunks."""
    if seq_len % (2 * cp):
        raise UserError(f"context parallel cp={cp} needs the sequence length ({seq_len}) to be a multiple of "
                        f"2*cp={2 * cp}")
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def _block_region(step: int, rank: int, cp: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, needs the causal mask) for the K/V block held at `step` (see module doc)."""
    src = (rank - step) % cp
    if step == 0:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _row_tiles(rows: slice, seq_local: int, kv_len: int, batch_heads: int) -> list[slice]:
    start, stop, _ = rows.indices(seq_local)
    step = max(1, TILE_SCORES // max(1, kv_len * batch_heads))
    return [slice(first, min(first + step, stop)) for first in range(start, stop, step)]


def _causal_mask(rank: int, cp: int, c: int, device) -> torch.Tensor:
    pos = zigzag_positions(2 * cp * c, cp, rank, device)
    return pos[:, None] >= pos[None, :]


def _document_mask(rank: int, src: int, cp: int, c: int, doc_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, 2c, 2c): our queries against src's keys, causal by global position and inside one document.
    doc_ids: (batch, seq) of the whole row, in natural order."""
    q_pos = zigzag_positions(2 * cp * c, cp, rank, doc_ids.device)
    k_pos = zigzag_positions(2 * cp * c, cp, src, doc_ids.device)
    same_doc = doc_ids[:, q_pos][:, None, :, None] == doc_ids[:, k_pos][:, None, None, :]
    return same_doc & (q_pos[:, None] >= k_pos[None, :])


def _block_mask(step: int, rank: int, cp: int, c: int, device, doc_ids):
    """The mask of the block held at `step` over its region (None: the whole region is visible)."""
    rows, cols, masked = _block_region(step, rank, cp, c)
    if doc_ids is not None:
        return _document_mask(rank, (rank - step) % cp, cp, c, doc_ids)[..., rows, cols]
    return _causal_mask(rank, cp, c, device) if masked else None


def _attend_block(q, k, v, scale: float, mask):
    """Softmax attention of q over one K/V block: (output, log-sum-exp of the scores) in fp32."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # FlashAttention's order: unnormalised exp(s - max) @ V, divided by the row sum afterwards
    row_max = scores.amax(dim=-1, keepdim=True)
    # a query with no visible key in this block (another document's): output 0, log-sum-exp -inf
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, v) / row_sum.clamp_min(torch.finfo(row_sum.dtype).tiny), row_max + torch.log(row_sum)


def _merge_into(out, lse, block_out, block_lse) -> None:
    """out/lse (views) <- the exact softmax over both key sets, from each side's partial result."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse)).add_(block_out * torch.exp(block_lse - new_lse))
    lse.copy_(new_lse)


def _grad_block(q, k, v, dout, lse, delta, scale: float, mask):
    """FlashAttention-style gradients of one block, from the final LSE: (dq, dk, dv) in fp32."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - lse)  # the final softmax restricted to this block
    dv = torch.matmul(probs.transpose(-2, -1), dout)
    dscores = probs * (torch.matmul(dout, v.transpose(-2, -1)) - delta)
    dq = torch.matmul(dscores, k) * scale
    dk = torch.matmul(dscores.transpose(-2, -1), q) * scale
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: CPComm, doc_ids=None):
        cp, rank = ring.size, ring.rank
        batch, heads, seq_local, _ = q.shape
        if seq_local % 2:
            raise UserError(f"ring attention needs an even local sequence length (two chunks), "
                            f"got {seq_local}")
        c, scale = seq_local // 2, q.shape[-1] ** -0.5
        with torch.autocast(q.device.type, enabled=False):
            qf = q.float()
            kv = torch.stack([k.float(), v.float()])
            out = torch.zeros_like(qf)
            lse = torch.full((batch, heads, seq_local, 1), float("-inf"), device=q.device)
            for step in range(cp):
                ring.ring_step(step)
                # Phase 1: post the K/V rotation for the next step first: the transfer overlaps this compute.
                if step + 1 < cp:
                    next_kv, works = ring.shift(kv, _KV_TAG)
                # Phase 2: attend to the block we hold, with the mask shape this step calls for.
                rows, cols, _ = _block_region(step, rank, cp, c)
                mask = _block_mask(step, rank, cp, c, q.device, doc_ids)
                k_blk, v_blk = kv[0][..., cols, :], kv[1][..., cols, :]
                for tile in ring.row_tiles(_row_tiles(rows, seq_local, k_blk.shape[-2], batch * heads)):
                    block_out, block_lse = _attend_block(qf[..., tile, :], k_blk, v_blk, scale,
                                                         _tile_of(mask, tile, rows))
                    # Phase 3: merge the partial result into the running output by log-sum-exp.
                    _merge_into(out[..., tile, :], lse[..., tile, :], block_out, block_lse)
                if step + 1 < cp:
                    wait_all(works)
                    kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.doc_ids = ring, doc_ids
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        cp, rank = ring.size, ring.rank
        batch, heads, seq_local, _ = q.shape
        c, scale = seq_local // 2, q.shape[-1] ** -0.5
        with torch.autocast(q.device.type, enabled=False):
            qf, doutf = q.float(), dout.float()
            delta = (doutf * out).sum(dim=-1, keepdim=True)  # rowsum(dO * O), the softmax-Jacobian term
            dq = torch.zeros_like(qf)
            kv = torch.stack([k.float(), v.float()])
            dkv_recv, dkv_works = None, None
            for step in range(cp):
                ring.ring_step(step)
                # Phase 1: post the K/V rotation for the next step (the same ring walk as the forward).
                if step + 1 < cp:
                    next_kv, kv_works = ring.shift(kv, _KV_TAG)
                # Phase 2: this block's gradients; dQ belongs to our queries and accumulates here.
                rows, cols, _ = _block_region(step, rank, cp, c)
                mask = _block_mask(step, rank, cp, c, q.device, ctx.doc_ids)
                k_blk, v_blk = kv[0][..., cols, :], kv[1][..., cols, :]
                dkv = torch.zeros_like(kv)
                for tile in ring.row_tiles(_row_tiles(rows, seq_local, k_blk.shape[-2], batch * heads)):
                    bdq, bdk, bdv = _grad_block(qf[..., tile, :], k_blk, v_blk, doutf[..., tile, :],
                                                lse[..., tile, :], delta[..., tile, :], scale,
                                                _tile_of(mask, tile, rows))
                    dq[..., tile, :] += bdq
                    dkv[0][..., cols, :] += bdk
                    dkv[1][..., cols, :] += bdv
                # Phase 3: dK/dV of this block belong to its owner: add ours to what earlier holders summed.
                if dkv_works is not None:
                    wait_all(dkv_works)
                    dkv += dkv_recv
                # Phase 4: pass the sum on; the next rank holds this same block at the next step.
                if cp > 1:
                    dkv_recv, dkv_works = ring.shift(dkv, _DKV_TAG)
                else:
                    dkv_recv = dkv
                if step + 1 < cp:
                    wait_all(kv_works)
                    kv = next_kv
            # Phase 5: after cp hops every block's dK/dV has come home.
            if dkv_works is not None:
                wait_all(dkv_works)
        return dq.to(q.dtype), dkv_recv[0].to(k.dtype), dkv_recv[1].to(v.dtype), None, None


def _tile_of(mask, tile: slice, rows: slice):
    """A tile's rows of a block mask whose first row is the region's first (`rows`)."""
    if mask is None:
        return None
    start = rows.start or 0
    return mask[..., tile.start - start:tile.stop - start, :]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, doc_ids=None) -> torch.Tensor:
    """Causal attention over the whole (zigzag-sharded) sequence; q, k, v: (batch, heads, seq_local, dim).
    `group`: the cp process group, or a CPComm standing for one. doc_ids: (batch, seq) document ids of the whole
    row (packed data): attention also stays inside each document."""
    return RingAttention.apply(q, k, v, cp_comm(group), doc_ids)
