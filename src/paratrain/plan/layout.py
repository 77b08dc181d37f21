"""Layout: one fully specified way to run a job (degrees, ZeRO stage, SP, CP flavour, pipeline schedule, micro-batching,
activation checkpointing), in the runtime's own vocabulary, so a plan candidate can be passed to `train` unchanged."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from paratrain.parallel.dims import DIM_NAMES, ParallelDims


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    zero_stage: int = 0  # 0: none / DDP, 1: ZeroRedundancyOptimizer, 2: FSDP2 no reshard, 3: FSDP2
    sp: bool = False
    cp_impl: str = "ring"
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batch: int = 1  # sequences per forward pass per rank
    microbatches: int = 1  # pipeline micro-batches (pp > 1) or gradient-accumulation steps (pp == 1)
    ac: str = "none"

    # -- derived --------------------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        return self.dp_shard > 1

    @property
    def ddp(self) -> bool:
        """The runtime wraps DDP over dp_cp when nothing is sharded but ranks replicate (data or CP)."""
        return self.dp_shard == 1 and (self.dp_replicate > 1 or self.cp > 1)

    @property
    def shard_degree(self) -> int:
        """FSDP shards over dp_shard x cp (the flattened dp_shard_cp mesh)."""
        return self.dp_shard * self.cp if self.fsdp else 1

    def degrees(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in DIM_NAMES}

    def to_dims(self) -> ParallelDims:
        return ParallelDims(**self.degrees(), world_size=self.world)

    @property
    def strategy(self) -> str:
        """The `--strategy` name train needs (with the degrees given explicitly)."""
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

    def label(self) -> str:
        parts = [f"{n}={getattr(self, n)}" for n in DIM_NAMES if getattr(self, n) > 1]
        extra = []
        if self.tp > 1 and self.sp:
            extra.append("sp")
        if self.cp > 1:
            extra.append(self.cp_impl)
        if self.pp > 1:
            extra.append(self.pp_schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""))
        body = " x ".join(parts) or "1 device"
        return f"{self.strategy} [{body}{'; ' + ', '.join(extra) if extra else ''}]"

    def train_args(self, model: str, seq_len: int, global_batch: int, dtype: str) -> list[str]:
        """`paratrain train` arguments that run exactly this layout."""
        args = ["--model", model, "--strategy", self.strategy, "--nproc", str(self.world)]
        for n in DIM_NAMES:
            args += [f"--{n.replace('_', '-')}", str(getattr(self, n))]
        if self.tp > 1:
            args.append("--sp" if self.sp else "--no-sp")
        if self.cp > 1:
            args += ["--cp-impl", self.cp_impl]
        if self.pp > 1:
            args += ["--pp-schedule", self.pp_schedule, "--virtual-stages", str(self.virtual_stages),
                     "--microbatches", str(self.microbatches)]
        args += ["--micro-batch", str(self.micro_batch), "--ac", self.ac, "--seq-len", str(seq_len),
                 "--global-batch", str(global_batch), "--dtype", dtype]
        return args

    def to_dict(self) -> dict:
        return asdict(self)


def zero_stage_of(strategy: str) -> int:
    return {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}.get(strategy, 0)


def layout_from_config(cfg, world_size: int) -> Layout:
    """The Layout a train config runs, resolved exactly as the trainer resolves it (dims, micro-batching)."""
    from paratrain.parallel.options import ParallelOptions
    from paratrain.parallel.pipeline_split import resolve_microbatches
    from paratrain.train.trainer import dims_for, micro_batch_for

    dims = dims_for(cfg, world_size) if world_size > 1 else ParallelDims(world_size=1)
    options = ParallelOptions.from_config(cfg, "cpu")
    local = cfg.global_batch // dims.dp
    if dims.pp > 1:
        microbatches = resolve_microbatches(cfg.strategy, cfg.microbatches, cfg.micro_batch, local, dims.pp)
        micro = local // microbatches
    else:
        micro = micro_batch_for(cfg, dims)
        microbatches = max(1, local // micro)
    return Layout(pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp,
                  zero_stage=options.zero_stage if dims.dp > 1 else 0, sp=options.sp and dims.tp > 1,
                  cp_impl=options.cp_impl, pp_schedule="gpipe" if cfg.strategy == "model" else options.pp_schedule,
                  virtual_stages=options.virtual_stages, micro_batch=micro, microbatches=microbatches, ac=cfg.ac)
