"""The GPT-2-style model: shapes, parameter count, tied embedding, deterministic init, and it trains."""

from __future__ import annotations

import dataclasses

import torch

from paratrain.models.gpt2 import GPT2
from paratrain.models.presets import build_model, count_params, get_preset


def test_parameter_count_matches_the_module():
    for tie in (False, True):
        args = dataclasses.replace(get_preset("gpt2-tiny"), tie_embeddings=tie)
        model = build_model(args, "meta", seed=None)
        assert isinstance(model, GPT2)
        assert sum(p.numel() for p in model.parameters()) == count_params(args)


def test_gpt2_124m_is_gpt2_small_counted_by_the_model_itself():
    """GPT-2 small has 124,439,808 parameters (its vocabulary of 50257, tied); padded to 50304: 124,475,904."""
    args = get_preset("gpt2-124m")
    assert (args.family, args.tie_embeddings, args.vocab_size, args.ffn_dim) == ("gpt2", True, 50304, 3072)
    for vocab, expected in ((50304, 124_475_904), (50257, 124_439_808)):
        model = build_model(dataclasses.replace(args, vocab_size=vocab), "meta", seed=None)
        assert sum(p.numel() for p in model.parameters()) == expected
        assert count_params(dataclasses.replace(args, vocab_size=vocab)) == expected
    # the Llama-shaped model that used to carry the name keeps a name that says what it is
    llama = build_model(get_preset("llama-162m"), "meta", seed=None)
    assert round(sum(p.numel() for p in llama.parameters()) / 1e6) == 162


def test_key_bias_is_there_but_frozen():
    """Softmax cancels a key bias (its true gradient is 0): GPT-2's parameter is kept, not trained."""
    model = build_model(get_preset("gpt2-tiny"), seed=0)
    wk = model.layers["0"].attention.wk
    assert wk.bias is not None and not wk.bias.requires_grad and wk.weight.requires_grad
    tokens = torch.randint(0, 256, (2, 9))
    logits = model(tokens)
    with torch.no_grad():
        wk.bias.add_(torch.randn_like(wk.bias))
    torch.testing.assert_close(model(tokens), logits, rtol=1e-5, atol=1e-5)  # no output changes


def test_tied_embedding_shares_the_table():
    model = build_model(get_preset("gpt2-tiny"))
    assert model.output.weight is model.tok_embeddings.tokens.weight
    untied = build_model(dataclasses.replace(get_preset("gpt2-tiny"), tie_embeddings=False))
    assert untied.output.weight is not untied.tok_embeddings.tokens.weight


def test_init_is_deterministic_and_forward_has_the_right_shape():
    args = get_preset("gpt2-tiny")
    a, b = build_model(args, seed=3), build_model(args, seed=3)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    assert a(tokens).shape == (2, 16, args.vocab_size)
    # positions select the learned position rows (context parallel passes global positions)
    assert a(tokens[:, 8:], positions=torch.arange(8, 16)).shape == (2, 8, args.vocab_size)


def test_it_trains():
    torch.manual_seed(0)
    args = get_preset("gpt2-tiny")
    model = build_model(args, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 16, (8, 33))  # a small alphabet: learnable fast
    losses = []
    for _ in range(30):
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0
