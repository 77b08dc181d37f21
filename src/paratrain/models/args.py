"""A model's shape (ModelArgs) and its parameter count per family: plain Python, no torch, so that the planner
answers from its trace cache without importing torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from paratrain.errors import UserError


@dataclass(frozen=True)
class ModelArgs:
    name: str = "custom"
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_dim: int = 256
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    family: str = "llama"  # "llama" (this file) or "gpt2" (models/gpt2.py: LayerNorm, GELU, learned positions)
    tie_embeddings: bool = False  # the output head shares the token table (paratrain's Llama builds it untied)
    attn_head_dim: int | None = None  # a head size other than dim / n_heads (Qwen3: 128 at hidden 2048, 32 heads)
    # Mixture of Experts (models/moe.py); n_experts 0: a dense model
    n_experts: int = 0
    top_k: int = 2
    moe_ffn_dim: int = 0  # each routed expert's hidden size (0: ffn_dim)
    n_shared_experts: int = 0  # experts every token passes through (DeepSeek), each of moe_ffn_dim
    n_dense_layers: int = 0  # the first layers keep a dense FFN of ffn_dim (DeepSeek-V3: 3)
    router: str = "softmax"  # "softmax" top-k (Mixtral, Qwen3-MoE, OLMoE) or "sigmoid" (DeepSeek-V3)
    norm_topk: bool = True  # renormalise the k chosen gates to sum to 1
    aux_loss_coeff: float = 0.01  # load-balancing loss (Switch / GShard), over the tokens of all data ranks
    bias_update_rate: float = 0.0  # auxiliary-loss-free balancing (DeepSeek-V3): router bias step per update
    capacity_factor: float = 0.0  # 0: dropless; else each expert takes at most factor x S x k / E copies per sequence

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim

    def is_moe_layer(self, index: int) -> bool:
        return self.moe and index >= self.n_dense_layers

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    def check_tp_divides(self, tp: int) -> None:
        """Tensor parallelism splits heads, kv heads, the ffn and the vocab tp ways: each must divide evenly."""
        for label, size in (("attention heads", self.n_heads), ("kv heads", self.kv_heads),
                            ("ffn size", self.ffn_dim), ("vocab size", self.vocab_size)):
            if size % tp:
                raise UserError(f"tp={tp} does not divide the model's {label} ({size})")

    def to_dict(self) -> dict:
        return asdict(self)


def count_gpt2_params(args: ModelArgs, include_embedding: bool = True) -> int:
    """Parameters of GPT2(args). include_embedding=False drops the token and position tables (lookups);
    the output head always counts, tied or not, since it is a real matmul."""
    d, f = args.dim, args.ffn_dim
    attn = 4 * d * d + 4 * d  # q, k, v and output biases (the key bias is frozen, see GPT2Attention)
    mlp = 2 * d * f + f + d
    per_layer = attn + mlp + 4 * d
    head = args.vocab_size * d
    body = args.n_layers * per_layer + 2 * d + head
    tables = args.vocab_size * d + args.max_seq_len * d
    if not include_embedding:
        return body
    return body + tables - (head if args.tie_embeddings else 0)
