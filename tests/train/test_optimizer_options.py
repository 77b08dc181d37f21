"""--optimizer-graph (train/optimizer_graph.py) and --bf16-param-copies (train/param_copies.py, models/weight_copies.py).

References: the folded step against the unfolded clip-then-step of the same fused AdamW (bit-identical without
clipping; with clipping g / (1/c) against g * c, within fp32 rounding: 2e-6 relative in the parameters); the bf16
copies against a run without them (bit-identical: they hold exactly autocast's casts) and against the masters cast
to bf16 after every step. Both flags pass verify on 2 ranks in the suite's shared group (tests/groups.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from groups import verified
from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.models.presets import build_model, get_preset
from paratrain.parallel.strategies import resolve_layout
from paratrain.train.optim import build_optimizer
from paratrain.train.optimizer_graph import OptimizerGraph, check_optimizer_graph
from paratrain.train.param_copies import ParamCopies
from paratrain.train.step import clip_grad_norm
from paratrain.train.trainer import Trainer
from paratrain.train.validate import validate_run
from reliability.inproc import one_rank

CPU = torch.device("cpu")


def stepped(max_norm: float, folded: bool, steps: int = 3) -> list[torch.Tensor]:
    """gpt2-tiny's parameters after `steps` AdamW steps on seeded gradients, clipped to max_norm (0: off)."""
    params = [p.detach().clone().requires_grad_() for p in build_model(get_preset("gpt2-tiny"), seed=1).parameters()]
    opt = build_optimizer(params, 1e-2, (0.9, 0.95), 0.1, "cpu", optimizer_graph=True)
    graph = OptimizerGraph([opt], max_norm, CPU) if folded else None
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if folded:
            graph.step(clip_grad_norm(params, 0.0))
        else:
            clip_grad_norm(params, max_norm)
            opt.step()
    return [p.detach() for p in params]


def test_folded_step_is_bit_identical_to_clip_then_step_when_nothing_is_clipped():
    big = 1e6  # far above the gradients' norm: the coefficient is exactly 1
    assert all(torch.equal(a, b) for a, b in zip(stepped(big, True), stepped(big, False), strict=True))


def test_folded_step_matches_clip_then_step_when_clipping():
    clipped, unclipped = stepped(0.5, False), stepped(0.0, False)
    folded = stepped(0.5, True)
    # the clip changes the result far beyond the tolerance, so the comparison below sees whether it was folded in
    assert max(float((a - b).abs().max()) for a, b in zip(clipped, unclipped, strict=True)) > 1e-4
    for a, b in zip(folded, clipped, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


@pytest.fixture(scope="module")
def rt():
    with one_rank() as runtime:  # the world-1 group's RANK / WORLD_SIZE leave with the module
        yield runtime


def trainer(rt, **overrides) -> Trainer:
    base = {"model": "gpt2-tiny", "strategy": "single", "nproc": 1, "device": "cpu", "steps": 3, "seq_len": 16,
            "global_batch": 2, "resume": "never", "warmup_steps": 1, "metrics": False}
    return Trainer(TrainConfig(**{**base, **overrides}), rt, quiet=True)


def test_the_trainer_folds_the_clip_instead_of_a_pass_over_the_gradients(rt, monkeypatch):
    calls = []
    clip = torch.nn.utils.clip_grads_with_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: calls.append(1) or clip(*a, **k))
    losses = {}
    for flag in (False, True):
        calls.clear()
        t = trainer(rt, optimizer_graph=flag, grad_clip=0.05)
        losses[flag] = [t.train_step(t.source.next_step())["loss"] for _ in range(3)]
        assert len(calls) == (0 if flag else 3)
        if flag:
            assert float(t.optimizer_graph.grad_scale) > 1.0  # the clip was active: 1 / coefficient
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_a_checkpoint_saved_without_the_flag_resumes_with_it():
    """torch's load_state_dict takes the saved groups' fused/foreach over; the foreach path refuses a grad_scale."""
    model = build_model(get_preset("gpt2-tiny"), seed=1)
    plain = build_optimizer(list(model.parameters()), 1e-2, (0.9, 0.95), 0.0, "cpu")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    plain.step()
    opt = build_optimizer(list(model.parameters()), 1e-2, (0.9, 0.95), 0.0, "cpu", optimizer_graph=True)
    opt.load_state_dict(plain.state_dict())
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    OptimizerGraph([opt], 0.5, CPU).step(clip_grad_norm(list(model.parameters()), 0.0))


