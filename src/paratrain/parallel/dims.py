"""The parallel dimensions, each declared once: the registry everything that names a dimension is built from.

A `Dim` says what the rest of paratrain needs to know of one way of dividing the ranks: its name (the Layout
field, the config field, the JSON key), its CLI flag and help, its place in the device mesh, whether it is a
factor of the world size, and its technique: the object that holds its check, its apply and its planner cost
terms (technique.py; one package per technique: dp/, tp/, pp/, cp/, ep/). From this
registry come the degree options of `train`, `verify`, `doctor`, `launch` and `plan` (cli.py), the run
config's degree fields (config.py), Layout's degree fields, DIM_NAMES and mesh order (layout.py), the checks
(checks.py), the plan request and the planner's search over degrees (plan/plan_cli.py, plan/search.py), and
what launchers and bench write (launchers/, bench/scaling.py).

Importing this file imports no torch (`plan` answered from its cache runs none): a technique's module imports
torch-using code inside its methods. The cost terms take what they need from the planner as arguments, so
parallel/ never imports plan/.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

from paratrain.errors import UserError, flag_of
from paratrain.parallel.cp.cp_technique import CONTEXT_PARALLEL
from paratrain.parallel.dp.dp_technique import DATA_PARALLEL
from paratrain.parallel.ep.ep_technique import EXPERT_PARALLEL
from paratrain.parallel.pp.pp_technique import PIPELINE_PARALLEL
from paratrain.parallel.technique import Technique
from paratrain.parallel.tp.tp_technique import TENSOR_PARALLEL


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
    # its check, its apply (parallelize()) and its planner cost terms; the default does nothing
    technique: Technique = Technique()

    @property
    def flag(self) -> str:
        return flag_of(self.name)

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
        technique=DATA_PARALLEL),
    Dim("dp_shard", "data-parallel shards (FSDP / ZeRO)", mesh_order=20, fix_help="fix: data-parallel shards",
        technique=DATA_PARALLEL),
    # innermost: TP's collectives are the most frequent, so it stays on the fastest links (inside a node)
    Dim("tp", "tensor-parallel degree", mesh_order=40, technique=TENSOR_PARALLEL),
    # outermost: a pipeline sends the least
    Dim("pp", "pipeline-parallel degree", mesh_order=0, fix_help="fix: pipeline degree",
        technique=PIPELINE_PARALLEL),
    Dim("cp", "context-parallel degree", mesh_order=30, technique=CONTEXT_PARALLEL),
    # expert parallelism: each MoE layer's experts split over ep of the data-parallel ranks (as torchtitan does);
    # the expert weights are FSDP-sharded over the other dp_shard x cp / ep ranks
    Dim("ep", "expert-parallel degree (MoE models: experts split over this many data-parallel ranks)",
        mesh_order=35, within=("dp_shard", "cp"), fix_help="fix: expert-parallel degree",
        technique=EXPERT_PARALLEL),
]
_read = False
# "module:NAME[,module:NAME]": Dim objects every paratrain process (its workers too: PARATRAIN_* variables are
# forwarded) registers when the registry is first read, before the CLI, the config or the Layout is built
DIMS_ENV = "PARATRAIN_DIMS"
_loading = False


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
    global _read, _loading
    if not _read and not _loading:
        _loading = True
        try:
            register_declared(os.environ.get(DIMS_ENV, ""))
        except UserError as exc:
            # read while paratrain's modules are imported, before the CLI can catch anything: one line, exit 2
            sys.stderr.write(f"error: {exc}\n")
            raise SystemExit(UserError.exit_code) from None
        finally:
            _loading = False
    _read = True
    return tuple(_REGISTRY)


def register_declared(spec: str) -> None:
    """Register each Dim that a "module:NAME" of `spec` names (PARATRAIN_DIMS); one UserError line for a bad
    entry."""
    for item in filter(None, (part.strip() for part in spec.split(","))):
        module_name, _, name = item.partition(":")
        try:
            dim = getattr(importlib.import_module(module_name), name)
        except Exception as exc:  # noqa: BLE001 - ImportError, AttributeError, or what the module raised
            raise UserError(f"{DIMS_ENV}: cannot load {item!r} (MODULE:NAME of a Dim): "
                            f"{type(exc).__name__}: {exc}") from None
        if not isinstance(dim, Dim):
            raise UserError(f"{DIMS_ENV}: {item!r} is not a Dim (paratrain.parallel.dims.Dim)")
        if all(d.name != dim.name for d in _REGISTRY):  # a module registering itself on import counts once
            register_dim(dim)


def dims_in_mesh_order() -> tuple[Dim, ...]:
    """Every dimension, outermost first: Layout's degree fields and every `dims` JSON object."""
    return tuple(sorted(all_dims(), key=lambda d: d.mesh_order))


def mesh_dims() -> tuple[Dim, ...]:
    """The world-size factors, outermost first: the DeviceMesh, a rank's coordinates, the planner's factorings."""
    return tuple(d for d in dims_in_mesh_order() if d.world_factor)


def dim_named(name: str) -> Dim:
    return next(d for d in all_dims() if d.name == name)


def techniques() -> tuple[Technique, ...]:
    """Every dimension's technique once (data parallelism's two dims share one), in the dims' option order."""
    return tuple({id(d.technique): d.technique for d in all_dims()}.values())
