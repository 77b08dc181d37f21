"""A parallel dimension is declared once (parallel/dims.py): a throw-away one, registered through the registry
alone, shows up in every command's options, the run config, the Layout and its world size, the planner's
search, and a launched job. The registry and the option vocabularies import without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import plugin_env
from paratrain.parallel.dims import all_dims, dims_in_mesh_order, mesh_dims, techniques

# registers "xx" (a factor of the world size) and "yy" (inside the data-parallel ranks, as expert parallelism
# will be) before anything built from the registry is imported, then reports what each part made of them
SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys

    from paratrain.parallel.dims import Dim, register_dim

    from support import throwaway_dim

    register_dim(throwaway_dim.DIM)
    register_dim(Dim("yy", "experts split", mesh_order=25, within=("dp_replicate", "dp_shard")))
    assert "torch" not in sys.modules

    from paratrain import cli
    from paratrain.errors import UserError
    from paratrain.parallel.layout import DIM_NAMES, Layout
    from paratrain.parallel.strategies import resolve_degrees
    from paratrain.plan.search import Job, base_layouts
    from paratrain.models.presets import get_preset

    def run(*argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main(list(argv))
            except SystemExit as exc:
                code = exc.code
        return {"code": code, "out": out.getvalue(), "err": err.getvalue()}

    def refusal(make):
        try:
            make()
        except UserError as exc:
            return str(exc)
        return None

    doc = {"mesh": list(DIM_NAMES), "world": Layout(dp_shard=2, xx=2).world,
           "degrees": Layout(dp_shard=2, xx=2).degrees(),
           "train_help": run("train", "--help"), "plan_help": run("plan", "--help"),
           "print_config": run("train", "--xx", "2", "--print-config"),
           "slurm": run("launch", "slurm", "--strategy", "ddp", "--nodes", "1", "--gpus-per-node", "4", "--xx", "2"),
           "refused": refusal(lambda: resolve_degrees("ddp", 4, {"dp_replicate": 4, "xx": 2})),
           "yy_world": Layout(dp_shard=4, yy=2).world,
           "yy_resolved": resolve_degrees("zero3", 4, {"yy": 2}),
           "yy_refused": refusal(lambda: Layout(dp_shard=2, tp=2, yy=4))}
    job = Job(args=get_preset("tiny"), model_name="tiny", gpus=8, seq_len=64, global_batch=16)
    doc["searched"] = sorted({(lay.xx, lay.world) for lay in base_layouts(job, {"xx": 2}, 8)})
    doc["searched_open"] = sorted({lay.xx for lay in base_layouts(job, {}, 8)})
    plan = json.loads(run("plan", "--model", "tiny", "--gpu", "h100-sxm", "--gpus", "2", "--xx", "2",
                          "--global-batch", "4", "--json")["out"])["candidates"][0]
    doc["plan"] = {"dims": plan["dims"], "breakdown": plan["time_breakdown_s"], "step_s": plan["step_time_s"]}
    from paratrain.plan.auto import auto_hardware
    from paratrain.plan.costing.time import estimate_time
    profile = auto_hardware("cpu")[0]
    doc["step_s"] = {n: estimate_time(profile, get_preset("tiny"), Layout(xx=n), 64, "fp32", "cpu").step_s
                     for n in (1, 2)}
    from paratrain.parallel.parallelize import parallelize
    from paratrain.models.presets import build_model
    parallelize(build_model(get_preset("tiny"), "cpu", seed=0), Layout(xx=1))
    doc["applied"] = list(throwaway_dim.APPLIED)
    print(json.dumps(doc))
""")


