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


def test_tied_embedding_shares_the_table():
    model = build_model(dataclasses.replace(get_preset("gpt2-tiny"), tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.tokens.weight


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
