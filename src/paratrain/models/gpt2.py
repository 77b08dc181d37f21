"""A plain GPT-2 decoder (LayerNorm, GELU MLP, learned positions, tied embedding), GPT-2's parameters one to one.

It keeps the conventions of models/llama.py so strategies treat both families alike: blocks sit in a
ModuleDict `layers` keyed "0".."n-1"; attention is `attention.wq/wk/wv/wo` and goes through
`Attention.attn_fn(q, k, v)` (the context-parallel hook); heads come from tensor shapes (tensor parallel);
the token *and* position tables live in one `tok_embeddings` module, so a pipeline stage that drops the
embedding drops both. The MLP is `feed_forward.w1` (up) and `feed_forward.w2` (down), with no w3.
Build-time speed options (models/speed.py ModelSpeed) change how it computes, never its parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.fast_paths import StreamLayerNorm, bf16_stream, project_qkv, stream_out
from paratrain.models.fused_loss import OutputHead
from paratrain.models.llama import ModelArgs, causal_sdpa
from paratrain.models.speed import ModelSpeed


class GPT2Embeddings(nn.Module):
    """Token table plus learned absolute positions: h = tokens[ids] + positions[pos]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.tokens = nn.Embedding(args.vocab_size, args.dim)
        self.positions = nn.Embedding(args.max_seq_len, args.dim)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(positions)


class GPT2Attention(nn.Module):
    def __init__(self, args: ModelArgs, fused_qkv: bool = False):
        super().__init__()
        self.head_dim = args.head_dim
        self.fused_qkv = fused_qkv
        inner = args.n_heads * self.head_dim
        self.wq = nn.Linear(args.dim, inner)
        self.wk = nn.Linear(args.dim, inner)
        # GPT-2 has a key bias, so it is here (checkpoints map one to one, the count is GPT-2's), but frozen: it
        # adds q.b_k to every score of a query alike, which softmax cancels, so its true gradient is identically
        # zero; training it would only feed rounding noise to Adam
        self.wk.bias.requires_grad_(False)
        self.wv = nn.Linear(args.dim, inner)
        self.wo = nn.Linear(inner, args.dim)
        self.attn_fn = causal_sdpa

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its local heads
        q, k, v = project_qkv(x, self.wq, self.wk, self.wv, self.fused_qkv)
        q = q.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        out = self.attn_fn(q, k, v) if doc_ids is None else self.attn_fn(q, k, v, doc_ids=doc_ids)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class GPT2MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def layer_norm(args: ModelArgs, speed: ModelSpeed) -> nn.LayerNorm:
    return (StreamLayerNorm if speed.bf16_residual else nn.LayerNorm)(args.dim, eps=args.norm_eps)


class GPT2Block(nn.Module):
    def __init__(self, args: ModelArgs, speed: ModelSpeed = ModelSpeed()):
        super().__init__()
        self.attention_norm = layer_norm(args, speed)
        self.attention = GPT2Attention(args, speed.fused_qkv)
        self.ffn_norm = layer_norm(args, speed)
        self.feed_forward = GPT2MLP(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), doc_ids=doc_ids)
        return h + self.feed_forward(self.ffn_norm(h))


class GPT2(nn.Module):
    """Decoder-only LM. Pipeline stages set tok_embeddings / norm / output to None where absent."""

    def __init__(self, args: ModelArgs, speed: ModelSpeed = ModelSpeed()):
        super().__init__()
        self.args, self.speed = args, speed
        self.tok_embeddings: nn.Module | None = GPT2Embeddings(args)
        self.layers = nn.ModuleDict({str(i): GPT2Block(args, speed) for i in range(args.n_layers)})
        self.norm: nn.Module | None = layer_norm(args, speed)
        self.output: nn.Module | None = OutputHead(args.dim, args.vocab_size)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.tokens.weight

    def init_weights(self, seed: int) -> None:
        """Deterministic init from a seed (GPT-2's: N(0, 0.02), residual projections scaled by 1/sqrt(2L))."""
        gen = torch.Generator().manual_seed(seed)
        std = 0.02
        with torch.no_grad():
            # named_parameters() lists a tied table once, so it is drawn once
            for name, p in sorted(self.named_parameters()):
                owner, _, leaf = name.rpartition(".")
                if owner.endswith("norm"):
                    p.fill_(1.0 if leaf == "weight" else 0.0)
                elif leaf == "bias":
                    p.zero_()
                else:
                    scale = std / (2 * self.args.n_layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else std
                    p.copy_(torch.randn(p.shape, generator=gen) * scale)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                loss_chunks: int | None = None) -> torch.Tensor:
        """tokens: (batch, seq) ids, or hidden states on a later pipeline stage.

        positions, doc_ids, targets, loss_chunks: as the Llama decoder's (models/llama.py): global positions under
        context parallel, or per-document positions and document ids of packed rows; the loss instead of the
        logits (--fused-loss), taken by the tied head.
        """
        if self.tok_embeddings is not None:
            if positions is None:
                positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.tok_embeddings(tokens, positions)
        else:
            h = tokens
        entry_dtype, h = h.dtype, bf16_stream(h, self.speed)
        for layer in self.layers.values():
            h = layer(h, doc_ids=doc_ids)
        return stream_out(self, h, entry_dtype, targets, loss_chunks)
