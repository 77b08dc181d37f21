"""A transformers config's parameter counts as transformers builds the model: `plan --hf-config` and `--model hf:`
report these, exactly, whatever the architecture (MLA, sliding windows, sinks, shared experts, linear attention).

The model is built on the meta device (AutoModelForCausalLM.from_config: shapes only, no memory) and its
parameters counted, a tied table once. Which are routed experts is read from the modules' shapes, not from the
model type (models/hf_moe_layout.py moe_layers): `expert_split` is the one place that asks it. The counts are
cached on disk by the config and the transformers version (plan/tracing/trace_cache.py), so a plan answered from
the cache builds nothing.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelCounts:
    params: int  # every parameter (a tied embedding and head once)
    active: int  # those one token uses: of each MoE layer's routed experts, top-k of E
    embedding: int  # the input token table (a lookup: not in the FLOP count unless it is also the head)
    tied: bool  # the head is the token table
    experts: int  # the routed experts' parameters, all of them
    moe_layers: int

    @property
    def non_embedding(self) -> int:
        """The FLOP convention's N (models/presets.py): all but the input table, which a tied head keeps."""
        return self.params if self.tied else self.params - self.embedding

    @property
    def active_non_embedding(self) -> int:
        return self.active if self.tied else self.active - self.embedding


def expert_split(model) -> tuple[int, int, int]:
    """(routed expert parameters, those one token uses, MoE layers) of a transformers model, by shape."""
    from paratrain.models.hf_moe_layout import moe_layers

    layers = moe_layers(model)
    routed = sum(layer.expert_numel for layer in layers)
    used = sum(layer.expert_numel * min(layer.top_k or layer.n_experts, layer.n_experts) // layer.n_experts
               for layer in layers)
    return routed, used, len(layers)


def count_model(model) -> ModelCounts:
    """The counts of a built transformers causal LM (any device, meta included)."""
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    table = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is table
    routed, used, moe = expert_split(model)
    return ModelCounts(params=params, active=params - routed + used, embedding=table.numel(), tied=tied,
                       experts=routed, moe_layers=moe)


def transformers_counts(doc: dict, where: str = "config.json") -> ModelCounts:
    """The counts of the model a config document describes, built on the meta device (cached on disk)."""
    return _counts(json.dumps(doc, sort_keys=True, default=str), where)


@functools.lru_cache(maxsize=16)
def _counts(text: str, where: str) -> ModelCounts:
    import importlib.metadata

    from paratrain.plan.tracing.trace_cache import cached

    key = {"config": json.loads(text), "transformers": importlib.metadata.version("transformers")}
    return cached("counts", key, lambda: _build_and_count(json.loads(text), where), lambda d: ModelCounts(**d))


def _build_and_count(doc: dict, where: str) -> ModelCounts:
    from paratrain.models.hf_model import hf_config_object, meta_model

    return count_model(meta_model(hf_config_object(doc, where)))
