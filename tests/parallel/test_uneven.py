"""Uneven splits for mixed clusters: --dp-batch-split and --pp-layers against one device, and the test rank
throttle (tests/support/throttle.py; its parser and clock are tested in tests/support/test_throttle.py).

Parity reference: verify/parity.py's single-device run on the same global batch (same seed, weights, data order),
every step, every rank, at verify's fp32 tolerances (loss 1e-5 relative, grads 1e-4, params 1e-5 + 1e-4
relative). uneven_worker.py runs every multi-rank check: its 3-rank launch, and its 2-rank checks inside the
suite's shared 2-rank group (tests/groups.py). The fault
check: the same split with every rank's loss weighted alike instead of by its tokens (mutation h) must fail.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.parallel.layout import Layout
from paratrain.parallel.loss_weighting import LossWeighting
from paratrain.parallel.strategies import config_fields, resolve_layout
from paratrain.parallel.uneven_split import dp_micro_batches, stage_layer_counts
from paratrain.train.data.indexed_sets import BatchSource, SyntheticMarkov
from reliability.inproc import launch_here

HERE = os.path.dirname(os.path.abspath(__file__))
MIN_MARGIN = 5  # tolerance / largest error seen, per check; measured margins are in docs/strategies.md


def launch(nproc: int) -> dict:
    """uneven_worker.py's checks on `nproc` ranks forked from this process's warm forkserver (no interpreter or
    torch start per rank); to rerun by hand: python tests/parallel/uneven_worker.py NPROC."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)  # the ranks import uneven_worker by name (they get this sys.path)
    import uneven_worker

    report = launch_here(uneven_worker.worker, (nproc,), nproc, timeout_s=120.0)
    assert report is not None
    return json.loads(json.dumps(report, default=str))  # as the script prints it


@pytest.fixture(scope="module")
def two_ranks(two_ranks):
    """The 2-rank checks, run in the suite's shared 2-rank group (tests/groups.py): no launch of their own."""
    return two_ranks["uneven"]


@pytest.fixture(scope="module")
def three_ranks():
    return launch(3)


def assert_parity(runs: dict, names) -> None:
    for name in names:
        run = runs[name]
        assert run["passed"] is True and run["first_divergence"] is None, (name, run)
        assert run["same_loss_on_every_rank"], name  # every rank reports the global token-weighted mean
        for check, margin in run["margins"].items():
            assert margin is None or margin >= MIN_MARGIN, (name, check, margin)


# -- data parallel ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(320)
def test_uneven_dp_on_two_ranks_matches_one_device(two_ranks):
    names = [n for n in two_ranks["clean"] if not n.startswith("pp")]
    assert {"ddp 3:1 x3", "ddp 1:3", "ddp 5:3", "zero1 3:1", "zero2 5:3", "zero3 3:1 x3", "zero3 1:3"} <= set(names)
    assert_parity(two_ranks["clean"], names)


@pytest.mark.timeout(320)
def test_uneven_dp_on_three_ranks_matches_one_device(three_ranks):
    assert set(three_ranks["clean"]) == {"ddp 2:1:1 x3", "zero3 3:2:1"}
    assert_parity(three_ranks["clean"], three_ranks["clean"])


@pytest.mark.timeout(320)
def test_split_weighted_by_rank_instead_of_tokens_fails_verify(two_ranks):
    """Mutation (h): each rank's loss weighted 1/M whatever its share; verify must fail at step 1."""
    for name, run in two_ranks["mutated"].items():
        assert run["passed"] is False, name
        assert run["first_divergence"]["step"] == 1, (name, run["first_divergence"])
        assert run["max_grad_rel_diff"] > 100 * 1e-4, name  # far outside the 1e-4 gradient tolerance


def test_shares_weights_and_refusals():
    assert dp_micro_batches("3:1", 8, 2, None) == ((6, 2), 1)
    assert dp_micro_batches("3:2:1", 12, 3, 2) == ((3, 2, 1), 2)
    assert dp_micro_batches("2:2", 6, 2, None) == ((3, 3), 1)  # weights reduce: 6 splits 1:1
    with pytest.raises(UserError, match=r"multiples of 4 \(e.g. 8, 12\)"):
        dp_micro_batches("3:1", 10, 2, None)
    with pytest.raises(UserError, match="values that do: 1, 2$"):
        dp_micro_batches("3:1", 8, 2, 3)
    with pytest.raises(UserError, match="3 entries but there are 2"):
        dp_micro_batches("1:1:1", 6, 2, None)
    for bad in ("3:0", "a:1", "3:-1", "3.5:1", ""):
        with pytest.raises(UserError):
            dp_micro_batches(bad, 8, 2, None)
    layout = resolve_layout(TrainConfig(strategy="ddp", global_batch=12, dp_batch_split="3:1", microbatches=3), 2)
    assert layout.dp_micro_batches == (3, 1) and layout.microbatches == 3 and layout.global_batch == 12
    # rank r's loss weight x its micro-batches = dp x its share of the global batch: the weights average to 1
    assert [LossWeighting.of(layout, r).dense_weight * 3 for r in (0, 1)] == [1.5, 0.5]
    for bad in ({"strategy": "ddp", "micro_batch": 2}, {"strategy": "ddp", "ddp_comm_hook": "fp16"},
                {"strategy": "ddp", "local_sgd_period": 2}, {"strategy": "tp", "dp_shard": 2}):
        with pytest.raises(UserError, match="dp-batch-split"):
            cfg = TrainConfig(**{"global_batch": 8, "dp_batch_split": "3:1", **bad})
            from paratrain.parallel.checks import check_uneven_dp

            check_uneven_dp(resolve_layout(cfg, 4 if bad["strategy"] == "tp" else 2), 8)


