"""ParallelDims: the one place that knows the parallel degrees, validates them and builds the DeviceMesh.

Rank layout (outermost first): pp, dp_replicate, dp_shard, cp, tp. TP is innermost so that it stays on
the fastest links (inside a node); PP is outermost because it sends the least.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from paratrain.errors import UserError

log = logging.getLogger("paratrain")

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# flattened views: data loading uses "dp", FSDP shards over "dp_shard_cp", the loss averages over "dp_cp"
_FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
              "dp_cp": ("dp_replicate", "dp_shard", "cp")}

# strategy -> (degrees it pins to the world size, the data-parallel dim that absorbs leftover ranks)
STRATEGY_TABLE: dict[str, tuple[str | None, str]] = {
    "single": (None, "dp_replicate"),
    "ddp": ("dp_replicate", "dp_replicate"),
    "zero1": ("dp_replicate", "dp_replicate"),
    "zero2": ("dp_shard", "dp_shard"),
    "zero3": ("dp_shard", "dp_shard"),
    "fsdp": ("dp_shard", "dp_shard"),
    "hsdp": (None, "dp_shard"),
    "model": ("pp", "dp_replicate"),
    "tp": ("tp", "dp_shard"),
    "tp-sp": ("tp", "dp_shard"),
    "pp": ("pp", "dp_replicate"),
    "cp-ring": ("cp", "dp_shard"),
    "cp-ulysses": ("cp", "dp_shard"),
}


@dataclass
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    world_size: int = 1
    _mesh: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in DIM_NAMES:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"degree --{name.replace('_', '-')} must be a positive integer, got {value!r}")
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            given = " x ".join(f"{n}={getattr(self, n)}" for n in DIM_NAMES if getattr(self, n) > 1) or "all 1"
            raise UserError(f"parallel degrees multiply to {product} ({given}) but the world size is {self.world_size}")

    # -- derived sizes ---------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def degrees(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in DIM_NAMES}

    # -- rank arithmetic ---------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along each dim, in the mesh layout above."""
        out = {}
        for name in reversed(DIM_NAMES):
            size = getattr(self, name)
            out[name] = rank % size
            rank //= size
        return {n: out[n] for n in DIM_NAMES}

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    # -- validation against a model ----------------------------------------------------------------
    def check_model(self, args, seq_len: int, stages_per_rank: int = 1) -> None:
        """Every degree must divide the model dimension it splits; name the offender if not."""
        check_tp_divides(args, self.tp)
        if self.pp > 1 and args.n_layers < self.pp * stages_per_rank:
            raise UserError(f"pp={self.pp} x {stages_per_rank} stage(s) per rank = {self.pp * stages_per_rank} "
                            f"stages but the model has only {args.n_layers} layers")
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise UserError(f"cp={self.cp} needs the sequence length ({seq_len}) to be a multiple of 2*cp={2 * self.cp}")

    # -- mesh ---------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str):
        """Build the DeviceMesh (only dims with degree > 1) plus flattened views used by strategies."""
        from torch.distributed.device_mesh import init_device_mesh

        names = [n for n in DIM_NAMES if getattr(self, n) > 1] or ["dp_replicate"]
        shape = [getattr(self, n) for n in names]
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        for flat, parts in _FLATTENED.items():
            present = tuple(p for p in parts if p in names)
            if len(present) > 1:
                mesh[present]._flatten(flat)
        self._mesh = mesh
        log.info("device mesh %s", dict(zip(names, shape)))
        return mesh

    @property
    def mesh(self):
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def submesh(self, name: str):
        """A named (possibly flattened) sub-mesh, or None when that dimension is trivial here."""
        parts = _FLATTENED.get(name, (name,))
        present = [p for p in parts if getattr(self, p) > 1]
        if not present:
            return None
        return self.mesh[name if len(present) > 1 else present[0]]


def check_tp_divides(args, tp: int) -> None:
    """Tensor parallelism splits heads, kv heads, the ffn and the vocab tp ways: each must divide evenly."""
    if tp <= 1:
        return
    for label, size in (("attention heads", args.n_heads), ("kv heads", args.kv_heads),
                        ("ffn size", args.ffn_dim), ("vocab size", args.vocab_size)):
        if size % tp:
            raise UserError(f"tp={tp} does not divide the model's {label} ({size})")


def resolve_dims(strategy: str, world_size: int, given: dict[str, int | None]) -> ParallelDims:
    """Degrees for a strategy: explicit degrees win; the strategy's dim takes the rest of the world."""
    if strategy not in STRATEGY_TABLE:
        raise UserError(f"strategy {strategy!r} has no layout; known: {', '.join(STRATEGY_TABLE)}")
    pinned, absorber = STRATEGY_TABLE[strategy]
    degrees = {n: given.get(n) for n in DIM_NAMES}
    if strategy == "single" and world_size != 1:
        raise UserError(f"strategy 'single' runs on one device, but {world_size} processes were requested")
    if strategy == "hsdp" and degrees["dp_replicate"] is None and degrees["dp_shard"] is None:
        if world_size < 4 or world_size % 2:
            raise UserError(f"hsdp needs --dp-replicate and --dp-shard, or an even world size >= 4 (got {world_size})")
        degrees["dp_replicate"] = 2
    fixed = 1
    for n in DIM_NAMES:
        fixed *= degrees[n] or 1
    target = pinned if pinned and degrees[pinned] is None else absorber
    if degrees[target] is None:
        if world_size % fixed:
            raise UserError(f"parallel degrees multiply to {fixed}, which does not divide the world size {world_size}")
        degrees[target] = world_size // fixed
    dims = ParallelDims(**{n: degrees[n] or 1 for n in DIM_NAMES}, world_size=world_size)
    return dims


def describe(dims: ParallelDims) -> str:
    parts = [f"{n}={v}" for n, v in asdict(dims).items() if n in DIM_NAMES and v > 1]
    return " x ".join(parts) or "single device"
