"""How a paratrain model computes, chosen when it is built: ModelSpeed, given to presets.build_model. Plain Python,
no torch (the planner may ask it); models/fast_paths.py holds what the options swap in.

These options change the arithmetic's layout, never the model: parameter names, shapes and init are the same
either way, so checkpoints (their manifests hold ModelArgs), exports and the planner's traces (keyed by ModelArgs)
do not see them. ModelSpeed() is the model as it always computed.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.errors import UserError


@dataclass(frozen=True)
class ModelSpeed:
    # the residual stream between blocks in bf16 under bf16 autocast (--bf16-residual); the norms read and write
    # bf16 and keep their statistics in fp32 inside torch's kernels. Without bf16 autocast (fp32, fp16) it
    # changes nothing
    bf16_residual: bool = False
    # Q, K and V as one GEMM over the concatenation of wq, wk and wv (--fused-qkv); the three stay parameters
    fused_qkv: bool = False

    def refuse_head_split(self, tp: int) -> None:
        """Asked where tensor parallelism splits the heads (parallel/tp/tp_technique.py, a TP plan): it shards wq,
        wk and wv each by heads, and their concatenation is no sharded matrix."""
        if self.fused_qkv:
            raise UserError(f"--fused-qkv is not supported with tensor parallelism (tp={tp}) yet: tp splits wq, wk "
                            "and wv each by heads; drop --fused-qkv or run without --tp")


def model_speed_for(cfg) -> ModelSpeed:
    """The speed options a run config asks for (its bf16_residual and fused_qkv; a config without them: off)."""
    return ModelSpeed(bf16_residual=bool(getattr(cfg, "bf16_residual", False)),
                      fused_qkv=bool(getattr(cfg, "fused_qkv", False)))
