"""The training options `plan` takes only to pass on: the learning-rate schedule, clipping, Adam's betas and eps,
weight decay and fp16's loss scaling change neither memory nor step time, so the planner prices nothing for them;
it checks them as `train` would (one line, exit 2) and each candidate's command repeats them, so a candidate runs
as asked (--optimizer and --momentum, which size the optimizer's state, are the Job's own)."""

from __future__ import annotations

from pydantic import ValidationError

from paratrain.errors import UserError, flag_of

PASSED_ON = ("betas", "eps", "weight_decay", "grad_clip", "lr_schedule", "warmup_steps", "min_lr",
             "loss_scale_init", "loss_scale_window")


def passed_on_flags(given: dict, dtype: str, optimizer: str | None, momentum: float | None) -> tuple[str, ...]:
    """`given`: PASSED_ON's values from the command line (None: not given). The train flags, in PASSED_ON's order,
    after the run config has checked them with plan's dtype and optimizer."""
    from paratrain.config import TrainConfig, format_validation_error

    chosen = {k: v for k, v in given.items() if v is not None}
    if not chosen:
        return ()
    optim = {k: v for k, v in (("optimizer", optimizer), ("momentum", momentum)) if v is not None}
    try:
        TrainConfig(dtype=dtype, **optim, **chosen)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc)) from None
    return tuple(part for k in PASSED_ON if k in chosen for part in (flag_of(k), f"{chosen[k]}"))
