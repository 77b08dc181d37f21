"""`plan --lora-r`: the adapters a run would train, checked and counted on the model it would build.

The options are checked as `train` checks them (the run config, then models/lora.py's refusals), and the
adapters are attached to the model itself, built on the meta device (a preset as paratrain builds it, an `hf:`
model or --hf-config as transformers builds it), with the same code a run uses: a target that names no linear
gets train's one line, and the adapters' elements are counted from the model's own linear shapes, r (in + out)
per adapted linear. The cost model then traces the adapters on its model (plan/tracing/lora_trace.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pydantic import ValidationError

from paratrain.errors import UserError, flag_of
from paratrain.lora_options import LORA_FIELDS


@dataclass(frozen=True)
class LoraChoice:
    spec: object  # models/lora.py LoraSpec
    params: int  # the adapters' elements: every parameter a LoRA run trains
    tensors: int
    flags: tuple[str, ...]  # the train flags that ask for them (a candidate's command repeats them)


def lora_choice(given: dict, dtype: str, hf_source: str | None, args) -> LoraChoice | None:
    """`given`: LORA_FIELDS' values from the command line (None: not given). None without --lora-r.
    `hf_source`: the transformers config the model comes from (None: a preset, `args`)."""
    chosen = {k: v for k, v in given.items() if v is not None}
    if not chosen:
        return None  # a plan without LoRA imports nothing more (a plan from the trace cache imports no torch)
    from paratrain.config import TrainConfig, format_validation_error
    from paratrain.models.lora import lora_spec_for

    try:
        cfg = TrainConfig(dtype=dtype, **chosen)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc)) from None
    spec = lora_spec_for(cfg, hf=hf_source is not None)
    if spec is None:
        return None
    params, tensors = count_adapters(spec, hf_source, args if hf_source is None else None)
    flags = tuple(part for k in LORA_FIELDS if k in chosen for part in (flag_of(k), f"{chosen[k]}"))
    return LoraChoice(spec, params, tensors, flags)


@functools.lru_cache(maxsize=16)
def count_adapters(spec, hf_source: str | None, args) -> tuple[int, int]:
    """(elements, tensors) of the adapters attach_lora gives the model built on the meta device."""
    from paratrain.models.lora import adapter_numels, attach_lora
    from paratrain.plan.tracing.trace import quiet_logs

    if hf_source is not None:
        from paratrain.models.hf_model import hf_config_object, meta_model
        from paratrain.plan.inputs.hf_config import read_config_doc

        model = meta_model(hf_config_object(read_config_doc(hf_source), hf_source))
    else:
        from paratrain.models.presets import build_model

        model = build_model(args, "meta", seed=None)
    with quiet_logs():
        attach_lora(model, spec, seed=0)
    numels = adapter_numels(model)
    return sum(numels.values()), len(numels)
