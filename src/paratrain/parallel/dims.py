"""The parallel dimensions, each declared once: the registry everything that names a dimension is built from.

A `Dim` says what the rest of paratrain needs to know of one way of dividing the ranks: its name (the Layout
field, the config field, the JSON key), its CLI flag and help, its place in the device mesh, whether it is a
factor of the world size, and where its check, its `apply_*` and its planner cost term live. From this
registry come the degree options of `train`, `verify`, `doctor`, `launch` and `plan` (cli.py), the run
config's degree fields (config.py), Layout's degree fields, DIM_NAMES and mesh order (layout.py), the checks
(checks.py), the plan request and the planner's search over degrees (plan/plan_cli.py, plan/search.py), and
what launchers and bench write (launchers/, bench/scaling.py).

The references are "module:function" strings, resolved only when called: parallel/ never imports plan/, and
importing this file imports nothing but the standard library (`plan` answered from its cache runs no torch).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Dim:
    name: str  # Layout field, config field and JSON key; the flag is --name with "_" as "-"
    help: str  # what the flag sets (train, verify, doctor, launch)
    mesh_order: int  # place in the device mesh, outermost first: ranks fill the innermost dim first
    fix_help: str = ""  # plan's help for the flag; empty: "fix: " + help
    # empty: a factor of the world size (the degrees' product is the world). Else the dims whose ranks this one
    # subdivides: it adds no ranks and its degree divides their product (expert parallelism over the
    # data-parallel ranks, as torchtitan does)
    within: tuple[str, ...] = ()
    # a dim with `within` also gets a device mesh of its own: Layout.with_mesh splits the ranks of its `within`
    # dims (adjacent in the mesh) into (<name>_rest, <name>), <name> innermost; Layout.submesh names both
    check: str | None = None  # check(args, layout, seq_len): UserError if the model cannot be split this way
    apply: str | None = None  # the apply_* that realises it
    cost: str | None = None  # the planner's cost term that prices it

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def world_factor(self) -> bool:
        return not self.within

    @property
    def plan_help(self) -> str:
        return self.fix_help or f"fix: {self.help}"

    def render(self, degree: int) -> list[str]:
        """How a command line (a launched job, a plan's `paratrain train ...`) writes this degree."""
        return [self.flag, str(degree)]


_REGISTRY: list[Dim] = [
    Dim("dp_replicate", "data-parallel replicas", mesh_order=10,
        apply="paratrain.parallel.data_parallel:apply_ddp", cost="paratrain.plan.costing.time:data_parallel_comm"),
    Dim("dp_shard", "data-parallel shards (FSDP / ZeRO)", mesh_order=20, fix_help="fix: data-parallel shards",
        apply="paratrain.parallel.data_parallel:apply_fsdp", cost="paratrain.plan.costing.time:data_parallel_comm"),
    # innermost: TP's collectives are the most frequent, so it stays on the fastest links (inside a node)
    Dim("tp", "tensor-parallel degree", mesh_order=40, check="paratrain.parallel.checks:check_tp",
        apply="paratrain.parallel.tensor_parallel:apply_tp", cost="paratrain.plan.costing.time:chunk_time"),
    # outermost: a pipeline sends the least
    Dim("pp", "pipeline-parallel degree", mesh_order=0, fix_help="fix: pipeline degree",
        check="paratrain.parallel.checks:check_pp", apply="paratrain.parallel.pipeline_split:split_into_stages",
        cost="paratrain.plan.costing.time:pipeline_factor"),
    Dim("cp", "context-parallel degree", mesh_order=30, check="paratrain.parallel.checks:check_cp",
        apply="paratrain.parallel.context_parallel:apply_cp", cost="paratrain.plan.costing.time:chunk_time"),
    # expert parallelism: each MoE layer's experts split over ep of the data-parallel ranks (as torchtitan does);
    # the expert weights are FSDP-sharded over the other dp_shard x cp / ep ranks
    Dim("ep", "expert-parallel degree (MoE models: experts split over this many data-parallel ranks)",
        mesh_order=35, within=("dp_shard", "cp"), fix_help="fix: expert-parallel degree",
        check="paratrain.parallel.expert_parallel:check_ep", apply="paratrain.parallel.expert_parallel:apply_ep",
        cost="paratrain.plan.costing.time:moe_all_to_all"),
]
_read = False


def register_dim(dim: Dim) -> None:
    """Declare one more dimension (its options are listed after the others'). Call it before importing
    anything built from the registry (parallel/layout.py, config.py, cli.py): they read it once, at import."""
    if _read:
        raise RuntimeError(f"register dimension {dim.name!r} before paratrain's layout, config or CLI is imported")
    if any(d.name == dim.name for d in _REGISTRY):
        raise ValueError(f"dimension {dim.name!r} is already declared")
    known = {d.name for d in _REGISTRY}
    if not set(dim.within) <= known:
        raise ValueError(f"dimension {dim.name!r} subdivides unknown dims {sorted(set(dim.within) - known)}")
    _REGISTRY.append(dim)


def all_dims() -> tuple[Dim, ...]:
    """Every dimension, in the order options and config fields list them."""
    global _read
    _read = True
    return tuple(_REGISTRY)


def dims_in_mesh_order() -> tuple[Dim, ...]:
    """Every dimension, outermost first: Layout's degree fields and every `dims` JSON object."""
    return tuple(sorted(all_dims(), key=lambda d: d.mesh_order))


def mesh_dims() -> tuple[Dim, ...]:
    """The world-size factors, outermost first: the DeviceMesh, a rank's coordinates, the planner's factorings."""
    return tuple(d for d in dims_in_mesh_order() if d.world_factor)


def dim_named(name: str) -> Dim:
    return next(d for d in all_dims() if d.name == name)


def resolve(reference: str):
    """The function a "module:function" reference names (imported now, not when the registry is)."""
    module, _, attr = reference.partition(":")
    return getattr(importlib.import_module(module), attr)
