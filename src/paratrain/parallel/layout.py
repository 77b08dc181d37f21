"""Layout: the one description of a parallel run, shared by train, plan, bench and doctor.

It holds the degrees and every option that shapes the run; every derived fact (DDP or FSDP, the shard
degree, a rank's coordinates, a group's size and node placement, the ideal pipeline bubble) is a property
here and nowhere else. strategies.py turns a config into a Layout; checks.py validates one against a model.

The degree fields come from the dimension registry (dims.py), one per dimension, in mesh order: today
pp, dp_replicate, dp_shard, cp, tp (outermost first).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

from paratrain.errors import UserError
from paratrain.parallel.dims import dim_named, dims_in_mesh_order, mesh_dims
from paratrain.parallel.options import AC_MODES, CP_IMPLS, DEFAULT_PP_SCHEDULE
from paratrain.parallel.strategy_table import STRATEGY_TABLE

log = logging.getLogger("paratrain")

DIM_NAMES = tuple(d.name for d in mesh_dims())  # the world-size factors, outermost first
DEGREE_DIMS = dims_in_mesh_order()  # every degree field (also those adding no ranks)
DEGREE_NAMES = tuple(d.name for d in DEGREE_DIMS)
_SUBDIVIDING = tuple(d for d in DEGREE_DIMS if d.within)

# flattened views: data loading uses "dp", FSDP shards over "dp_shard_cp", the loss averages over "dp_cp"
GROUP_DIMS: dict[str, tuple[str, ...]] = {
    **{n: (n,) for n in DIM_NAMES},
    "dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
FLATTENED = {name: dims for name, dims in GROUP_DIMS.items() if len(dims) > 1}
# flattened only for DTensor, which looks a flattened view up by its ranks: a weight FSDP shards and TP splits has
# its grad norm partial on both dims, then summed in one all-reduce instead of two in sequence (which DTensor warns
# may order the sums differently on different ranks)
REDUCTION_VIEWS = (("dp_shard", "cp", "tp"),)


def subdivision_problem(degrees: dict[str, int]) -> str | None:
    """Why a dim that adds no ranks (dims.py `within`) cannot subdivide the ranks it lives in, or None."""
    for dim in _SUBDIVIDING:
        ranks = math.prod(degrees[d] for d in dim.within)
        if ranks % degrees[dim.name]:
            return (f"{dim.flag} {degrees[dim.name]} must divide the {' x '.join(dim.within)} ranks ({ranks}): "
                    f"{_ways_to_subdivide(dim, degrees[dim.name])}")
    return None


def _ways_to_subdivide(dim, degree: int) -> str:
    """The options that give a dim that adds no ranks some to split: the strategies that fill it, or its first
    `within` dim set to a multiple of its degree."""
    ways = [f"--strategy {name}" for name, row in STRATEGY_TABLE.items() if row.fills == dim.name]
    ways.append(f"{dim_named(dim.within[0]).flag} N with N a multiple of {degree}")
    return f"give it ranks to split with {' or '.join(ways)}"


def _with_degree_fields(cls):
    """One `int = 1` field per registered dimension (dims.py), in mesh order, before the class's own fields."""
    cls.__annotations__ = {**{name: "int" for name in DEGREE_NAMES}, **cls.__dict__.get("__annotations__", {})}
    for name in DEGREE_NAMES:
        setattr(cls, name, 1)
    return cls


