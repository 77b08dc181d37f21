"""--semi-sync's checks in the shared 4-rank group (tests/groups.py; tests/parallel/test_semi_sync.py asserts on
them): its exact reductions to DDP and to local SGD, Streaming DiLoCo's reduction to DiLoCo, a resume that
restores the outer loop exactly, and islands that end with bit-identical global parameters.

The references: DDP over the 4 ranks and `--local-sgd-period` (torch's PostLocalSGD) over them, with a linear inner
optimizer (--optimizer sgd, no momentum, --grad-clip 0), for which the reductions are exact up to rounding; an
uninterrupted run of the same config for the resume.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from paratrain.config import TrainConfig
from paratrain.train.recovery import checkpoint as ckpt
from paratrain.train.trainer import Trainer
from paratrain.verify.recorder import full_tensors

ISLANDS_2X2 = {"strategy": "hsdp", "dp_replicate": 2, "dp_shard": 2}
LINEAR_INNER = {"optimizer": "sgd", "momentum": 0.0, "grad_clip": 0.0, "lr": 0.5}
H1_AS_DDP = {"semi_sync": "diloco", "sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}


def config(rt, **overrides) -> TrainConfig:
    base = {"strategy": "ddp", "nproc": rt.world_size, "device": "cpu", "steps": 4, "seq_len": 32, "metrics": False,
            "resume": "never", "timeout_s": 120.0}
    return TrainConfig(**{**base, **overrides})


def train(rt, run_steps: int | None = None, **overrides) -> tuple[Trainer, list[float]]:
    """A trainer of this config, stepped `run_steps` times (default: its --steps), and its losses."""
    trainer = Trainer(config(rt, **overrides), rt, quiet=True)
    count = trainer.cfg.steps if run_steps is None else run_steps
    losses = [trainer.train_step(trainer.source.next_step())["loss"] for _ in range(count)]
    return trainer, losses


def largest_difference(a: Trainer, b: Trainer) -> float:
    """The largest |difference| of the two runs' whole parameters, over every rank."""
    pa, pb = full_tensors(a.step_runner.model_parts, "param"), full_tensors(b.step_runner.model_parts, "param")
    local = max(float((pa[n] - pb[n]).abs().max()) for n in pa)
    return all_ranks_max(local)


def all_ranks_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def loss_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def reductions_to_ddp(rt) -> dict:
    """H = 1 with an outer SGD of lr 1, momentum 0 against DDP; the same with the default outer step (must differ)."""
    ddp, ddp_losses = train(rt, **LINEAR_INNER)
    exact, exact_losses = train(rt, **LINEAR_INNER, **ISLANDS_2X2, **H1_AS_DDP)
    nesterov, _ = train(rt, **LINEAR_INNER, **ISLANDS_2X2, semi_sync="diloco", sync_every=1)
    return {"h1_param_diff": largest_difference(ddp, exact), "h1_loss_diff": loss_difference(ddp_losses, exact_losses),
            "h1_moved": largest_difference(ddp, train(rt, 0, **LINEAR_INNER)[0]),
            "nesterov_param_diff": largest_difference(ddp, nesterov)}


def reduction_to_local_sgd(rt, folder: str) -> dict:
    """H = k over 4 one-rank islands against --local-sgd-period k: both after the same DDP warm-up. PostLocalSGD
    all-reduces gradients for k steps, steps alone once, then averages (after step k + 1, then every k steps); the
    semi-sync run resumes from a DDP checkpoint at step k + 1 and syncs every k inner steps from there."""
    k, steps = 2, 7
    local_sgd, sgd_losses = train(rt, **LINEAR_INNER, steps=steps, local_sgd_period=k)
    warm, _ = train(rt, k + 1, **LINEAR_INNER, steps=steps, ckpt_dir=folder)
    warm.save_checkpoint()
    islands = Trainer(config(rt, **LINEAR_INNER, steps=steps, dp_replicate=4, semi_sync="diloco", sync_every=k,
                             outer_lr=1.0, outer_momentum=0.0, resume=os.path.join(folder, f"step-{k + 1}")),
                      rt, quiet=True)
    losses = islands.fit()["losses"]
    # a sync every k + 1 steps instead (off the local SGD's schedule): must differ
    off = Trainer(config(rt, **LINEAR_INNER, steps=steps, dp_replicate=4, semi_sync="diloco", sync_every=k + 1,
                         outer_lr=1.0, outer_momentum=0.0, resume=os.path.join(folder, f"step-{k + 1}")), rt, quiet=True)
    off.fit()
    return {"hk_param_diff": largest_difference(local_sgd, islands),
            "hk_loss_diff": loss_difference(sgd_losses[k + 1:], losses[-(steps - k - 1):]),
            "off_schedule_param_diff": largest_difference(local_sgd, off)}


