"""Layout: validation, strategy resolution, the rank layout, groups, and check_layout."""


import pytest

from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.models.presets import PRESETS
from paratrain.parallel.checks import check_layout
from paratrain.parallel.layout import Layout
from paratrain.parallel.strategies import STRATEGY_TABLE, config_fields, resolve_degrees, resolve_layout


def test_degrees_must_be_positive_integers():
    with pytest.raises(UserError, match="positive"):
        Layout(tp=0)
    with pytest.raises(UserError, match="multiply to 4 .* world size is 2"):
        resolve_degrees("ddp", 2, {"dp_replicate": 2, "tp": 2})


def test_coords_follow_the_pp_dp_cp_tp_layout():
    lay = Layout(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    assert lay.world == 8
    assert lay.coords(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert lay.coords(1)["tp"] == 1 and lay.coords(2)["dp_shard"] == 1 and lay.coords(4)["pp"] == 1
    assert [lay.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_groups_sizes_and_node_placement():
    lay = Layout(pp=2, dp_shard=4, tp=8)
    assert lay.group_size("tp") == 8 and lay.group_size("dp") == 4 and lay.group_size("dp_shard_cp") == 4
    assert lay.placement("tp", 8) == "intra" and lay.placement("dp_shard", 8) == "inter"
    assert lay.fsdp and not lay.ddp and lay.shard_degree == 4
    ring = Layout(dp_replicate=2, cp=2)
    assert ring.ddp and not ring.fsdp and ring.shard_degree == 1 and ring.group_size("dp_cp") == 4


@pytest.mark.parametrize("strategy,world,given,expect", [
    ("ddp", 4, {}, {"dp_replicate": 4}),
    ("zero3", 2, {}, {"dp_shard": 2}),
    ("hsdp", 4, {}, {"dp_replicate": 2, "dp_shard": 2}),
    ("tp", 4, {"dp_shard": 2}, {"tp": 2, "dp_shard": 2}),
    ("ddp", 4, {"tp": 2}, {"tp": 2, "dp_replicate": 2}),
    ("pp", 2, {}, {"pp": 2}),
    ("cp-ring", 4, {"dp_shard": 2}, {"cp": 2, "dp_shard": 2}),
    ("single", 1, {}, {}),
])
def test_resolve_degrees(strategy, world, given, expect):
    degrees = resolve_degrees(strategy, world, given)
    for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        assert degrees[name] == expect.get(name, 1), name


def test_resolve_degrees_errors():
    with pytest.raises(UserError, match="single"):
        resolve_degrees("single", 2, {})
    with pytest.raises(UserError, match="does not divide"):
        resolve_degrees("ddp", 4, {"tp": 3})
    with pytest.raises(UserError, match="multiply"):
        resolve_degrees("ddp", 4, {"tp": 2, "dp_replicate": 4})
    with pytest.raises(UserError, match="unknown strategy"):
        resolve_degrees("zero4", 2, {})


def test_check_layout_names_the_offending_dimension():
    tiny = PRESETS["tiny"]
    with pytest.raises(UserError, match=r"tp=3 does not divide the model's attention heads \(4\)"):
        check_layout(Layout(tp=3, micro_batch=16), tiny, 64, 16)
    with pytest.raises(UserError, match="only 2 layers"):
        check_layout(Layout(pp=4, microbatches=4, micro_batch=4), tiny, 64, 16)
    with pytest.raises(UserError, match="would need DDP over tensor-parallel"):
        check_layout(Layout(dp_replicate=2, tp=2, micro_batch=8), tiny, 64, 16)
    check_layout(Layout(tp=2, micro_batch=16), tiny, 64, 16)
    check_layout(Layout(dp_shard=2, tp=2, micro_batch=8), tiny, 64, 16)  # 2-D with FSDP is fine


def test_strategy_options_come_from_the_table_alone():
    """Each row's implied options reach the Layout; a layout's strategy name maps back to an equal Layout."""
    for name in STRATEGY_TABLE:
        world = {"single": 1, "hsdp": 4}.get(name, 2)
        cfg = TrainConfig(strategy=name, nproc=world, global_batch=8, n_layers=4)
        lay = resolve_layout(cfg, world)
        row = STRATEGY_TABLE[name]
        assert lay.zero_stage == (row.zero_stage if lay.dp > 1 else 0), name
        if row.sp is not None:
            assert lay.sp == row.sp, name
        if row.cp_impl:
            assert lay.cp_impl == row.cp_impl, name
        if row.naive_pipeline:
            assert (lay.pp_schedule, lay.microbatches) == ("gpipe", 1)
        again = resolve_layout(cfg.model_copy(update=config_fields(lay)), world)
        assert again == lay, (name, again, lay)


def test_ep_without_ranks_to_split_names_the_options_that_give_it_some():
    """`--ep 2 --nproc 2` on the default strategy (ddp: every rank a replica) leaves ep no sharded ranks."""
    cfg = TrainConfig(model="moe-tiny", ep=2, nproc=2)
    with pytest.raises(UserError) as refused:
        resolve_layout(cfg, 2)
    assert str(refused.value) == ("--ep 2 must divide the dp_shard x cp ranks (1): give it ranks to split with "
                                  "--strategy ep or --dp-shard N with N a multiple of 2")
    # both ways it names are taken
    assert resolve_layout(cfg.model_copy(update={"strategy": "ep"}), 2).dp_shard == 2
    assert resolve_layout(cfg.model_copy(update={"dp_shard": 2}), 2).ep == 2