@pytest.fixture(scope="module")
def registered() -> dict:
    env = {**os.environ, "COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_registered_dimension_reaches_the_cli_and_the_config(registered):
    for command, helptext in (("train", "a throw-away dimension"), ("plan", "fix: a throw-away dimension")):
        shown = registered[f"{command}_help"]
        assert shown["code"] == 0 and "--xx" in shown["out"] and helptext in shown["out"], shown
    assert "xx = 2" in registered["print_config"]["out"]


def test_a_registered_dimension_multiplies_the_world_and_is_searched(registered):
    assert registered["mesh"] == ["pp", "dp_replicate", "dp_shard", "cp", "xx", "tp"]  # placed by its mesh_order
    assert registered["world"] == 4 and registered["degrees"]["xx"] == 2
    refused = registered["refused"]
    assert "parallel degrees multiply to 8" in refused and "xx=2" in refused and "world size is 4" in refused
    assert registered["searched"] == [[2, 8]]  # every searched layout carries the fixed xx and still fills 8 GPUs
    assert registered["searched_open"] == [1, 2, 4, 8]  # left open, it is a factor of the world like any other


def test_a_registered_dimensions_apply_runs_and_its_cost_term_prices_the_step(registered):
    """The throw-away dimension's package brings its apply and its cost object; nothing else names it."""
    assert registered["applied"] == [1]  # parallelize() handed it the model, in its place in the order
    plan, step = registered["plan"], registered["step_s"]
    assert plan["dims"]["xx"] == 2 and plan["breakdown"]["xx_comm_s"] == 0.25
    assert plan["breakdown"]["communication_exposed"] >= 0.25 and plan["step_s"] > 0.25
    assert step["2"] - step["1"] == pytest.approx(0.25)  # the same layout, its term alone added


def test_a_registered_dimensions_apply_runs_on_every_rank_of_a_two_rank_train(cli, tmp_path):
    """PARATRAIN_DIMS registers the package's Dim in the launching process and in both workers: --xx 2 makes
    the world, and each rank's parallelize() hands its model to the technique (seen in the file it appends to)."""
    record = tmp_path / "applied.txt"
    env = {**plugin_env(), "PARATRAIN_DIMS": "support.throwaway_dim:DIM", "PARATRAIN_THROWAWAY_RECORD": str(record)}
    done = cli("train", "--model", "tiny", "--nproc", "2", "--xx", "2", "--steps", "1", "--device", "cpu", "--json",
               env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.json()["dims"]["xx"] == 2 and done.json()["world_size"] == 2
    assert record.read_text().splitlines() == ["apply xx=2 world=2"] * 2


def test_a_bad_paratrain_dims_entry_is_one_line(cli):
    done = cli("train", "--help", env={"PARATRAIN_DIMS": "os:sep"})
    assert done.returncode == 2 and done.stderr.strip() == "error: PARATRAIN_DIMS: 'os:sep' is not a Dim (paratrain.parallel.dims.Dim)"


def test_a_launched_job_writes_a_registered_degree_on_its_train_line(registered):
    slurm = registered["slurm"]
    assert slurm["code"] == 0, slurm["err"]
    train_line = next(line for line in slurm["out"].splitlines() if line.startswith("srun "))
    assert train_line.removesuffix(" &").endswith("--xx 2") and "xx = 2" in slurm["out"]  # srun runs in the background


def test_a_dimension_inside_the_data_parallel_ranks_adds_none_and_must_divide_them(registered):
    """Expert parallelism's shape (DESIGN.md `--ep`): a degree that subdivides other dims' ranks."""
    assert "yy" not in registered["mesh"] and registered["yy_world"] == 4
    assert registered["yy_resolved"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "yy": 2, "cp": 1, "ep": 1,
                                           "xx": 1, "tp": 1}
    assert "--yy 4 must divide the dp_replicate x dp_shard ranks (2)" in registered["yy_refused"]


def test_the_five_world_dimensions_and_ep_in_mesh_order_and_their_references_resolve():
    assert [d.name for d in mesh_dims()] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    # as options list them; ep (expert parallelism) adds no ranks
    assert [d.name for d in all_dims()] == ["dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"]
    assert [d.name for d in dims_in_mesh_order() if not d.world_factor] == ["ep"]
    for dim in all_dims():
        assert dim.render(4) == [dim.flag, "4"] and dim.flag == "--" + dim.name.replace("_", "-")
    # one technique object per package, shared by data parallelism's two dims
    assert {type(t).__name__ for t in techniques()} == {"DataParallel", "TensorParallel", "PipelineParallel",
                                                          "ContextParallel", "ExpertParallel"}


def test_registering_after_the_registry_was_read_is_refused():
    from paratrain.parallel.dims import Dim, register_dim

    all_dims()
    with pytest.raises(RuntimeError, match="before"):
        register_dim(Dim("zz", "too late", mesh_order=50))
