"""LoRA on the model the planner traces: the adapters a run attaches (models/lora.py), shard for shard.

A Layout with --lora-r names its targets as the model does: a preset's own module names, an `hf:` model's
transformers names. The planner traces paratrain's twin of the model, so transformers names are read as the
twin's through the one table that maps their tensors (interop/hf_format.py); `traced_lora` gives the trace key's
(rank, twin targets, dropout). `attach_traced_adapters` freezes the traced model and adds the adapters as a run
does; under TP `shard_traced_adapters` gives them the local shapes of their placement (models/lora_tp.py:
a column-parallel base's B rows split, a row-parallel base's A columns split) and marks them as DTensors. From
there the trace measures what a LoRA step holds and runs: gradients and optimizer state of the adapters alone,
no weight-gradient GEMM for a frozen linear, and the activations autograd still saves for the input gradients.
"""

from __future__ import annotations

import dataclasses
import functools

from paratrain.models.args import ModelArgs

# the adapters' rank, the twin's module names they hang on (sorted), their dropout; () without LoRA
TracedLora = tuple


def traced_lora(args: ModelArgs, layout) -> TracedLora:
    """The trace key's LoRA of `layout` on the model `args` describes; () without --lora-r."""
    if not layout.lora_r:
        return ()
    from paratrain.models.lora import PRESET_TARGETS

    names = layout.lora_targets or PRESET_TARGETS  # an hf: model's default (q_proj, v_proj) is the twin's
    twins = _twin_names(dataclasses.replace(args, name="", n_layers=1))
    return layout.lora_r, tuple(sorted({twins.get(n, n) for n in names})), float(layout.lora_dropout)


@functools.lru_cache(maxsize=32)
def _twin_names(args: ModelArgs) -> dict[str, str]:
    """{transformers module name: paratrain module name} of the linears one HF tensor maps one to one."""
    from paratrain.interop.hf_format import hf_tensors

    out = {}
    for t in hf_tensors(args):
        if len(t.sources) == 1 and t.name.endswith(".weight") and t.sources[0].endswith(".weight"):
            hf, ours = t.name[:-len(".weight")].rsplit(".", 1)[-1], t.sources[0][:-len(".weight")].rsplit(".", 1)[-1]
            out.setdefault(hf, ours)
    return out


def attach_traced_adapters(model, lora: TracedLora) -> None:
    """Freeze `model` and give each nn.Linear a target names its adapters, as models/lora.py's attach_lora does
    (a part without a target, such as a pipeline stage without the head, keeps none)."""
    import torch
    from torch import nn

    from paratrain.models.lora import LoraSpec, add_adapter

    r, targets, dropout = lora
    spec = LoraSpec(r, float(r), tuple(targets), dropout)
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in spec.targets and type(module) is nn.Linear:
            add_adapter(module, spec, generator)


def shard_traced_adapters(model, plan: dict, tp: int, log) -> None:
    """The adapters' local shapes under the TP plan their bases follow (models/lora_tp.py adapter_placements),
    tagged as DTensors (their ops pay DTensor's dispatch)."""
    import torch
    from torch import nn
    from torch.distributed.tensor import Shard

    from paratrain.models.lora import has_adapter
    from paratrain.models.lora_tp import adapter_placements
    from paratrain.parallel.tp.tensor_parallel import match_modules

    for path, style in plan.items():
        for _, module in match_modules(model, path):
            if not has_adapter(module):
                continue
            for part, place in zip((module.lora_A, module.lora_B), adapter_placements(style)):
                w = part.weight
                if isinstance(place, Shard):
                    shape = list(w.shape)
                    shape[place.dim] //= tp
                    part.weight = nn.Parameter(torch.empty(shape, dtype=w.dtype), requires_grad=w.requires_grad)
                log.tag(part.weight)
