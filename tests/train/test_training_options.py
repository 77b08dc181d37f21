"""The training options (issue 52): --optimizer, --betas, --eps, --momentum, --weight-decay, --grad-clip,
--lr-schedule, --warmup-steps, --min-lr, --loss-scale-init, --loss-scale-window.

References: updates computed by hand here (SGD with momentum and weight decay over two steps; one Adam and one
AdamW step; a trainer step with and without clipping) and every schedule's learning rate written out here from
its definition (paratrain's own; DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle from
deepspeed/runtime/lr_schedules.py, with its engine's one-step offset). The defaults against the code they
replaced: the same AdamW, GradScaler and learning rates, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.config import TrainConfig, load_config
from paratrain.errors import UserError
from paratrain.train.hooks import Hooks
from paratrain.train.lr_schedules import check_schedule, lr_at_step
from paratrain.train.optim import (
    build_optimizer,
    build_run_optimizer,
    check_optimizer_options,
    loss_scaler,
    lr_at,
)
from paratrain.train.optimizer_graph import check_optimizer_graph


def test_two_sgd_steps_with_momentum_and_weight_decay_are_the_hand_computed_updates():
    lr, momentum, decay = 0.1, 0.9, 0.01
    p0, g1, g2 = [1.0, -2.0, 0.5], [0.5, 0.25, -1.0], [-0.5, 1.0, 2.0]
    p = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
    opt = build_optimizer([p], lr, (0.9, 0.95), decay, "cpu", kind="sgd", momentum=momentum)
    p.grad = torch.tensor(g1, dtype=torch.float64)
    opt.step()
    buf = [g + decay * w for g, w in zip(g1, p0)]  # L2 into the gradient; the first step's buffer is that gradient
    p1 = [w - lr * b for w, b in zip(p0, buf)]
    assert p.detach().tolist() == pytest.approx(p1, rel=1e-12)
    p.grad = torch.tensor(g2, dtype=torch.float64)
    opt.step()
    buf = [momentum * b + g + decay * w for b, g, w in zip(buf, g2, p1)]
    assert p.detach().tolist() == pytest.approx([w - lr * b for w, b in zip(p1, buf)], rel=1e-12)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_one_adam_step_is_the_hand_computed_update_with_its_betas_eps_and_weight_decay(kind):
    lr, betas, eps, decay = 0.1, (0.8, 0.9), 0.25, 0.5  # eps this large moves the result far from sign(g)
    p0, g = [1.0, -2.0], [0.5, -0.125]
    p = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
    opt = build_optimizer([p], lr, betas, decay, "cpu", kind=kind, eps=eps)
    p.grad = torch.tensor(g, dtype=torch.float64)
    opt.step()
    if kind == "adam":  # L2: the decay joins the gradient, then the moments
        d = [gi + decay * w for gi, w in zip(g, p0)]
        want = [w - lr * di / (abs(di) + eps) for w, di in zip(p0, d)]
    else:  # decoupled: the weights shrink by lr x decay, the moments see the plain gradient
        want = [w * (1 - lr * decay) - lr * gi / (abs(gi) + eps) for w, gi in zip(p0, g)]
    # step 1, bias-corrected: m_hat = d, v_hat = d^2
    assert p.detach().tolist() == pytest.approx(want, rel=1e-12)


@pytest.fixture(scope="module")
def rt():
    from reliability.inproc import one_rank

    with one_rank() as runtime:
        yield runtime


def sgd_step(rt, grad_clip: float):
    """One SGD trainer step on the tiny model at a constant lr: (loss, grad_norm, the gradients before clipping,
    the parameters before and after)."""
    from paratrain.train.trainer import Trainer
    from reliability.inproc import tiny_config

    cfg = tiny_config(optimizer="sgd", lr=0.5, lr_schedule="constant", warmup_steps=0, grad_clip=grad_clip)
    hooks, seen = Hooks(), {}
    hooks.on_gradients(lambda t: seen.update(grads=[p.grad.detach().clone() for p in t.params]))
    t = Trainer(cfg, rt, None, quiet=True, hooks=hooks)
    before = [p.detach().clone() for p in t.params]
    record = t.train_step(t.source.next_step())
    return record, seen["grads"], before, [p.detach().clone() for p in t.params]


@pytest.mark.parametrize("grad_clip", [0.0, 0.01])
def test_a_trainer_step_clips_to_grad_clip_and_0_turns_it_off(rt, grad_clip):
    record, grads, before, after = sgd_step(rt, grad_clip)
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    assert float(record["grad_norm"]) == pytest.approx(norm, rel=1e-5)
    coef = 1.0 if grad_clip == 0 else grad_clip / (norm + 1e-6)  # torch's clip_grads_with_norm_
    assert norm > 0.01 * 10  # the clip is active at 0.01: the two cases differ
    for g, w0, w1 in zip(grads, before, after, strict=True):
        torch.testing.assert_close(w1, w0 - 0.5 * coef * g, rtol=1e-5, atol=1e-7)


def test_the_clip_changes_the_update_and_nothing_before_it(rt):
    off, on = sgd_step(rt, 0.0), sgd_step(rt, 0.01)
    assert off[0]["loss"] == on[0]["loss"] and float(off[0]["grad_norm"]) == float(on[0]["grad_norm"])
    assert not torch.equal(off[3][0], on[3][0])


def cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"steps": 24, "lr": 0.01, **kw})


# -- each schedule against its definition, written out here -----------------------------------------------------
def paratrain_warmup(s, peak, warmup):
    return peak * (s + 1) / warmup


def cosine(s, peak=0.01, floor=0.001, warmup=5, total=24):
    if s < warmup:
        return paratrain_warmup(s, peak, warmup)
    t = min(1.0, (s - warmup) / (total - warmup))
    return floor + (peak - floor) * (1 + math.cos(math.pi * t)) / 2


def linear(s, peak=0.01, floor=0.002, warmup=4, total=24):
    if s < warmup:
        return paratrain_warmup(s, peak, warmup)
    return floor + (peak - floor) * (1 - min(1.0, (s - warmup) / (total - warmup)))


def deepspeed_warmup(i, warmup, kind):
    return math.log(i + 1) / math.log(warmup) if kind == "log" else i / warmup


def warmup_lr(s, low=0.001, peak=0.01, warmup=6, kind="log"):
    """WarmupLR: optimizer step s runs at the scheduler's iteration s - 1; before the first, warmup_min_lr."""
    i = s - 1
    if i < 0:
        return low
    gamma = deepspeed_warmup(i, warmup, kind) if i < warmup else 1.0
    return low + (peak - low) * gamma