@dataclass(frozen=True)
@_with_degree_fields
class Layout:
    # the degrees: one field per dimension, from dims.py (layout.pp, layout.tp, ...)
    zero_stage: int = 0  # 0: none / DDP, 1: ZeroRedundancyOptimizer, 2: FSDP2 no reshard, 3: FSDP2
    sp: bool = False
    cp_impl: str = CP_IMPLS[0]
    pp_schedule: str = DEFAULT_PP_SCHEDULE
    virtual_stages: int = 1
    micro_batch: int = 1  # sequences per forward pass per rank
    microbatches: int = 1  # pipeline micro-batches (pp > 1) or gradient-accumulation steps (pp == 1)
    ac: str = AC_MODES[0]  # none | selective | full
    dtype: str = "fp32"  # compute dtype: fp32 | bf16 | fp16
    compile: bool = False
    ddp_comm_hook: str = "none"
    local_sgd_period: int = 0
    # --semi-sync (parallel/semi_sync/): "diloco" | "streaming-diloco", or "" (off); data parallelism then stays
    # inside each island (dp_replicate coordinate) and the islands meet only in the outer step
    semi_sync: str = ""
    cpu_offload: bool = False
    powersgd_start: int = 2  # plain all-reduce steps before PowerSGD compresses
    # uneven splits (parallel/uneven_split.py); empty: even. dp_micro_batches: each data-parallel rank's micro-batch
    # (then micro_batch is the largest of them); pp_layers: transformer blocks per pipeline stage
    dp_micro_batches: tuple[int, ...] = ()
    pp_layers: tuple[int, ...] = ()
    # --lora-r: rank-r adapters on the lora_targets linears (the model's own module names; (): its family's
    # default), the base frozen; 0: every parameter trains. The planner prices them (plan/tracing/lora_trace.py)
    lora_r: int = 0
    lora_targets: tuple[str, ...] = ()
    lora_dropout: float = 0.0
    mesh: object = field(default=None, repr=False, compare=False, hash=False)
    # per dim that adds no ranks (dims.py `within`) and is > 1: its ranks' mesh split as (<name>_rest, <name>)
    split_meshes: dict = field(default=None, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        for dim in DEGREE_DIMS:
            value = getattr(self, dim.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"degree {dim.flag} must be a positive integer, got {value!r}")
        problem = _SUBDIVIDING and subdivision_problem(self.degrees())
        if problem:
            raise UserError(problem)
        for name in ("dp_micro_batches", "pp_layers", "lora_targets"):  # from_dict() hands JSON lists
            object.__setattr__(self, name, tuple(getattr(self, name)))

    # -- sizes ------------------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return math.prod(getattr(self, n) for n in DIM_NAMES)

    world_size = world

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    # -- what the run does to the model: the questions callers outside parallel/ ask (not a degree by name) ----
    @property
    def splits_stages(self) -> bool:
        """Each rank holds pipeline stages, not the whole model: the step runs a pipeline schedule."""
        return self.pp > 1

    @property
    def splits_within_layers(self) -> bool:
        """Each layer's matmuls are split over ranks (tensor parallel): the model needs a TP plan, and its
        weights and outputs are DTensors."""
        return self.tp > 1

    @property
    def splits_sequences(self) -> bool:
        """Each rank holds a slice of every sequence (context parallel): batches are sharded along the sequence."""
        return self.cp > 1

    @property
    def splits_experts(self) -> bool:
        """Each MoE layer's experts are split over ranks (expert parallel)."""
        return self.ep > 1

    @property
    def data_parallel_only(self) -> bool:
        """Every rank holds the whole model and whole sequences, nothing sharded: ranks differ only in the data
        they read (a single device, DDP or ZeRO-1)."""
        return all(getattr(self, n) == 1 for n in DEGREE_NAMES if n != "dp_replicate")

    @property
    def uneven_split(self) -> str:
        """Which uneven split the runtime runs on a mixed cluster (parallel/uneven_split.py): "batch"
        (--dp-batch-split: data parallelism alone, no tp / cp / pp), "blocks" (--pp-layers: a pipeline without
        data parallelism), or "" (neither: every rank takes its even share)."""
        if self.pp == 1 and self.tp == 1 and self.cp == 1:
            return "batch"
        if self.pp > 1 and self.dp == 1:
            return "blocks"
        return ""

    def degrees(self) -> dict[str, int]:
        """Every degree, outermost first (the `dims` of plan, bench and verify JSON)."""
        return {n: getattr(self, n) for n in DEGREE_NAMES}

    # -- the data-parallel wrapper: the one "DDP or FSDP?" rule -----------------------------------------
    @property
    def fsdp(self) -> bool:
        """FSDP2 (ZeRO-2/3, HSDP) wraps the model whenever parameters are sharded over dp_shard."""
        return self.dp_shard > 1

    @property
    def ddp(self) -> bool:
        """DDP over dp_cp when nothing is sharded but ranks replicate (data or context parallel); under --semi-sync
        over an island's context-parallel ranks only (the replicas meet in the outer step instead)."""
        return self.dp_shard == 1 and ((self.dp_replicate > 1 and not self.semi_sync) or self.cp > 1)

    @property
    def shard_degree(self) -> int:
        """FSDP shards over dp_shard x cp (the flattened dp_shard_cp mesh); 1 when nothing is sharded."""
        return self.dp_shard * self.cp if self.fsdp else 1

    @property
    def fsdp_group(self) -> str:
        return "dp_shard_cp" if self.cp > 1 else "dp_shard"

    # -- ranks and groups ---------------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along each dim, in the mesh layout above."""
        out = {}
        for name in reversed(DIM_NAMES):
            size = getattr(self, name)
            out[name] = rank % size
            rank //= size
        return {n: out[n] for n in DIM_NAMES}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel replica's share of the global batch this rank reads."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def micro_batch_of(self, dp_rank: int) -> int:
        """Sequences per forward on this data-parallel rank (they differ under --dp-batch-split)."""
        return self.dp_micro_batches[dp_rank] if self.dp_micro_batches else self.micro_batch

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all data-parallel ranks."""
        per_forward = sum(self.dp_micro_batches) if self.dp_micro_batches else self.micro_batch * self.dp
        return per_forward * self.microbatches

    def group_size(self, group: str) -> int:
        size = 1
        for d in GROUP_DIMS[group]:
            size *= getattr(self, d)
        return size

    def placement(self, group: str, gpus_per_node: int) -> str:
        """"intra" when every member of the group sits in one node (ranks fill nodes in mesh order), else "inter"."""
        inner = DIM_NAMES.index(GROUP_DIMS[group][-1]) + 1
        stride = 1
        for d in DIM_NAMES[inner:]:
            stride *= getattr(self, d)
        return "intra" if stride * self.group_size(group) <= gpus_per_node else "inter"

    @property
    def ideal_bubble(self) -> float:
        """Idle fraction of a pipeline with equal stage times: (p-1) / (v*m + p-1); 0 without a pipeline."""
        if self.pp == 1:
            return 0.0
        return (self.pp - 1) / (self.virtual_stages * self.microbatches + self.pp - 1)

    # -- names --------------------------------------------------------------------------------------------
    @property
    def strategy(self) -> str:
        """The `--strategy` name that, with the degrees given explicitly, runs this layout."""
        if self.splits_experts and self.dp_replicate == 1:
            return "ep"
        if self.dp_shard > 1:
            if self.dp_replicate > 1:
                return "hsdp"
            return "zero2" if self.zero_stage == 2 else "zero3"
        if self.dp_replicate > 1:
            return "zero1" if self.zero_stage == 1 else "ddp"
        if self.pp > 1:
            return "pp"
        if self.cp > 1:
            return f"cp-{self.cp_impl}"
        if self.tp > 1:
            return "tp-sp" if self.sp else "tp"
        return "single"

    def describe(self) -> str:
        return " x ".join(f"{n}={v}" for n, v in self.degrees().items() if v > 1) or "single device"

    def label(self) -> str:
        extra = []
        if self.tp > 1 and self.sp:
            extra.append("sp")
        if self.cp > 1:
            extra.append(self.cp_impl)
        if self.pp > 1:
            extra.append(self.pp_schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.dp_micro_batches:
            extra.append("dp batches " + ":".join(map(str, self.dp_micro_batches)))
        if self.pp_layers:
            extra.append("pp layers " + ":".join(map(str, self.pp_layers)))
        if self.semi_sync:
            extra.append(f"{self.semi_sync} islands")
        body = self.describe() if self.world > 1 else "1 device"
        return f"{self.strategy} [{body}{'; ' + ', '.join(extra) if extra else ''}]"

    def to_dict(self) -> dict:
        # tuples as lists, as they come back from JSON (from_dict turns them back into tuples)
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self) if f.name not in ("mesh", "split_meshes")}  # built per run

    @classmethod
    def from_dict(cls, values: dict) -> Layout:
        return cls(**values)

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    # -- mesh ---------------------------------------------------------------------------------------------
    def with_mesh(self, device_type: str, timeout_s: float | None = None) -> Layout:
        """This layout plus its DeviceMesh (only dims with degree > 1, and the flattened views strategies use).

        Every group of the mesh gets `timeout_s` (default: the default process group's): left alone, torch
        gives sub-mesh groups its own defaults (30 min gloo, 10 min NCCL), so a stall there would outlast
        --timeout-s by far.
        """
        from torch.distributed.device_mesh import init_device_mesh

        names = [n for n in DIM_NAMES if getattr(self, n) > 1] or ["dp_replicate"]
        shape = [getattr(self, n) for n in names]
        override = _group_options(device_type, timeout_s)
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names),
                                backend_override={n: override for n in names})
        for flat, parts in FLATTENED.items():
            present = tuple(p for p in parts if p in names)
            if len(present) > 1:
                mesh[present]._flatten(flat, backend_override=override)
        for parts in REDUCTION_VIEWS:
            present = tuple(p for p in parts if p in names)
            if len(present) > 1 and present not in FLATTENED.values():
                mesh[present]._flatten("_".join(present), backend_override=override)
        log.info("device mesh %s", dict(zip(names, shape)))
        return dataclasses.replace(self, mesh=mesh, split_meshes=self._split_meshes(mesh, override))

    def _split_meshes(self, mesh, override) -> dict:
        """For each dim that adds no ranks: the ranks of its `within` dims as a 2-D mesh (<name>_rest, <name>),
        the dim innermost (an expert-parallel group is neighbouring ranks, inside a node where it can be)."""
        out = {}
        for dim in _SUBDIVIDING:
            degree = getattr(self, dim.name)
            present = tuple(p for p in dim.within if getattr(self, p) > 1)
            if degree == 1 or not present:
                continue
            flat = next((n for n, parts in FLATTENED.items() if parts == present), None)
            parent = mesh[present[0]] if len(present) == 1 else mesh[flat or present]
            if len(present) > 1 and flat is None:
                parent = parent._flatten("_".join(present), backend_override=override)
            rest = f"{dim.name}_rest"
            split = parent._unflatten(0, (parent.size() // degree, degree), (rest, dim.name),
                                      backend_override={rest: override, dim.name: override})
            # the two dims flattened back: a norm or sum over both (the grad norm of tensors sharded on both) is
            # then one collective instead of two in sequence (DTensor looks the flattened view up)
            split._flatten(backend_override=override)
            out[dim.name] = split
        return out

    def submesh(self, name: str):
        """A named (possibly flattened) sub-mesh, or None when that group is trivial here. A dim that adds no
        ranks (and its complement, <name>_rest: possibly of size 1) comes from its split mesh."""
        for dim in _SUBDIVIDING:
            if name in (dim.name, f"{dim.name}_rest"):
                split = (self.split_meshes or {}).get(dim.name)
                if split is None and getattr(self, dim.name) > 1 and self.world > 1:
                    raise RuntimeError("Layout.with_mesh() has not been called")
                return None if split is None else split[name]
        present = [p for p in GROUP_DIMS[name] if getattr(self, p) > 1]
        if not present:
            return None
        if self.mesh is None:
            raise RuntimeError("Layout.with_mesh() has not been called")
        return self.mesh[name if len(present) > 1 else present[0]]


def _group_options(device_type: str, timeout_s: float | None):
    """(backend, options) for a mesh group: the run's timeout, which torch's defaults would not carry."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if timeout_s is None:
        default = dist.distributed_c10d._get_default_group()
        timeout = default._get_backend(torch.device(device_type)).options._timeout
    else:
        timeout = timedelta(seconds=timeout_s)
    if device_type == "cuda":
        options, backend = dist.ProcessGroupNCCL.Options(), "nccl"
    else:
        options, backend = dist.ProcessGroupGloo._Options(), "gloo"
    options._timeout = timeout
    return backend, options