class WeightCasts(TorchDispatchMode):
    """Counts fp32 -> bf16 casts of 1-D and 2-D tensors: weights, biases and their concatenations (--fused-qkv's);
    the activations here are 3-D and 4-D."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32 and \
                kwargs.get("dtype") == torch.bfloat16 and args[0].dim() <= 2:
            self.count += 1
        return func(*args, **kwargs)


def forward_casts(model) -> int:
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16), WeightCasts() as counter:
        model(tokens)
    return counter.count


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_the_forward_reads_the_copies_and_casts_no_weight(rt, fused_qkv):
    plain = trainer(rt, dtype="bf16", fused_qkv=fused_qkv).step_runner.model_parts[0]
    copied = trainer(rt, dtype="bf16", fused_qkv=fused_qkv, bf16_param_copies=True).step_runner.model_parts[0]
    linears = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    # each linear's weight (and bias), or the concatenated q/k/v weight and bias
    assert forward_casts(plain) >= linears - (2 * get_preset("gpt2-tiny").n_layers if fused_qkv else 0)
    assert forward_casts(copied) == 0


def test_copies_are_the_masters_in_bf16_after_every_step_and_change_nothing(rt):
    args = get_preset("gpt2-tiny")
    plain, copied = trainer(rt, dtype="bf16"), trainer(rt, dtype="bf16", bf16_param_copies=True)
    copies = copied.param_copies
    linears = [m for m in copied.step_runner.model_parts[0].modules() if isinstance(m, torch.nn.Linear)]
    # every linear's weight and bias, the head's (the tied token table) among them, once each: 2 bytes an element
    unique = {id(p): p.numel() for m in linears for p in (m.weight, m.bias) if p is not None}
    assert any(m.weight.shape == (args.vocab_size, args.dim) for m in linears)
    assert copies.nbytes() == 2 * sum(unique.values())
    for _ in range(3):
        ref, out = plain.train_step(plain.source.next_step()), copied.train_step(copied.source.next_step())
        assert out["loss"] == ref["loss"]  # bit-identical: the copies are exactly autocast's casts
        assert all(torch.equal(c, m.detach().to(torch.bfloat16)) for c, m in zip(copies.copies, copies.masters))
    assert all(torch.equal(a, b) for a, b in zip(plain.params, copied.params, strict=True))


def test_a_parameter_changed_elsewhere_is_copied_again_before_the_forward(rt):
    """A checkpoint load (or a healed replica) writes the masters in place: the next forward sees the new values."""
    t = trainer(rt, dtype="bf16", bf16_param_copies=True)
    model = t.step_runner.model_parts[0]
    fresh = build_model(get_preset("gpt2-tiny"), seed=7).state_dict()
    model.load_state_dict(fresh)
    assert not all(torch.equal(c, m.detach().to(torch.bfloat16)) for c, m in zip(t.param_copies.copies,
                                                                                 t.param_copies.masters))
    forward_casts(model)
    assert all(torch.equal(c, m.detach().to(torch.bfloat16)) for c, m in zip(t.param_copies.copies,
                                                                             t.param_copies.masters))


def test_copies_leave_names_and_state_dict_unchanged():
    model = build_model(get_preset("gpt2-tiny"), seed=1)
    names = list(model.state_dict())
    ParamCopies([model])
    assert list(model.state_dict()) == names
    assert all(t.dtype == torch.float32 for t in model.state_dict().values())


@pytest.mark.parametrize("overrides, words", [
    ({"optimizer_graph": True, "dtype": "fp16"}, "--optimizer-graph is not supported with --dtype fp16"),
    ({"optimizer_graph": True, "strategy": "zero1"}, "--optimizer-graph is not supported with zero1"),
    ({"bf16_param_copies": True, "dtype": "bf16", "strategy": "zero3"}, "MixedPrecisionPolicy(param_dtype=bf16)"),
    ({"bf16_param_copies": True, "dtype": "bf16", "strategy": "tp"}, "--bf16-param-copies is not supported with "
                                                                     "tensor parallelism (tp=2)"),
])
def test_where_a_flag_cannot_apply_it_is_refused_in_one_line(overrides, words):
    cfg = TrainConfig(**{"strategy": "ddp", "nproc": 2, "device": "cpu", **overrides})
    with pytest.raises(UserError) as err:
        validate_run(cfg, 2)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_optimizer_graph_with_cpu_offload_is_refused_in_one_line():
    """(On a CUDA run: a CPU run refuses --cpu-offload itself, first.)"""
    cfg = TrainConfig(strategy="zero3", nproc=2, device="cpu", optimizer_graph=True, cpu_offload=True)
    with pytest.raises(UserError, match="^--optimizer-graph is not supported with --cpu-offload[^\n]*$"):
        check_optimizer_graph(cfg, resolve_layout(cfg, 2))


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", ["speed-optimizer-graph-ddp", "speed-bf16-param-copies-ddp"])
def test_optimizer_options_pass_verify_on_two_ranks(two_ranks, case):
    report = verified(two_ranks, case)
    assert report["passed"] is True, report
    assert report["world_size"] == 2