def warmup_decay(s, low=0.001, peak=0.01, warmup=6, total=24, kind="log"):
    i = s - 1
    if i < 0:
        return low
    gamma = deepspeed_warmup(i, warmup, kind) if i < warmup else max(0.0, (total - i) / (total - warmup))
    return low + (peak - low) * gamma


def warmup_cosine(s, peak=0.01, start=0.1, end=0.05, warmup=6, total=24, kind="linear"):
    """WarmupCosineLR: 0 before its first iteration; ratios of the optimizer's lr."""
    i = s - 1
    if i < 0:
        return 0.0
    if i < warmup:
        return peak * (start + (1 - start) * deepspeed_warmup(i, warmup, kind))
    return peak * max(0.0, end + (1 - end) * (1 + math.cos(math.pi * (i - warmup + 1) / (total - warmup))) / 2)


def one_cycle(s, low=0.001, peak=0.01, up=4, down=6, rate=0.5, every=3):
    """OneCycle: up over `up` iterations, down over `down`, then low / (1 + rate x (iterations past) / every)."""
    i = s - 1
    if i < 0:
        return low
    if i < up + down:
        k = i + 1  # iterations done after this one: at k = up the peak, at k = up + down back at low
        return low + (peak - low) * (k / up if k <= up else (up + down - k) / down)
    return low / (1 + rate * (i - (up + down) + 1) / every)