def streaming_one_fragment(rt) -> dict:
    """Streaming DiLoCo with one fragment and no delay against DiLoCo (default outer Nesterov step), and with
    two fragments (must differ)."""
    common = {**ISLANDS_2X2, "sync_every": 2, "steps": 6}
    diloco, diloco_losses = train(rt, **common, semi_sync="diloco")
    one, one_losses = train(rt, **common, semi_sync="streaming-diloco", fragments=1, fragment_delay=0)
    two, _ = train(rt, **common, semi_sync="streaming-diloco", fragments=2)
    return {"one_fragment_param_diff": largest_difference(diloco, one),
            "one_fragment_loss_diff": loss_difference(diloco_losses, one_losses),
            "two_fragments_param_diff": largest_difference(diloco, two)}


def outer_state(trainer: Trainer) -> list[torch.Tensor]:
    """This rank's global copy and outer momentum, cloned."""
    outer = trainer.outer_sync
    return [t.clone() for t in (*outer.global_copy, *outer.momentum_buffers())]


def islands_agree(trainer: Trainer) -> bool:
    """Whether every island holds bit-identical global copies (each rank against its counterparts)."""
    flat = torch.cat([g.flatten() for g in trainer.outer_sync.global_copy])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, flat)
    size = trainer.outer_sync.island_size
    return all(torch.equal(everyone[r], everyone[r % size]) for r in range(len(everyone)))


def resume_restores_outer_loop(rt, folder: str) -> dict:
    """Streaming DiLoCo, 2 fragments, delay 1, int4 outer all-reduce: saved at step 5 (fragment 0's all-reduce under
    way), resumed, against the uninterrupted run: the outer state right after the load, and everything at the end."""
    run = {**ISLANDS_2X2, "semi_sync": "streaming-diloco", "sync_every": 4, "fragments": 2, "fragment_delay": 1,
           "outer_dtype": "int4", "steps": 8, "ckpt_dir": folder, "ckpt_every": 5}
    at_save: dict = {}

    def keep(trainer, record):
        if record["step"] == 5:
            at_save.update(state=outer_state(trainer), pending=sorted(trainer.outer_sync.pending))

    whole = Trainer(config(rt, **run), rt, quiet=True)
    whole_losses = whole.fit(on_step=keep)["losses"]
    whole.save_checkpoint()  # step 8: its model entry against the global copy below
    resumed = Trainer(config(rt, **{**run, "ckpt_every": 0, "ckpt_dir": None}, resume=os.path.join(folder, "step-5")),
                      rt, quiet=True)
    resumed.maybe_resume()
    loaded = outer_state(resumed)
    restored = all(torch.equal(a, b) for a, b in zip(at_save["state"], loaded, strict=True))
    inner_steps = resumed.outer_sync.inner_steps
    resumed_losses = resumed.fit()["losses"]
    same_end = all(torch.equal(a, b) for a, b in zip(outer_state(whole), outer_state(resumed), strict=True))
    out = {"pending_at_save": at_save["pending"], "outer_state_restored": all_ranks_max(0.0 if restored else 1.0) == 0,
           "inner_steps_restored": inner_steps, "resumed_loss_diff": loss_difference(whole_losses[5:], resumed_losses),
           "end_param_diff": largest_difference(whole, resumed), "end_outer_state_equal":
           all_ranks_max(0.0 if same_end else 1.0) == 0, "islands_agree": islands_agree(whole)}
    # the checkpoint's model is the global copy (what eval and export read)
    saved = ckpt.load_params(os.path.join(folder, "step-8")) if rt.is_main else None
    with whole.outer_sync.global_parameters():
        global_params = full_tensors(whole.step_runner.model_parts, "param")
    if rt.is_main:
        out["checkpoint_model_is_global"] = max(float((saved[n] - global_params[n]).abs().max()) for n in saved)
    return out


def verify_islands(rt) -> dict:
    """verify --semi-sync on 2 x 2 islands (FSDP inside each) against the islands simulated on one device
    (verify/semi_sync_parity.py): a clean run, and one whose outer all-reduce leaves island 1 out (a planted fault,
    tests/support/faults.py (j)), which must fail."""
    from paratrain.verify.parity import verify_in_group
    from support.faults import planted

    cfg = config(rt, **ISLANDS_2X2, semi_sync="diloco", sync_every=2, steps=4)
    clean = verify_in_group(cfg, rt)
    with planted("semi-sync-skip-island"):
        faulty = verify_in_group(cfg, rt)
    if not rt.is_main:
        return {}
    return {"verify_clean": {k: clean[k] for k in ("passed", "checks", "semi_sync", "margins", "first_divergence")},
            "verify_faulty": {k: faulty[k] for k in ("passed", "checks", "first_divergence")}}


def run_checks(rt, folder: str) -> dict:
    out = {}
    out.update(verify_islands(rt))
    out.update(reductions_to_ddp(rt))
    out.update(reduction_to_local_sgd(rt, os.path.join(folder, "warmup")))
    out.update(streaming_one_fragment(rt))
    out.update(resume_restores_outer_loop(rt, os.path.join(folder, "resume")))
    return out
