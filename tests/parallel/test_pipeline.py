"""Pipeline parallelism: stage split, layout checks, and parity of every schedule with a single device.

Parity reference: a single-device Trainer (same seed, weights and batches), compared with paratrain verify's
fp32 tolerances (loss 1e-6 abs + 1e-5 rel, grads 1e-4 rel, params 1e-5 abs + 1e-4 rel).
"""

from __future__ import annotations

import pytest
import torch

from paratrain.errors import UserError
from paratrain.models.llama import ModelArgs
from paratrain.models.presets import PRESETS, build_model
from paratrain.parallel.checks import check_layout
from paratrain.parallel.layout import Layout
from paratrain.parallel.pp.pipeline_split import carve_stage, layer_costs, split_into_stages, stage_ranks
from paratrain.parallel.strategies import resolve_layout, resolve_microbatches


def _meta_model(**kw):
    return build_model(ModelArgs(**{"dim": 64, "n_heads": 4, "ffn_dim": 192, **kw}), "meta")


# -- split_into_stages -------------------------------------------------------------------------------------
def test_split_gives_the_heavy_head_stage_fewer_layers():
    # vocab 8192 x dim 64: the head costs about as much as 10 layers, so the last stage keeps 1 layer
    model = _meta_model(vocab_size=8192, n_layers=8)
    specs = split_into_stages(model, pp=2, seq_len=64)
    assert [len(s.layers) for s in specs] == [7, 1]
    assert specs[0].first and not specs[0].last and specs[1].last
    costs, embed, head = layer_costs(model, 64)
    by_count = max(embed + sum(costs[:4]), sum(costs[4:]) + head)  # 4 + 4 layers
    assert max(s.cost for s in specs) < 0.8 * by_count


def test_split_is_even_when_the_ends_are_light_and_covers_every_layer_once():
    model = _meta_model(vocab_size=256, n_layers=8)
    for pp, v in ((2, 1), (4, 1), (2, 2), (8, 1)):
        specs = split_into_stages(model, pp, v, seq_len=64)
        assert len(specs) == pp * v
        assert [name for s in specs for name in s.layers] == [str(i) for i in range(8)]
        assert all(s.layers for s in specs)
        assert max(len(s.layers) for s in specs) - min(len(s.layers) for s in specs) <= 1


def test_split_rejects_more_stages_than_layers():
    with pytest.raises(UserError, match="4 pipeline stages .* only 2 layers"):
        split_into_stages(_meta_model(n_layers=2), pp=2, virtual_stages=2)


def test_stage_ranks_loop_and_v():
    assert stage_ranks(2, 4) == [0, 1, 0, 1]
    assert stage_ranks(2, 4, "v") == [0, 1, 1, 0]
    assert stage_ranks(4, 4) == [0, 1, 2, 3]


def test_carved_stages_keep_names_share_parameters_and_chain_to_the_full_model():
    model = build_model(PRESETS["tiny4"], "cpu", seed=0)
    specs = split_into_stages(model, pp=2, virtual_stages=2, seq_len=16)
    parts = [carve_stage(model, s) for s in specs]
    names = [set(dict(p.named_parameters())) for p in parts]
    assert set().union(*names) == set(dict(model.named_parameters()))
    assert sum(len(n) for n in names) == len(dict(model.named_parameters()))  # disjoint
    assert "tok_embeddings.weight" in names[0] and "output.weight" in names[-1]
    assert parts[1].layers["1"].attention.wq.weight is model.layers["1"].attention.wq.weight
    tokens = torch.randint(0, 256, (2, 16))
    h = tokens
    for part in parts:
        h = part(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)


# -- layout checks -----------------------------------------------------------------------------------------
def _layout(**kw):
    """Resolve and check a pipeline run the way `train` does; return its micro-batch count."""
    from types import SimpleNamespace

    from paratrain.parallel.layout import DEGREE_NAMES

    o = {"strategy": "pp", "schedule": "1f1b", "pp": 2, "virtual_stages": 1, "n_layers": 4, "global_batch": 16,
         "dp": 1, "microbatches": None, "micro_batch": None, "cp": 1, "dtype": "fp32", **kw}
    cfg = SimpleNamespace(strategy=o["strategy"], pp=o["pp"], dp_replicate=o["dp"], dp_shard=None, cp=o["cp"],
                          tp=None, sp=False, cp_impl="ring", pp_schedule=o["schedule"], microbatches=o["microbatches"],
                          virtual_stages=o["virtual_stages"], micro_batch=o["micro_batch"],
                          global_batch=o["global_batch"], ac="none", dtype=o["dtype"], compile=False,
                          ddp_comm_hook="none", local_sgd_period=0, cpu_offload=False, warmup_steps=0, steps=1)
    for name in DEGREE_NAMES:  # every registered dimension this case does not set (ep, ...) is left open
        if not hasattr(cfg, name):
            setattr(cfg, name, None)
    args = SimpleNamespace(n_layers=o["n_layers"], n_heads=4, kv_heads=4, ffn_dim=64, vocab_size=64)
    layout = resolve_layout(cfg, o["pp"] * o["dp"] * o["cp"])
    check_layout(layout, args, 64, o["global_batch"])
    return layout.microbatches


