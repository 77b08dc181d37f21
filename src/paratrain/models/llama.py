"""A plain Llama-style decoder (RMSNorm, RoPE, grouped-query SDPA attention, SwiGLU).

No parallel code lives here: strategies act on the module tree from outside. Three conventions make
that possible: layers sit in a ModuleDict keyed by their index (pipeline stages delete the others but
keep the names), head counts are derived from tensor shapes (TP shards them), and attention goes
through `Attention.attn_fn`, the hook context parallelism swaps. Build-time speed options (models/speed.py
ModelSpeed) change how it computes, never its parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.args import ModelArgs
from paratrain.models.fast_paths import bf16_stream, project_qkv, stream_out, stream_rms_norm
from paratrain.models.fused_loss import OutputHead
from paratrain.models.speed import ModelSpeed


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool: a query sees the keys of its own document up to itself (block-diagonal causal)."""
    seq = doc_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    return (doc_ids[:, None, :, None] == doc_ids[:, None, None, :]) & causal


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Default attention: q, k, v are (batch, heads, seq, head_dim) with equal head counts. With document ids
    (packed rows), attention stays inside each document."""
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc_ids))


def rope_tables(head_dim: int, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the rotary angles for the given (global) positions: (..., head_dim/2) each.

    Computed per forward rather than stored as buffers, so that no strategy has buffers to broadcast,
    shard or checkpoint. In fp32 (as torchtitan's): fp64 cos/sin are slow kernels on GPUs, compiled or not.
    An angle's error is about position x 6e-8 rad (5e-4 at 8k positions), below bf16's resolution.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); cos/sin: (seq, head_dim/2) or (batch, seq, head_dim/2)."""
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class StreamRMSNorm(RMSNorm):
    """RMSNorm (same parameter) that keeps a bf16 stream in bf16 (--bf16-residual): torch's kernel, which keeps the
    statistics in fp32, instead of fp32 copies of the input saved for the backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        return stream_rms_norm(x, self.weight, self.eps)


def rms_norm(args: ModelArgs, speed: ModelSpeed) -> RMSNorm:
    return (StreamRMSNorm if speed.bf16_residual else RMSNorm)(args.dim, args.norm_eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, fused_qkv: bool = False):
        super().__init__()
        self.head_dim = args.head_dim
        self.fused_qkv = fused_qkv
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.attn_fn = causal_sdpa

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its local heads.
        q, k, v = project_qkv(x, self.wq, self.wk, self.wv, self.fused_qkv)
        q = q.view(bsz, seqlen, -1, self.head_dim)
        k = k.view(bsz, seqlen, -1, self.head_dim)
        v = v.view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = q.shape[2] // k.shape[2]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=2)
            v = v.repeat_interleave(groups, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # document ids only when the batch has them: a swapped-in attention need not know of them otherwise
        out = self.attn_fn(q, k, v) if doc_ids is None else self.attn_fn(q, k, v, doc_ids=doc_ids)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, speed: ModelSpeed = ModelSpeed()):
        super().__init__()
        self.attention_norm = rms_norm(args, speed)
        self.attention = Attention(args, speed.fused_qkv)
        self.ffn_norm = rms_norm(args, speed)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, doc_ids=doc_ids)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only LM. Pipeline stages set tok_embeddings / norm / output to None where absent."""

    def __init__(self, args: ModelArgs, speed: ModelSpeed = ModelSpeed()):
        super().__init__()
        self.args, self.speed = args, speed
        self.tok_embeddings: nn.Module | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, speed) for i in range(args.n_layers)})
        self.norm: nn.Module | None = rms_norm(args, speed)
        self.output: nn.Module | None = OutputHead(args.dim, args.vocab_size)

    def init_weights(self, seed: int) -> None:
        """Deterministic init from a seed, independent of device and of how the model is later split."""
        gen = torch.Generator().manual_seed(seed)
        std = 0.02
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                    continue
                scale = std / (2 * self.args.n_layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * scale)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                loss_chunks: int | None = None) -> torch.Tensor:
        """tokens: (batch, seq) ids, or hidden states on a later pipeline stage.

        positions: global token positions (seq,) when the sequence is sharded (context parallel), or each token's
        position inside its document (batch, seq) for packed rows. doc_ids: (batch, seq) document ids of packed
        rows (the whole row's under context parallelism): attention never crosses a document. targets (batch, seq):
        the head returns the mean loss over them instead of the logits (--fused-loss: models/fused_loss.py),
        over `loss_chunks` token chunks (None: its own count).
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device)
        cos, sin = rope_tables(self.args.head_dim, positions, self.args.rope_theta)
        entry_dtype, h = h.dtype, bf16_stream(h, self.speed)
        for layer in self.layers.values():
            h = layer(h, cos, sin, doc_ids=doc_ids)
        return stream_out(self, h, entry_dtype, targets, loss_chunks)
