"""The plain model: shapes, parameter counts, meta-device builds, and equivalences the strategies rely on."""

import torch

from paratrain.models.llama import ModelArgs, apply_rope, rope_tables
from paratrain.models.presets import PRESETS, build_model, count_params, flops_per_token


def test_presets_match_published_shapes():
    l3 = PRESETS["llama3-8b"]
    assert (l3.dim, l3.ffn_dim, l3.n_layers, l3.n_heads, l3.kv_heads, l3.vocab_size) == (4096, 14336, 32, 32, 8, 128256)
    l2 = PRESETS["llama2-70b"]
    assert (l2.dim, l2.ffn_dim, l2.n_layers, l2.n_heads, l2.kv_heads, l2.vocab_size) == (8192, 28672, 80, 64, 8, 32000)
    g = PRESETS["llama-162m"]
    assert (g.n_layers, g.dim, g.n_heads, g.vocab_size) == (12, 768, 12, 50304)


def test_large_presets_build_on_meta_and_count_matches():
    for name in ("llama3-8b", "llama2-70b", "llama-162m", "tiny"):
        model = build_model(PRESETS[name], "meta")
        assert all(p.is_meta for p in model.parameters())
        assert sum(p.numel() for p in model.parameters()) == count_params(PRESETS[name])
    # Llama 3 8B is published as 8.03B parameters
    assert abs(count_params(PRESETS["llama3-8b"]) / 1e9 - 8.03) < 0.01


def test_flops_convention():
    args = PRESETS["tiny"]
    n = count_params(args, include_embedding=False)
    assert n == count_params(args) - args.vocab_size * args.dim
    assert flops_per_token(args, 64) == 6 * n + 12 * args.n_layers * args.dim * 64


def test_forward_is_causal_and_deterministic():
    args = ModelArgs(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
    a, b = build_model(args, seed=3), build_model(args, seed=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    x = torch.randint(0, 50, (2, 12))
    y = a(x)
    assert y.shape == (2, 12, 50)
    x2 = x.clone()
    x2[:, 8:] = (x2[:, 8:] + 1) % 50  # changing the future must not change the past
    torch.testing.assert_close(a(x2)[:, :8], y[:, :8], rtol=0, atol=0)


def test_explicit_positions_equal_default_positions():
    args = ModelArgs(vocab_size=50, dim=32, n_layers=1, n_heads=4, ffn_dim=64)
    model = build_model(args, seed=0)
    x = torch.randint(0, 50, (1, 10))
    torch.testing.assert_close(model(x), model(x, positions=torch.arange(10)), rtol=0, atol=0)


def test_rope_rotation_preserves_norm_and_relative_angle():
    cos, sin = rope_tables(8, torch.arange(6), 10000.0)
    q = torch.randn(1, 6, 2, 8)
    rq = apply_rope(q, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1), rtol=1e-5, atol=1e-6)
    # <R(m)q, R(n)k> depends only on m - n
    k = torch.randn(8)
    qv, kv = q[0, 0, 0], k
    def at(m, n):
        cq, sq = rope_tables(8, torch.tensor([m]), 10000.0)
        rq = apply_rope(qv.view(1, 1, 1, 8), cq, sq)
        rk = apply_rope(kv.view(1, 1, 1, 8), *rope_tables(8, torch.tensor([n]), 10000.0))
        return float((rq * rk).sum())
    assert abs(at(5, 2) - at(13, 10)) < 1e-4


def test_rope_tables_are_fp32_and_close_to_fp64():
    """fp32 tables (no fp64 kernels on GPUs); reference: the same angles in fp64, at Llama 3's 8k positions."""
    positions = torch.arange(8192)
    cos, sin = rope_tables(128, positions, 500000.0)
    assert cos.dtype == sin.dtype == torch.float32
    exponent = torch.arange(0, 128, 2, dtype=torch.float64) / 128
    angles = positions.double()[:, None] / 500000.0 ** exponent
    assert (cos.double() - angles.cos()).abs().max() < 1e-3 and (sin.double() - angles.sin()).abs().max() < 1e-3
