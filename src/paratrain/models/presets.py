"""Named model shapes, and the parameter / FLOP counts every part of paratrain shares.

FLOPs convention (used by plan, train, bench and doctor alike): training FLOPs per token are
    6 * N  +  12 * n_layers * dim * seq_len
where N counts every parameter except the input embedding table (the output head is a real matmul,
the embedding is a lookup) and the second term is attention's QK^T and AV, forward + backward, without
discounting the causal mask (the PaLM / nanoGPT convention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.errors import UserError
from paratrain.models.args import ModelArgs, count_gpt2_params

if TYPE_CHECKING:
    import torch

    from paratrain.models.llama import Transformer
    from paratrain.models.speed import ModelSpeed

# torch (and the model code) is imported where a model is built: the planner reads shapes and counts from here
# and answers from its trace cache without importing torch

PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(name="tiny", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192,
                      max_seq_len=1024),
    # tiny with 4 layers: enough stages for pp=4 or interleaved pipelines (2 ranks x 2 stages)
    "tiny4": ModelArgs(name="tiny4", vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192,
                       max_seq_len=1024),
    # tiny with as many kv heads as heads: every size splits 4 ways, for tp=4 (tiny's 2 kv heads stop at tp=2)
    "tiny-mha": ModelArgs(name="tiny-mha", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=192,
                          max_seq_len=1024),
    "small": ModelArgs(name="small", vocab_size=4096, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768,
                       max_seq_len=2048),
    # GPT-2 family (models/gpt2.py), 2 layers, tied like GPT-2: tests and CPU runs of the LayerNorm/GELU path
    "gpt2-tiny": ModelArgs(name="gpt2-tiny", family="gpt2", vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=256,
                           max_seq_len=1024, tie_embeddings=True),
    # the real GPT-2 small: 124,439,808 parameters at its vocabulary of 50257, here padded to 50304 (a multiple
    # of 128, for the matmul kernels): 124,475,904
    "gpt2-124m": ModelArgs(name="gpt2-124m", family="gpt2", vocab_size=50304, dim=768, n_layers=12, n_heads=12,
                           ffn_dim=3072, max_seq_len=1024, tie_embeddings=True),
    # GPT-2 small's shape as a Llama (RMSNorm, RoPE, SwiGLU 2048, untied): what `gpt2-124m` named before
    "llama-162m": ModelArgs(name="llama-162m", vocab_size=50304, dim=768, n_layers=12, n_heads=12, ffn_dim=2048,
                            max_seq_len=1024),
    "llama3-8b": ModelArgs(name="llama3-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                           ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0),
    "llama2-70b": ModelArgs(name="llama2-70b", vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                            ffn_dim=28672, max_seq_len=4096),
    # Mixture of Experts (models/moe.py): 4 experts, top-2, for tests and CPU runs of --ep
    "moe-tiny": ModelArgs(name="moe-tiny", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192,
                          max_seq_len=1024, n_experts=4, top_k=2, moe_ffn_dim=64),
    # published MoE shapes, for planning: 46.7 B / 12.9 B active
    "mixtral-8x7b": ModelArgs(name="mixtral-8x7b", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                              ffn_dim=14336, max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2),
    # 30.5 B / 3.3 B active; head size 128 (not hidden / heads)
    "qwen3-30b-a3b": ModelArgs(name="qwen3-30b-a3b", vocab_size=151936, dim=2048, n_layers=48, n_heads=32,
                               n_kv_heads=4, attn_head_dim=128, ffn_dim=6144, max_seq_len=40960, rope_theta=1e6,
                               n_experts=128, top_k=8, moe_ffn_dim=768, norm_eps=1e-6),
    # DeepSeek-V3's MoE (256 routed + 1 shared expert, top-8 sigmoid, 3 dense layers): 671 B / 37 B active. Its
    # MLA attention is stood in for by grouped-query attention of the same parameters (~187 M a layer)
    "deepseek-v3-like": ModelArgs(name="deepseek-v3-like", vocab_size=129280, dim=7168, n_layers=61, n_heads=128,
                                  n_kv_heads=8, attn_head_dim=96, ffn_dim=18432, max_seq_len=4096, n_experts=256,
                                  top_k=8, moe_ffn_dim=2048, n_shared_experts=1, n_dense_layers=3, router="sigmoid",
                                  aux_loss_coeff=1e-4, bias_update_rate=1e-3),
}


def get_preset(name: str) -> ModelArgs:
    if name not in PRESETS:
        raise UserError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def model_args_for(cfg) -> ModelArgs:
    """The preset a run config names, with the shape overrides it gives (vocab_size, dim, n_layers, ffn_dim)
    and room for its sequence length."""
    import dataclasses

    from paratrain.models.hf_files import is_hf_model

    shape = {k: getattr(cfg, k) for k in ("vocab_size", "dim", "n_layers", "ffn_dim") if getattr(cfg, k) is not None}
    if is_hf_model(cfg.model):  # a transformers model's config.json: its own shape, no overrides
        from paratrain.models.hf_shape import hf_model_args

        if shape:  # only vocab_size has a flag; the others come from a --config TOML
            key = next(iter(shape))
            given = "--vocab-size or the --config TOML" if key == "vocab_size" else "the --config TOML"
            raise UserError(f"--model {cfg.model} takes its shape from its config.json; edit that instead of "
                            f"setting {key} in {given}")
        if getattr(cfg, "moe_capacity_factor", None):
            raise UserError(f"--moe-capacity-factor applies to paratrain's MoE presets; --model {cfg.model} routes "
                            "with transformers' own router, dropless")
        return hf_model_args(cfg.model, cfg.seq_len)
    args = get_preset(cfg.model)
    capacity = getattr(cfg, "moe_capacity_factor", None)
    if capacity is not None:
        if not args.moe:
            raise UserError(f"--moe-capacity-factor needs a Mixture-of-Experts model (e.g. --model moe-tiny); "
                            f"{args.name} has no experts")
        args = dataclasses.replace(args, capacity_factor=float(capacity))
    if shape:
        args = dataclasses.replace(args, name=f"{args.name}-custom", **shape)
        if args.dim % args.n_heads or args.head_dim % 2:
            raise UserError(f"dim {args.dim} must split into {args.n_heads} heads of an even size (RoPE)")
    if cfg.seq_len > args.max_seq_len:
        args = dataclasses.replace(args, max_seq_len=cfg.seq_len)
    return args


def build_model(args: ModelArgs, device: str | torch.device = "cpu", seed: int | None = 0,
                speed: ModelSpeed | None = None) -> Transformer:
    """Build on `device`; on "meta" nothing is allocated and no init runs (for shapes and planning). `speed`: how
    the model computes (models/speed.py; None: as it always did), the same parameters either way."""
    import torch

    from paratrain.models.llama import Transformer
    from paratrain.models.speed import ModelSpeed

    speed = speed or ModelSpeed()
    with torch.device(device):
        if args.family == "gpt2":
            from paratrain.models.gpt2 import GPT2

            model = GPT2(args, speed)
        elif args.moe:
            from paratrain.models.moe import MoETransformer

            model = MoETransformer(args, speed)
        else:
            model = Transformer(args, speed)
    if str(device) != "meta" and seed is not None:
        model.init_weights(seed)
    return model


def count_params(args: ModelArgs, include_embedding: bool = True, active: bool = False) -> int:
    """Every parameter; active=True: those one token uses (of an MoE layer's experts only its top-k)."""
    if args.family == "gpt2":
        return count_gpt2_params(args, include_embedding)
    d, h = args.dim, args.head_dim
    attn = d * args.n_heads * h * 2 + d * args.kv_heads * h * 2
    moe_layers = args.n_layers - args.n_dense_layers if args.moe else 0
    per_expert = 3 * d * args.expert_dim
    routed = args.top_k if active else args.n_experts
    moe_mlp = d * args.n_experts + (routed + args.n_shared_experts) * per_expert
    mlp = (args.n_layers - moe_layers) * 3 * d * args.ffn_dim + moe_layers * moe_mlp
    total = args.n_layers * (attn + 2 * d) + mlp + d + args.vocab_size * d
    # a tied head is the token table (Qwen2-0.5B, Llama-3.2-1B): one matrix, counted once
    return total + (args.vocab_size * d if include_embedding and not args.tie_embeddings else 0)


def expert_params(args: ModelArgs) -> int:
    """The routed experts' parameters (what --ep splits)."""
    return (args.n_layers - args.n_dense_layers) * args.n_experts * 3 * args.dim * args.expert_dim if args.moe else 0


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token; of an MoE layer only the top-k experts a token reaches count."""
    attention = 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6.0 * count_params(args, include_embedding=False, active=True) + attention
