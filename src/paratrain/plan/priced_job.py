"""Job: what every candidate the search prices shares: the model, the devices, the batch and the run options,
resolved by plan/plan_cli.py from what `plan` was asked (plan/request.py's PlanRequest)."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.models.args import ModelArgs
from paratrain.plan.inputs.hf_count import ModelCounts
from paratrain.plan.inputs.lora_count import LoraChoice


@dataclass
class Job:
    args: ModelArgs
    model_name: str
    gpus: int
    seq_len: int
    global_batch: int
    dtype: str = "bf16"
    device_type: str = "cuda"
    mem_reserve: float = 0.08  # fraction of device memory kept free: allocator fragmentation, CUDA context
    optimizer: str = "adamw"  # --optimizer and --momentum: how much optimizer state each parameter keeps
    momentum: float = 0.0
    # the other training options given to plan (--grad-clip, --lr-schedule, ...): they price nothing, and a
    # candidate's command passes them on to train
    train_flags: tuple[str, ...] = ()
    hf_config: str | None = None  # the model came from this config.json (not a preset)
    counts: ModelCounts | None = None  # the parameters transformers builds from that config (inputs/hf_count.py)
    compile: bool = False  # torch.compile (time model: fused memory-bound ops)
    # priced, not run by paratrain's runtime: TP collectives overlapped with the matmuls (torch's micro-pipelined
    # async TP, torch._inductor.config._micro_pipeline_tp; needs compile and SP), and ZeRO-1 run as a distributed
    # optimizer (gradients reduce-scattered and parameters all-gathered once per step, both overlapped)
    async_tp: bool = False
    dist_optimizer: bool = False
    # which experts a token's k choices are, for --ep's exchange (costs/expert_spread.py): "random" (a
    # trained, balanced router) unless a benchmark's gate says otherwise (benchmarks/published_runs.json)
    moe_routing: str = "random"
    # weights held in the compute dtype, fp32 masters in the optimizer, gradients accumulated in fp32 by the
    # weight-gradient GEMMs (Megatron's Float16Module and gradient-accumulation fusion): no autocast casts
    half_weights: bool = False
    # --lora-r: adapters on a frozen base (plan/inputs/lora_count.py LoraChoice: the spec, the adapters' count)
    lora: LoraChoice | None = None

    def layout_options(self) -> dict:
        """The run options a Layout carries (FP8 runs its non-matmul work, and is traced, in bf16)."""
        options = {"dtype": "bf16" if self.dtype == "fp8" else self.dtype, "compile": self.compile}
        if self.lora:
            spec = self.lora.spec
            options.update(lora_r=spec.r, lora_targets=tuple(spec.targets), lora_dropout=spec.dropout)
        return options

    @property
    def optimizer_states(self) -> int:
        from paratrain.training_options import optimizer_states

        return optimizer_states(self.optimizer, self.momentum)

    def optimizer_flags(self) -> list[str]:
        """The train flags of a non-default optimizer (a candidate's command repeats them)."""
        flags = [] if self.optimizer == "adamw" else ["--optimizer", self.optimizer]
        return flags + (["--momentum", f"{self.momentum:g}"] if self.momentum else []) + list(self.train_flags)

    def model_flags(self) -> list[str]:
        """How `paratrain train` names this model: the preset, or (hf:) the config file it was read from."""
        return ["--model", f"hf:{self.hf_config}"] if self.hf_config else ["--model", self.model_name]

    @property
    def flops_per_token(self) -> float:
        from paratrain.models.presets import count_params, flops_per_token

        every = flops_per_token(self.args, self.seq_len)
        if self.counts is None:
            return every
        # models/presets.py's convention (6 N + attention) with N the active parameters transformers builds
        attention = every - 6.0 * count_params(self.args, include_embedding=False, active=True)
        return 6.0 * self.counts.active_non_embedding + attention