SCHEDULES = [
    ("cosine", {"min_lr": 0.001}, cosine),
    ("linear", {"min_lr": 0.002, "warmup_steps": 4}, linear),
    ("constant", {"warmup_steps": 3}, lambda s: paratrain_warmup(s, 0.01, 3) if s < 3 else 0.01),
    ("warmup-log", {"min_lr": 0.001, "warmup_steps": 6}, warmup_lr),
    ("warmup-log", {"min_lr": 0.001, "warmup_steps": 6, "warmup_type": "linear"},
     lambda s: warmup_lr(s, kind="linear")),
    ("warmup-decay", {"min_lr": 0.001, "warmup_steps": 6}, warmup_decay),
    ("cosine", {"warmup_type": "linear", "warmup_steps": 6, "warmup_start_ratio": 0.1, "min_lr_ratio": 0.05},
     warmup_cosine),
    ("cosine", {"warmup_type": "log", "warmup_steps": 6, "warmup_start_ratio": 0.1, "min_lr_ratio": 0.05},
     lambda s: warmup_cosine(s, kind="log")),
    ("one-cycle", {"min_lr": 0.001, "warmup_steps": 4, "cooldown_steps": 6, "decay_lr_rate": 0.5,
                   "decay_step_size": 3}, one_cycle),
]


@pytest.mark.parametrize(("name", "options", "formula"), SCHEDULES,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(SCHEDULES)])
def test_each_schedule_gives_its_formula_at_every_step(name, options, formula):
    c = cfg(lr_schedule=name, **options)
    check_schedule(c)
    got = [lr_at_step(c, s) for s in range(24)]
    assert got == pytest.approx([formula(s) for s in range(24)], rel=1e-12, abs=1e-15)
    assert len(set(got)) >= 3  # the schedule moves


