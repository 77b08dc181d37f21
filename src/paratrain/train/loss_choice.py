"""Which loss a run's step takes: the cross-entropy of the model's logits (train/step.lm_loss), or the fused
linear + cross-entropy its output head takes itself given the targets (--fused-loss, --loss-chunks N > 1:
models/fused_loss.py), and the runs that cannot take the fused one, refused in one line: by train's validation
(train/validate.py) and a custom model's checks (train/custom.py)."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.errors import UserError


@dataclass(frozen=True)
class FusedLoss:
    """The model's head takes the targets and returns the mean loss over the real ones (no logits come out)."""

    chunks: int | None = None  # token chunks; None: models/fused_loss.loss_chunks_for's count

    @classmethod
    def of(cls, cfg) -> FusedLoss | None:
        """The run's fused loss: --fused-loss (chunks: --loss-chunks N if N > 1, else the head's count), or
        --loss-chunks N > 1 alone (the chunked loss is the fused one); None: the plain loss of the logits."""
        if not (cfg.fused_loss or cfg.loss_chunks > 1):
            return None
        return cls(cfg.loss_chunks if cfg.loss_chunks > 1 else None)

    def model_kwargs(self, targets) -> dict:
        return {"targets": targets, "loss_chunks": self.chunks}


def check_fused_loss(cfg, layout, custom_name: str | None = None, hf: bool = False) -> None:
    """One line where the fused loss cannot run: it needs a paratrain model's output head (a preset), whole on
    this rank's forward (not split over the vocabulary by tensor parallelism's loss parallel, not on a pipeline's
    last stage, whose schedule takes the loss of the stage's output), and a loss scale it does not need to know
    in the forward (not fp16's)."""
    if FusedLoss.of(cfg) is None:
        return
    flag = "--fused-loss" if cfg.fused_loss else f"--loss-chunks {cfg.loss_chunks}"
    drop = f"drop {flag}"
    if custom_name is not None:
        raise UserError(f"{flag} takes the loss inside a paratrain model's output head; the custom model "
                        f"{custom_name} computes its own outputs (and loss): {drop}")
    if hf:
        raise UserError(f"{flag} is not supported for --model hf: models: transformers computes the logits inside "
                        f"its own forward (some models scale or cap them there): {drop}, or train a paratrain preset")
    if layout.splits_within_layers:
        raise UserError(f"{flag} is not supported with tensor parallelism (tp={layout.tp}) yet: its loss parallel "
                        f"keeps the logits split over the vocabulary across ranks: {drop} or run without --tp")
    if layout.splits_stages:
        raise UserError(f"{flag} is not supported with pipeline parallelism (pp={layout.pp}) yet: the schedule takes "
                        f"the loss of the last stage's output logits: {drop} or run without --pp")
    if cfg.dtype == "fp16":
        raise UserError(f"{flag} writes the logits' gradient in the forward, before fp16's loss scale is known (it "
                        f"would underflow): use --dtype bf16 or fp32, or {drop}")