def test_data_slices_follow_the_split_and_cover_the_global_batch():
    data = SyntheticMarkov(64, 8, seed=1)
    whole = BatchSource(data, 8, 0, 1, 8).rank_batch(3).inputs
    parts = [BatchSource(data, 8, r, 2, m, (6, 2)) for r, m in ((0, 3), (1, 1))]
    assert [len(p.next_step()) for p in parts] == [2, 2]  # same micro-batch count on every rank
    assert torch.equal(torch.cat([p.rank_batch(3).inputs for p in parts]), whole)


def test_layout_round_trips_through_config_and_dict():
    for cfg in (TrainConfig(strategy="zero3", global_batch=12, dp_batch_split="3:2:1", microbatches=2),
                TrainConfig(strategy="pp", model="tiny4", pp_layers="3:1", microbatches=2)):
        layout = resolve_layout(cfg, 3 if cfg.dp_batch_split else 2)
        again = resolve_layout(TrainConfig(**{**config_fields(layout), "model": cfg.model}), layout.world)
        assert again == layout
        assert Layout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout


# -- pipeline -----------------------------------------------------------------------------------------------------
def stage_param_bytes(model: str, n_layers: int | None, counts: list[int], pp: int) -> list[int]:
    """fp32 parameter bytes each pipeline rank should hold for these per-stage block counts (loop placement)."""
    from paratrain.models.presets import build_model, model_args_for

    net = build_model(model_args_for(TrainConfig(model=model, n_layers=n_layers)), "cpu", seed=0)
    size = [sum(p.numel() for p in block.parameters()) for block in net.layers.values()]
    head = sum(p.numel() for m in (net.norm, net.output) for p in m.parameters())
    out, lo = [0] * pp, 0
    for stage, count in enumerate(counts):
        out[stage % pp] += sum(size[lo:lo + count])
        lo += count
    out[0] += net.tok_embeddings.weight.numel()
    out[(len(counts) - 1) % pp] += head
    return [4 * n for n in out]


@pytest.mark.timeout(320)
def test_pp_layers_match_one_device_and_place_the_blocks_asked_for(two_ranks):
    runs = two_ranks["clean"]
    assert_parity(runs, ["pp 3:1", "pp 1:3", "pp interleaved 3:1:1:1"])
    for name, model, n_layers, counts in (("pp 3:1", "tiny4", None, [3, 1]), ("pp 1:3", "tiny4", None, [1, 3]),
                                          ("pp interleaved 3:1:1:1", "tiny", 6, [3, 1, 1, 1])):
        held = [row["params"] for row in runs[name]["model_state_bytes"]["per_rank"]]
        assert held == stage_param_bytes(model, n_layers, counts, 2), name


def test_pp_layers_refusals():
    assert stage_layer_counts("3:1", 2, 4) == (3, 1)
    with pytest.raises(UserError, match="adds up to 5 blocks but the model has 4"):
        stage_layer_counts("4:1", 2, 4)
    with pytest.raises(UserError, match="3 entries but the pipeline has 2 stages"):
        stage_layer_counts("2:1:1", 2, 4)
    with pytest.raises(UserError, match="needs --pp > 1"):
        resolve_layout(TrainConfig(strategy="ddp", pp_layers="1:1"), 2)


def test_cli_refuses_a_bad_split_in_one_line_and_prints_both_keys(capsys):
    from paratrain import cli

    with pytest.raises(SystemExit) as exit_info:  # in-process: refused before any worker starts
        cli.main(["train", "--strategy", "ddp", "--nproc", "2", "--global-batch", "10", "--dp-batch-split", "3:1",
                  "--steps", "1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "multiples of 4" in err, err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--dp-batch-split", "3:1", "--pp-layers", "2:2", "--print-config"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and 'dp_batch_split = "3:1"' in out and 'pp_layers = "2:2"' in out, out


# -- the test throttle, through the hooks -----------------------------------------------------------------------------------------
@pytest.mark.timeout(320)
def test_throttle_switch_reaches_only_the_named_rank(two_ranks):
    for strategy, slept in two_ranks["slept_s"].items():  # ddp, and pp (its stage chunks are stretched)
        assert slept[0] is None and slept[1] > 0, (strategy, slept)