def test_the_default_schedule_and_optimizer_are_the_ones_before_the_options_bit_for_bit():
    c = TrainConfig()
    assert [lr_at_step(c, s) for s in range(c.steps)] == [lr_at(s, 3e-3, 5, c.steps, 0.1) for s in range(c.steps)]
    assert [lr_at_step(c, s) for s in (0, 10, 199)] == pytest.approx([cosine(s, 3e-3, 3e-4, 5, 200) for s in (0, 10, 199)],
                                                                     rel=1e-12)
    p = torch.nn.Parameter(torch.ones(2))
    opt = build_run_optimizer([p], c, "cpu")
    before = torch.optim.AdamW([p], lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
    assert type(opt) is torch.optim.AdamW
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == \
        {k: v for k, v in before.param_groups[0].items() if k != "params"}
    assert loss_scaler(c, "cpu") is None and c.grad_clip == 1.0
    assert loss_scaler(cfg(dtype="fp16"), "cpu").state_dict() == torch.amp.GradScaler("cpu").state_dict()


def test_loss_scale_options_set_the_scalers_start_and_window():
    state = loss_scaler(cfg(dtype="fp16", loss_scale_init=1024.0, loss_scale_window=7), "cpu").state_dict()
    assert (state["scale"], state["growth_interval"]) == (1024.0, 7)


def test_old_beta_keys_still_load_and_a_flag_beside_them_wins(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text("beta1 = 0.8\nbeta2 = 0.99\nwarmup_steps = 2\n")
    assert load_config(str(old), {}).adam_betas == (0.8, 0.99)
    assert load_config(str(old), {"betas": "0.7,0.9"}).adam_betas == (0.7, 0.9)
    assert TrainConfig(betas=[0.85, 0.9]).betas == "0.85,0.9"  # a TOML list is the same
    both = tmp_path / "both.toml"
    both.write_text('beta1 = 0.8\nbetas = "0.9,0.99"\n')
    with pytest.raises(UserError, match="both betas and the older beta1/beta2"):
        load_config(str(both), {})


@pytest.mark.parametrize(("options", "check", "message"), [
    ({"momentum": 0.9}, check_optimizer_options, "--momentum applies to --optimizer sgd"),
    ({"optimizer": "sgd", "betas": "0.9,0.99"}, check_optimizer_options, "--betas and --eps apply to"),
    ({"dtype": "bf16", "loss_scale_init": 8.0}, check_optimizer_options, "apply to --dtype fp16"),
    ({"lr_schedule": "linear", "warmup_type": "log"}, check_schedule, "warmup_type applies to"),
    ({"lr_schedule": "cosine", "cooldown_steps": 3}, check_schedule, "cooldown_steps applies to"),
    ({"lr_schedule": "one-cycle", "warmup_steps": 0}, check_schedule, "needs --warmup-steps >= 1"),
    ({"optimizer": "sgd", "optimizer_graph": True}, lambda c: check_optimizer_graph(c, None), "fused Adam"),
])
def test_an_option_the_run_would_ignore_is_refused_in_one_line(options, check, message):
    with pytest.raises(UserError, match=message) as err:
        check(cfg(**options))
    assert "\n" not in str(err.value)


def test_a_refused_combination_exits_2_before_anything_runs(cli_inproc):
    res = cli_inproc("train", "--optimizer", "adam", "--momentum", "0.9", "--nproc", "1", "--strategy", "single")
    assert res.returncode == 2 and "--momentum applies to --optimizer sgd" in res.stderr


def test_the_planner_sizes_optimizer_state_by_the_optimizer_and_repeats_it_in_the_command():
    """AdamW keeps two moments per parameter, SGD one momentum buffer or none; nothing else changes."""
    from paratrain.plan.plan_cli import build_plan_inputs
    from paratrain.plan.plan_report import candidate_doc
    from paratrain.plan.search import search

    found = {}
    for optimizer, momentum in (("adamw", None), ("sgd", None), ("sgd", 0.9)):
        job, hw, fixed, _ = build_plan_inputs({"model": "tiny", "gpu": "h100-sxm", "gpus": 2, "strategy": "zero1",
                                               "optimizer": optimizer, "momentum": momentum})
        best = search(job, hw, fixed)[0][0]
        found[(optimizer, momentum)] = (best.memory, candidate_doc(job, hw, best)["command"])
    adamw, sgd, sgd_momentum = (found[k][0] for k in (("adamw", None), ("sgd", None), ("sgd", 0.9)))
    assert sgd.optimizer == 0 and sgd_momentum.optimizer == pytest.approx(adamw.optimizer / 2, rel=1e-3)
    assert (sgd.params, sgd.activations) == (adamw.params, adamw.activations)
    assert found[("sgd", 0.9)][1].endswith("--optimizer sgd --momentum 0.9")
    assert "--optimizer" not in found[("adamw", None)][1]
    with pytest.raises(UserError, match="--momentum applies to --optimizer sgd"):
        build_plan_inputs({"model": "tiny", "gpu": "h100-sxm", "gpus": 2, "optimizer": "adam", "momentum": 0.5})


def test_plan_takes_every_training_option_checks_it_and_passes_it_on_to_the_candidates_command(cli_here):
    """The options that price nothing (schedule, clipping, betas, ...) are plan flags too: checked as train checks
    them and repeated in each candidate's command, so the candidate trains as asked; the prediction is the same."""
    base = ["plan", "--model", "tiny", "--gpu", "h100-sxm", "--gpus", "2", "--top", "1", "--json"]
    plain = cli_here(*base)
    given = cli_here(*base, "--grad-clip", "0", "--lr-schedule", "linear", "--warmup-steps", "3", "--betas",
                     "0.8,0.9", "--weight-decay", "0.1")
    assert plain.returncode == 0 and given.returncode == 0, given.stderr
    before, after = plain.json()["candidates"][0], given.json()["candidates"][0]
    assert after["command"] == before["command"] + (" --betas 0.8,0.9 --weight-decay 0.1 --grad-clip 0.0 "
                                                    "--lr-schedule linear --warmup-steps 3")
    assert (after["memory_gib"], after["step_time_s"]) == (before["memory_gib"], before["step_time_s"])
    bad = cli_here(*base, "--lr-schedule", "wavy")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "lr_schedule" in bad.stderr


class OneRankDataParallel:
    """The part of a Layout ZeRO-1 reads: its data-parallel group (here the one-rank world) and size."""

    dp = 1

    def submesh(self, name):
        import torch.distributed as dist

        return type("Mesh", (), {"get_group": staticmethod(lambda: dist.group.WORLD)})


def test_zero1_checkpoints_sgds_momentum_buffers(rt):
    """ZeRO-1's collective state_dict() broadcasts each parameter's state by name: SGD's are not AdamW's."""
    from paratrain.parallel.dp.data_parallel import build_zero1_optimizer

    def zero1(params):
        return build_zero1_optimizer(params, (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}),
                                     OneRankDataParallel(), "cpu")

    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    first = zero1(params)
    for p in params:
        p.grad = torch.ones_like(p)
    first.step()
    state = first.state_dict()["state"]
    assert len(state) == 2 and all(set(entry) == {"momentum_buffer"} for entry in state.values())
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    second = zero1(copies)
    second.load_state_dict(first.state_dict())
    for p, q in zip(params, copies, strict=True):
        assert torch.equal(second.optim.state[q]["momentum_buffer"], first.optim.state[p]["momentum_buffer"])
