"""The tensors of a transformers model as its `save_pretrained` writes them, which is not always its state dict.

transformers 5 holds some weights in another layout than its checkpoints: MoE experts fused into 3-D
`gate_up_proj` / `down_proj` tensors in memory, one 2-D weight per expert on disk (Qwen3-MoE and OLMoE:
`experts.N.gate_proj/up_proj/down_proj.weight`; Mixtral: `block_sparse_moe.experts.N.w1/w3/w2.weight`). On save
it reverts its own loading conversions (`transformers.core_model_loading.revert_weight_conversion`), and on load
it fuses them again. We use that same function, so the exported key set is exactly what save_pretrained writes
and no per-architecture table is kept here: run once on the meta model's whole key set (the names and shapes to
write) and once per tensor (which written tensors come from it). A conversion that builds one written tensor
from several state-dict tensors is not split per tensor; the state-dict names are then written as they are,
which from_pretrained also loads.
"""

from __future__ import annotations

import functools

import torch

from paratrain.interop.hf_format import HFTensor, renamed


def saved_format_specs(model, expected: dict[str, tuple], by_name: dict[str, str]) -> list[HFTensor]:
    """HFTensor specs writing `expected` (the model's state-dict names -> shapes; checkpoint FQN in `by_name`)
    in save_pretrained's layout. `model`: the transformers model on the meta device."""
    plain = [renamed(name, by_name[name], shape) for name, shape in expected.items()]
    revert = _reverter()
    if revert is None:
        return plain
    meta = {name: torch.empty(shape, device="meta") for name, shape in expected.items()}
    whole = revert(model, dict(meta))
    if set(whole) == set(expected):
        return plain
    specs, made = [], set()
    for name in expected:
        outputs = revert(model, {name: meta[name]})
        cut = _Cutter(model, revert, name, len(outputs))
        specs += [HFTensor(out, (by_name[name],), tuple(t.shape), functools.partial(cut, out), _no_import)
                  for out, t in outputs.items()]
        made.update(outputs)
    if made != set(whole) or len(specs) != len(whole):  # a many-to-one conversion: keep the state-dict layout
        return plain
    return specs


def _reverter():
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: its state dict is what it saves
        return None
    return revert_weight_conversion


class _Cutter:
    """(written name, loaded source tensor) -> that written tensor. The source is reverted once and its outputs
    kept only until each has been taken (they are views of it: keeping them would keep it in memory)."""

    def __init__(self, model, revert, source: str, n_outputs: int):
        self.model, self.revert, self.source, self.n = model, revert, source, n_outputs
        self.outputs: dict | None = None
        self.taken = 0

    def __call__(self, out: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.outputs is None:
            self.outputs, self.taken = self.revert(self.model, {self.source: tensor}), 0
        result = self.outputs[out].contiguous()
        self.taken += 1
        if self.taken == self.n:
            self.outputs = None
        return result


def _no_import(tensor: torch.Tensor):
    raise NotImplementedError("export only: paratrain loads hf: weights through transformers itself")
