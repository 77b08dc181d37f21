"""Static shape check: matmul dimensions that are not multiples of the hardware's tile size.

Tensor cores (and CPU GEMM kernels) work in tiles; a dimension of 50257 or 96 leaves ragged tiles and
can fall off the fast kernels. 64 is the multiple nanoGPT pads its vocabulary to (50257 -> 50304). Under
tensor parallelism the sharded size (size / tp) must be aligned, so the padding is to 64 x tp.
"""

from __future__ import annotations

MULTIPLE = 64
HEAD_MULTIPLE = 8  # fused attention kernels want head_dim % 8 == 0


def pad_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def flop_terms(args) -> dict[str, float]:
    """Per-token weight-matmul sizes by where they sit (same convention as models/presets.count_params)."""
    d, h = args.dim, args.head_dim
    attn = args.n_layers * (d * args.n_heads * h * 2 + d * args.kv_heads * h * 2)
    mlp = args.n_layers * 3 * d * args.ffn_dim
    head = args.vocab_size * d
    return {"attention": attn, "mlp": mlp, "head": head, "total": attn + mlp + head}


def misaligned_shapes(args, tp: int = 1) -> list[dict]:
    """[{name, key, value, padded, multiple, where, flops_share}] for each misaligned dimension."""
    terms = flop_terms(args)
    total = terms["total"] or 1
    tp = max(1, tp)
    checks = [
        ("vocab_size", "vocab_size", args.vocab_size, MULTIPLE * tp, "output projection and embedding",
         terms["head"] / total),
        ("dim", "dim", args.dim, MULTIPLE, "every matmul", 1.0),
        ("ffn_dim", "ffn_dim", args.ffn_dim, MULTIPLE * tp, "MLP matmuls", terms["mlp"] / total),
        ("head_dim", None, args.head_dim, HEAD_MULTIPLE, "attention kernels", terms["attention"] / total),
    ]
    out = []
    for name, key, value, multiple, where, share in checks:
        if value % multiple:
            padded = pad_to(value, multiple)
            out.append({"name": name, "key": key, "value": value, "padded": padded, "multiple": multiple,
                        "where": where, "flops_share": share})
    dim_issue = next((i for i in out if i["name"] == "dim"), None)
    if dim_issue and args.dim % args.n_heads == 0 and dim_issue["padded"] % args.n_heads:
        dim_issue["padded"] = pad_to(dim_issue["padded"], MULTIPLE * args.n_heads)
    return out


def misaligned_share(issues: list[dict]) -> float:
    """Fraction of model FLOPs touched by a misaligned dimension (dim touches every matmul)."""
    if any(i["name"] == "dim" for i in issues):
        return 1.0
    return min(1.0, sum(i["flops_share"] for i in issues))