@pytest.mark.parametrize("kw, message", [
    ({"pp": 4, "n_layers": 2}, "4 stages but the model has only 2 layers"),
    ({"pp": 2, "virtual_stages": 2, "n_layers": 3, "schedule": "interleaved-1f1b"}, "only 3 layers"),
    ({"microbatches": 1}, "1f1b needs at least as many micro-batches as stages: 1 < pp=2"),
    ({"pp": 4, "microbatches": 2}, "1 < pp=4|2 < pp=4"),
    ({"global_batch": 10, "microbatches": 4}, "per-rank batch 10 .* not divisible by 4 pipeline micro-batches"),
    ({"global_batch": 16, "dp": 2, "microbatches": 3}, "per-rank batch 8 .* not divisible by 3"),
    ({"global_batch": 15, "dp": 2}, "global batch 15 is not divisible by the data-parallel degree 2"),
    ({"schedule": "interleaved-1f1b"}, "needs --virtual-stages 2"),
    ({"schedule": "gpipe", "virtual_stages": 2}, "runs one stage per rank"),
    ({"schedule": "interleaved-1f1b", "virtual_stages": 2, "microbatches": 5, "global_batch": 20},
     "multiple of 2"),
    ({"schedule": "zero-bubble", "dp": 2}, "zero-bubble cannot be combined with data parallelism"),
    ({"cp": 2}, "does not combine with context parallelism"),
    ({"dtype": "fp16"}, "use --dtype bf16"),
    ({"microbatches": 4, "micro_batch": 2}, "--microbatches 4 and --micro-batch 2 disagree"),
    ({"strategy": "model", "microbatches": 4}, "runs one micro-batch"),
    ({"strategy": "model", "micro_batch": 4}, "whole batch"),
])
def test_bad_layouts_name_the_problem(kw, message):
    with pytest.raises(UserError, match=message):
        _layout(**kw)


def test_microbatch_count_rules():
    assert resolve_microbatches(False, None, None, 16, pp=2) == 2  # default: pp
    assert resolve_microbatches(False, 8, None, 16, pp=2) == 8
    assert resolve_microbatches(False, None, 4, 16, pp=2) == 4  # by size: 16 / 4
    assert resolve_microbatches(False, 4, 4, 16, pp=2) == 4
    assert resolve_microbatches(True, None, None, 16, pp=2) == 1  # naive model parallel: one micro-batch
    assert _layout(schedule="gpipe", pp=4, microbatches=1) == 1  # gpipe runs any m
    assert _layout(schedule="interleaved-1f1b", virtual_stages=2, microbatches=1) == 1


def test_ideal_bubble_formula():
    assert Layout(pp=2, microbatches=1).ideal_bubble == pytest.approx(0.5)
    assert Layout(pp=2, microbatches=8).ideal_bubble == pytest.approx(1 / 9)
    assert Layout(pp=4, microbatches=4, virtual_stages=2).ideal_bubble == pytest.approx(3 / 11)
    assert Layout(dp_replicate=2, microbatches=8).ideal_bubble == 0.0


# -- the CLI rejects bad layouts before starting processes -----------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, message", [
    (["--strategy", "pp", "--nproc", "4"], "pp=4 x 1 stage(s) per rank = 4 stages but the model has only 2 layers"),
    (["--strategy", "pp", "--nproc", "2", "--pp-schedule", "1f1b", "--microbatches", "1"],
     "1f1b needs at least as many micro-batches as stages"),
    (["--strategy", "pp", "--nproc", "2", "--global-batch", "10", "--microbatches", "4"],
     "not divisible by 4 pipeline micro-batches"),
])
def test_cli_bad_layout_exits_2_with_one_line(cli_inproc, args, message):
    result = cli_inproc("verify", *args, "--steps", "1", "--timeout-s", "30")
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], result.stderr


# -- parity: every schedule and 3-D layouts against one device ----------------------------------------------
# pipeline_checks.py's layouts run inside the shared groups (tests/groups.py, conftest.py): no launch of their own


def _assert_parity(name: str, r: dict) -> None:
    assert r["passed"], f"{name}: {r}"
    assert r["same_loss_on_every_rank"], name
    timing = r["timing"]
    assert timing["per_rank"] and all(0.0 <= x["idle_fraction"] < 1.0 for x in timing["per_rank"]), name
    assert all(x["busy_s"] > 0 for x in timing["per_rank"]), name


@pytest.mark.timeout(420)
def test_schedules_match_single_device_at_pp2(two_ranks):
    results = two_ranks["pipeline"]
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "model", "micro-batch"):
        _assert_parity(name, results[name])
    assert results["interleaved-1f1b"]["n_parts_rank0"] == 2  # 2 virtual stages per rank
    assert results["model"]["timing"]["microbatches"] == 1
    assert results["micro-batch"]["timing"]["microbatches"] == 4  # per-rank batch 16 / --micro-batch 4
    # naive model parallel: one micro-batch, so each of the 2 ranks waits for the other about half the step
    assert results["model"]["timing"]["idle_fraction_mean"] > 0.2
    ckpt = results["checkpoint"]
    assert ckpt["params_equal"] and ckpt["step"] == 3 and ckpt["n_params"] == 39
    assert ckpt["resumed_loss"] == pytest.approx(ckpt["next_loss"], abs=1e-5)


@pytest.mark.timeout(420)
def test_pp4_and_3d_layouts_match_single_device(four_ranks):
    results = four_ranks["pipeline"]
    for name in ("1f1b-pp4", "pp2-dp_shard2", "pp2-ddp2", "pp2-tp2"):
        _assert_parity(name, results[name])


@pytest.mark.timeout(240)
def test_verify_json_reports_the_bubble(cli_here):
    result = cli_here("verify", "--strategy", "model", "--nproc", "2", "--steps", "2", "--timeout-s", "60", "--json")
    assert result.returncode == 0, result.stderr
    doc = result.json()
    assert doc["passed"] and doc["dims"]["pp"] == 2
    pipe = doc["pipeline"]
    assert pipe["microbatches"] == 1 and pipe["ideal_bubble_fraction"] == pytest.approx(0.5)
    assert len(pipe["per_rank"]) == 2 and "model_state_bytes" in doc  # merged with the other verify extras
