"""PlanRequest: what `paratrain plan` was asked, typed. The CLI builds it; plan/plan_cli.py and `plan --calibrate`
read its attributes. A choice left None is searched; one given is fixed."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePath

from paratrain.parallel.dims import all_dims


@dataclass(frozen=True)
class PlanRequest:
    # the model: a preset (or hf:PATH), or a Hugging Face config.json
    model: str | None = None
    hf_config: str | None = None
    # the cluster: --gpu NAME (or a list per node), a --cluster file, a --hardware profile, or custom figures
    gpu: str | None = None
    mig: str | None = None  # --mig PROFILE: each device is that MIG slice of --gpu (gpu_catalog.mig_slice)
    cluster: str | None = None
    gpus: int | None = None
    nodes: int | None = None
    hardware: str | None = None
    peak_tflops: float | None = None
    mem_gib: float | None = None
    mem_bw_gbs: float | None = None  # a board's memory bandwidth (GB/s) where it is not the catalog's
    intra_node_gbs: float | None = None
    inter_node_gbs: float | None = None
    # the job
    seq_len: int | None = None
    global_batch: int | None = None
    dtype: str = "bf16"
    compile: bool = False
    optimizer: str | None = None  # --optimizer, --momentum: the optimizer state the memory holds (None: adamw, 0)
    momentum: float | None = None
    train_flags: tuple[str, ...] = ()  # training options passed on to the candidates' commands (plan/passed_on.py)
    # --lora-r, --lora-alpha, --lora-targets, --lora-dropout (None: not given): adapters on a frozen base, priced
    # (plan/inputs/lora_count.py)
    lora_r: int | None = None
    lora_alpha: float | None = None
    lora_targets: str | None = None
    lora_dropout: float | None = None
    # schemes the cost model prices that paratrain's runtime does not run (plan/priced_job.py Job)
    dist_optimizer: bool = False
    async_tp: bool = False
    moe_routing: str = "random"
    half_weights: bool = False
    # the answer
    top: int = 10
    search: str = "fast"
    # fixed choices (None: searched); degrees has one entry per dimension (parallel/dims.py)
    strategy: str | None = None
    degrees: Mapping[str, int | None] = field(default_factory=dict)
    micro_batch: int | None = None
    ac: str | None = None
    sp: bool | None = None
    cp_impl: str | None = None
    pp_schedule: str | None = None
    virtual_stages: int | None = None
    # --calibrate: measure this machine first, with nproc processes and calibrate_rounds timed rounds
    calibrate: bool = False
    nproc: int = 2
    calibrate_rounds: int = 9

    def __post_init__(self) -> None:
        names = [d.name for d in all_dims()]
        unknown = set(self.degrees) - set(names)
        if unknown:
            raise TypeError(f"unknown parallel dimension(s) {sorted(unknown)}; known: {', '.join(names)}")
        object.__setattr__(self, "degrees", {n: self.degrees.get(n) for n in names})

    @classmethod
    def of(cls, values: Mapping) -> PlanRequest:
        """From flat options (the CLI's, or a script's dict), each dimension's degree under its own name."""
        names = {d.name for d in all_dims()}
        rest = {k: str(v) if isinstance(v, PurePath) else v for k, v in values.items() if k not in names}
        return cls(**rest, degrees={k: v for k, v in values.items() if k in names})

    def replace(self, **changes) -> PlanRequest:
        return dataclasses.replace(self, **changes)
