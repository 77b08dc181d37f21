"""ParallelDims: validation, strategy resolution and the rank layout."""

import pytest

from paratrain.errors import UserError
from paratrain.models.presets import PRESETS
from paratrain.parallel.dims import ParallelDims, resolve_dims


def test_product_must_equal_world_size():
    with pytest.raises(UserError, match="multiply to 4 .* world size is 2"):
        ParallelDims(dp_shard=2, tp=2, world_size=2)
    with pytest.raises(UserError, match="positive"):
        ParallelDims(tp=0, world_size=1)


def test_coords_follow_the_pp_dp_cp_tp_layout():
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2, world_size=8)
    assert dims.coords(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert dims.coords(1)["tp"] == 1 and dims.coords(2)["dp_shard"] == 1 and dims.coords(4)["pp"] == 1
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


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
def test_resolve_dims(strategy, world, given, expect):
    dims = resolve_dims(strategy, world, given)
    for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        assert getattr(dims, name) == expect.get(name, 1), name


def test_resolve_dims_errors():
    with pytest.raises(UserError, match="single"):
        resolve_dims("single", 2, {})
    with pytest.raises(UserError, match="does not divide"):
        resolve_dims("ddp", 4, {"tp": 3})
    with pytest.raises(UserError, match="multiply"):
        resolve_dims("ddp", 4, {"tp": 2, "dp_replicate": 4})


def test_check_model_names_the_offending_dimension():
    tiny = PRESETS["tiny"]
    with pytest.raises(UserError, match=r"tp=3 does not divide the model's attention heads \(4\)"):
        ParallelDims(tp=3, world_size=3).check_model(tiny, 64)
    with pytest.raises(UserError, match="only 2 layers"):
        ParallelDims(pp=4, world_size=4).check_model(tiny, 64)
    ParallelDims(tp=2, world_size=2).check_model(tiny, 64)
