"""LossWeighting (parallel/loss_weighting.py) against the global token-weighted mean computed directly.

Each layout's global batch of per-token losses is cut as the runtime cuts it (data-parallel slices, micro-batches,
context-parallel sequence slices); every micro-batch's term is formed from the object's factors the way the step
runners form it (train/step.py's plain step, train/pipeline_step.py's schedule with scale_grads), summed over each
rank's micro-batches and averaged over the reducers. Reference: sum(loss x real) / sum(real) over the whole batch,
which knows nothing of ranks, micro-batches or the object. In-process; float64 losses, but the plain step's
document factor is a float32 tensor (real count x reducers / global count, as at runtime): RTOL allows for it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratrain.config import TrainConfig
from paratrain.parallel.loss_weighting import LossWeighting
from paratrain.parallel.strategies import resolve_layout

SEQ = 8
RTOL = 1e-6  # a float32 factor's rounding; a wrong factor misses by far more (test_a_wrong_factor_misses_the_mean)

LAYOUTS = {  # name: (config, world size)
    "dp2": ({"strategy": "ddp", "global_batch": 8, "micro_batch": 2}, 2),
    "dp-batch-split 3:1": ({"strategy": "ddp", "global_batch": 8, "dp_batch_split": "3:1", "microbatches": 2}, 2),
    "dp-batch-split 3:2:1": ({"strategy": "zero3", "global_batch": 12, "dp_batch_split": "3:2:1",
                              "microbatches": 2}, 3),
    "pp2 x 4 micro-batches": ({"strategy": "pp", "model": "tiny4", "global_batch": 8, "microbatches": 4}, 2),
    "pp2 x dp2": ({"pp": 2, "dp_shard": 2, "model": "tiny4", "global_batch": 8, "microbatches": 2}, 4),
    "cp2": ({"strategy": "cp-ring", "global_batch": 4, "micro_batch": 2}, 2),
    "dp2 x cp2": ({"dp_shard": 2, "cp": 2, "global_batch": 8, "micro_batch": 2}, 4),
}


def layout_of(name: str):
    cfg, world = LAYOUTS[name]
    return resolve_layout(TrainConfig(**cfg), world)


def reference_mean(losses: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    return (losses * real).sum() / real.sum()


def micro_batches_of(layout, dp_rank: int, cp_rank: int, losses: torch.Tensor, real: torch.Tensor):
    """(losses, real mask) of each micro-batch data-parallel rank `dp_rank`, context-parallel rank `cp_rank` holds."""
    sizes = [layout.micro_batch_of(r) * layout.microbatches for r in range(layout.dp)]
    first = sum(sizes[:dp_rank])
    micro = layout.micro_batch_of(dp_rank)
    columns = slice(cp_rank * SEQ // layout.cp, (cp_rank + 1) * SEQ // layout.cp)
    for start in range(first, first + sizes[dp_rank], micro):
        rows = slice(start, start + micro)
        yield losses[rows, columns], real[rows, columns]


def step_loss(layout, losses: torch.Tensor, real: torch.Tensor, weighting_of, documents: bool) -> torch.Tensor:
    """The loss whose gradient one step takes, over every rank, as the runners form it: each micro-batch's
    backpropagated loss (divided by the micro-batch count where the schedule divides), summed over every rank's
    micro-batches and averaged over the dp x cp ranks, as DDP / FSDP average gradients."""
    global_tokens = int(real.sum())
    summed = torch.zeros((), dtype=torch.float64)
    for dp_rank in range(layout.dp):
        weighting = weighting_of(dp_rank)
        for cp_rank in range(layout.cp):
            for mb_losses, mb_real in micro_batches_of(layout, dp_rank, cp_rank, losses, real):
                count = mb_real.sum()
                if not documents:  # every token real: the runners' mean loss
                    backward = weighting.dense_loss(mb_losses.mean(), layout.microbatches)
                elif weighting.schedule_divides:  # the pipeline's summed loss
                    backward = weighting.for_backward((mb_losses * mb_real).sum()
                                                      * weighting.summed_token_factor(global_tokens))
                elif int(count) == 0:
                    backward = torch.zeros((), dtype=torch.float64)
                else:  # the plain step's mean over the micro-batch's real tokens
                    mean = (mb_losses * mb_real).sum() / count
                    backward = mean * weighting.real_token_factor(count, global_tokens)
                summed += backward / layout.microbatches if weighting.schedule_divides else backward
    return summed / (layout.dp * layout.cp)


def dense_batch(layout, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    losses = torch.rand(layout.global_batch, SEQ, generator=gen, dtype=torch.float64) * 5
    return losses, torch.ones_like(losses, dtype=torch.bool)


def document_batch(layout, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Real targets spread unevenly: a row with one real target, a row with none, the rest random."""
    losses, _ = dense_batch(layout, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    real = torch.rand(layout.global_batch, SEQ, generator=gen) < 0.6
    real[0] = False
    real[0, -1] = True
    real[-1] = False
    return losses, real


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_terms_average_to_the_global_token_weighted_mean(name):
    layout = layout_of(name)
    for batch in (dense_batch, document_batch):
        losses, real = batch(layout, seed=len(name))
        got = step_loss(layout, losses, real, lambda r: LossWeighting.of(layout, r), batch is document_batch)
        assert torch.allclose(got, reference_mean(losses, real), rtol=RTOL, atol=0), (name, batch.__name__)
        # the reported loss: the all-reduced sum of the ranks' shares (what the plain step returns), made the mean
        # by the object
        reported = LossWeighting.of(layout, 0).global_mean(got * (layout.dp * layout.cp))
        assert torch.allclose(reported, got, rtol=1e-12), name


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_dense_and_document_paths_agree_when_every_token_is_real(name):
    layout = layout_of(name)
    losses, real = dense_batch(layout, seed=3)
    weighting_of = lambda r: LossWeighting.of(layout, r)  # noqa: E731
    dense = step_loss(layout, losses, real, weighting_of, documents=False)
    assert torch.allclose(dense, step_loss(layout, losses, real, weighting_of, documents=True), rtol=RTOL)


def test_a_wrong_factor_misses_the_mean():
    """Under --dp-batch-split every rank weighted 1 / M (the verify mutation h), and the document factor without
    the reducers, each land away from the reference."""
    layout = layout_of("dp-batch-split 3:1")
    losses, real = dense_batch(layout, seed=5)
    want = reference_mean(losses, real)
    unweighted = step_loss(layout, losses, real, lambda r: LossWeighting.of(layout, r).with_dense_weight(None),
                           documents=False)
    assert abs(unweighted / want - 1) > 1e-2
    layout = layout_of("dp2 x cp2")
    losses, real = document_batch(layout, seed=5)
    no_reducers = step_loss(layout, losses, real,
                            lambda r: dataclasses.replace(LossWeighting.of(layout, r), reducers=1), documents=True)
    assert abs(no_reducers / reference_mean(losses, real) - 1) > 1e-2


def test_the_reported_pipeline_loss_is_the_rank_share():
    """A schedule's recorded values (the mean losses as handed over; document terms) give the same share."""
    layout = layout_of("pp2 x dp2")
    for batch, dense in ((dense_batch, True), (document_batch, False)):
        losses, real = batch(layout, seed=7)
        global_tokens, summed = int(real.sum()), torch.zeros((), dtype=torch.float64)
        for dp_rank in range(layout.dp):
            weighting = LossWeighting.of(layout, dp_rank)
            recorded = [weighting.dense_loss(mb.mean()) if dense else
                        (mb * mb_real).sum() * weighting.summed_token_factor(global_tokens)
                        for mb, mb_real in micro_batches_of(layout, dp_rank, 0, losses, real)]
            summed += weighting.rank_share(torch.stack(recorded), dense)
        got = LossWeighting.of(layout, 0).global_mean(summed)
        assert torch.allclose(got, reference_mean(losses, real), rtol=RTOL), dense


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_balancing_loss_weighs_one_micro_batch(name):
    """Each micro-batch's balancing loss x aux_scale (then / M where the schedule divides), summed over the
    micro-batches, is their mean."""
    weighting = LossWeighting.of(layout_of(name), 0)
    per_micro_batch = torch.arange(1, weighting.microbatches + 1, dtype=torch.float64)
    divide = weighting.microbatches if weighting.schedule_divides else 1
    assert torch.isclose((per_micro_batch * weighting.aux_scale / divide).sum(), per_micro_batch.mean())


def test_expert_gradients_become_the_mean_over_the_reducers():
    """--ep: an expert's gradient sums the contributions of every data rank (the ep ranks' tokens meet at it, the
    FSDP reduce-scatter sums the rest ranks) and FSDP divides by the rest ranks: with the scale, their mean."""
    layout = resolve_layout(TrainConfig(strategy="ep", model="moe-tiny", dp_shard=4, ep=2, global_batch=8), 4)
    weighting, rest = LossWeighting.of(layout, 0), layout.group_size("dp_cp") // layout.ep
    contributions = torch.tensor([0.5, 1.5, 2.0, 4.0], dtype=torch.float64)
    fsdp_grad = (contributions * weighting.expert_weight_grad_scale(rest)).sum() / rest
    assert torch.isclose(fsdp_grad, contributions.mean())
