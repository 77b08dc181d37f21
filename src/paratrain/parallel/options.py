"""The strategy options parallelize() needs, separate from the whole run config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelOptions:
    strategy: str = "single"
    device_type: str = "cpu"
    dtype: str = "fp32"  # fp32 | bf16 | fp16: compute dtype
    ac: str = "none"  # none | selective | full
    compile: bool = False
    sp: bool = False
    cp_impl: str = "ring"
    pp_schedule: str = "1f1b"
    microbatches: int | None = None
    virtual_stages: int = 1
    ddp_comm_hook: str = "none"
    local_sgd_period: int = 0
    cpu_offload: bool = False
    powersgd_start: int = 2  # plain all-reduce steps before PowerSGD compresses (torch suggests ~10% of the run)

    @property
    def zero_stage(self) -> int:
        return {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}.get(self.strategy, 0)

    @classmethod
    def from_config(cls, cfg, device_type: str) -> ParallelOptions:
        strategy = cfg.strategy
        return cls(strategy=strategy, device_type=device_type, dtype=cfg.dtype, ac=cfg.ac, compile=cfg.compile,
                   sp=cfg.sp or strategy == "tp-sp",
                   cp_impl="ulysses" if strategy == "cp-ulysses" else ("ring" if strategy == "cp-ring" else cfg.cp_impl),
                   pp_schedule=cfg.pp_schedule, microbatches=1 if strategy == "model" else cfg.microbatches,
                   virtual_stages=cfg.virtual_stages, ddp_comm_hook=cfg.ddp_comm_hook,
                   local_sgd_period=cfg.local_sgd_period, cpu_offload=cfg.cpu_offload,
                   powersgd_start=max(2, cfg.warmup_steps, cfg.steps // 10))
