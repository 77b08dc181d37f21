"""A transformers model seen through paratrain's pipeline interface (tok_embeddings / layers / norm / output),
so parallel/pp/pipeline_split.py can cut it into stages like a preset.

The cut follows the model's `base_model_pp_plan` (embed_tokens -> layers -> norm, then the head). A stage runs
its part of the base model's forward: the lookup on the first stage, then its decoder layers, each given the
rotary tables of the whole sequence and no mask (causal attention), then norm and head on the last stage. A
tied head is cut like a preset's: the last stage holds a copy of the table (parallel/tied_weights.py).
Verify compares this against the unwrapped model's own forward, so a base model doing more than its pp plan says
(an embedding scale, learned positions) shows up as a mismatch instead of passing silently.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.errors import UserError
from paratrain.models.llama import ModelArgs, document_mask

NEEDED = ("embed_tokens", "layers", "norm")


class HFStages(nn.Module):
    """One pipeline stage (or the whole model) of a transformers decoder; `pipeline_view` makes the subclass that
    carries the model's shared pieces (rotary tables) and its parameter names (`hf_prefixes`)."""

    rotary: nn.Module | None = None
    hf_prefixes: dict[str, str] = {}
    may_leave_parameters_unused = True  # as the whole model (hf_model.py HFCausalLM): DDP looks for them

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = None
        self.layers = nn.ModuleDict()
        self.norm = None
        self.output = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Packed rows: per-document positions (batch, seq) and document ids, which become the block-diagonal
        causal mask every layer of the stage gets (as HFCausalLM's forward gives the whole model)."""
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand(x.shape[0], -1)
        mask = None if doc_ids is None else document_mask(doc_ids)
        tables = type(self).rotary(x, positions)
        for layer in self.layers.values():
            out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=tables)
            x = out[0] if isinstance(out, tuple) else out
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)
        return x


def pipeline_view(model: nn.Module, args: ModelArgs) -> HFStages:
    """The HFCausalLM `model` as an HFStages holding the same modules (parameters shared, not copied)."""
    hf = model.hf
    base = getattr(hf, hf.base_model_prefix, None)
    plan = getattr(hf.config, "base_model_pp_plan", None) or {}
    rotary = getattr(base, "rotary_emb", None)
    if base is None or list(plan)[:3] != list(NEEDED) or rotary is None:
        raise UserError(f"pipeline parallelism needs a transformers model whose pp plan is embed_tokens -> layers -> "
                        f"norm with rotary positions; {type(hf).__name__} has {list(plan) or 'none'}")
    prefix = hf.base_model_prefix
    names = {"tok_embeddings": f"hf.{prefix}.embed_tokens", "layers": f"hf.{prefix}.layers",
             "norm": f"hf.{prefix}.norm", "output": "hf.lm_head"}
    cls = type(f"HFStages_{type(hf).__name__}", (HFStages,), {"rotary": rotary, "hf_prefixes": names})
    view = cls(args)
    view.tok_embeddings = base.embed_tokens
    view.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(base.layers)})
    view.norm = base.norm
    view.output = hf.get_output_embeddings()
    return view


def hf_name(part: nn.Module, name: str) -> str:
    """A stage's parameter or module name as the whole, unwrapped model names it: a transformers model's own
    name, and for a last stage's copy of a tied table (parallel/pp/pipeline_split.py: `tied_names`) the table's."""
    name = getattr(part, "tied_names", {}).get(name, name)
    prefixes = getattr(part, "hf_prefixes", None)
    if not prefixes:
        return name
    head, _, rest = name.partition(".")
    return f"{prefixes[head]}.{rest}" if head in prefixes and rest else prefixes.get(head, name)
