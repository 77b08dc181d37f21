"""A Hugging Face transformers causal LM under paratrain: `--model hf:PATH` built from a local config.json.

`build_hf_model` makes the model from the config (random init with the run's seed, or the directory's
*.safetensors when present) and wraps it in `HFCausalLM`, which takes token ids (and, under context
parallelism, their global positions) and returns logits, as paratrain's own models do. Nothing is downloaded,
no remote code runs: the config is read as JSON and must name a model type transformers ships.

The loss is paratrain's (next-token cross entropy on the logits, targets shifted by the data loader); it
gives the same numbers as the model's own `labels=` loss (labels shifted inside the model), which
tests/models/test_hf_model.py checks.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
from pathlib import Path

import torch
from torch import nn

from paratrain.errors import UserError
from paratrain.models.hf_attention_impl import with_supported_attention
from paratrain.models.hf_files import hf_location, read_hf_config

log = logging.getLogger("paratrain")


def require_transformers():
    """transformers, or one line naming the extra that installs it."""
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise UserError("--model hf:PATH needs the optional 'hf' extra (transformers is not installed): "
                        "pip install 'paratrain[hf]'") from None


def hf_config_object(doc: dict, where: str = "config.json"):
    """The transformers config class of `model_type`, filled from the JSON: only types transformers ships."""
    transformers = require_transformers()
    kind = doc["model_type"]
    try:
        config = transformers.AutoConfig.for_model(kind, **{k: v for k, v in doc.items() if k != "model_type"})
    except ValueError:
        raise UserError(f"{where}: model_type {kind!r} is not a model transformers {transformers.__version__} "
                        "ships") from None
    auto = transformers.models.auto.modeling_auto
    # BERT-like encoders also have a causal-LM head class; their masked-LM head gives them away
    if getattr(config, "is_encoder_decoder", False) or type(config) not in auto.MODEL_FOR_CAUSAL_LM_MAPPING or \
            type(config) in auto.MODEL_FOR_MASKED_LM_MAPPING:
        raise UserError(f"{where}: {kind} is not a decoder-only causal LM (AutoModelForCausalLM has no such model)")
    return config


def meta_model(config) -> nn.Module:
    """The causal LM of a transformers `config` on the meta device: its modules and shapes, no memory."""
    transformers = require_transformers()
    with torch.device("meta"), quiet_transformers():
        return transformers.AutoModelForCausalLM.from_config(config)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder blocks, found through the model's own `_no_split_modules` (no per-architecture table)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and type(module[0]).__name__ in names:
            return module
    raise UserError(f"{type(model).__name__}: no list of decoder layers named by its _no_split_modules {sorted(names)}")


class HFCausalLM(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab) through a transformers *ForCausalLM held as `hf`."""

    # some families hold parameters the language-model loss never reaches (DeepSeek-V3.2's and dots3's indexer,
    # trained by a loss of its own; DeepSeek-V4's compressors on short rows): DDP must look for them each step
    may_leave_parameters_unused = True

    def __init__(self, hf_model: nn.Module, name: str):
        super().__init__()
        self.hf = hf_model
        self.name = name
        from paratrain.models.hf_moe import balancing_coef, experts_modules

        # the MoE balancing loss (models/hf_moe.py), where paratrain's experts forward counts the routed copies
        modules = experts_modules(hf_model)
        self.balancing = balancing_coef(hf_model.config) if modules and hasattr(modules[0][1], "aux_scale") else 0.0

    @property
    def layers(self) -> nn.ModuleList:
        # a property, not a submodule: the blocks keep their one name (hf.model.layers.N) in state dicts
        return decoder_layers(self.hf)

    @property
    def tied(self) -> bool:
        out, inp = self.hf.get_output_embeddings(), self.hf.get_input_embeddings()
        return out is not None and out.weight is inp.weight

    @property
    def attention(self) -> str:
        """The attention implementation transformers runs the model with (its config's)."""
        return self.hf.config._attn_implementation

    def use_attention(self, name: str, documents: bool = True) -> None:
        """Route every attention call through the function registered under `name` in transformers' registry
        (parallel/hf_attention.py: one that takes packed rows' document ids and masks by them itself;
        models/hf_attention_impl.py: the model's own, reading head-split tensors locally, documents=False)."""
        self.hf.config._attn_implementation = name
        self.attention_takes_documents = documents

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, cache=None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """positions: (seq,) global positions, or (batch, seq) per-document ones with doc_ids (packed rows), which
        become a 4-D block-diagonal causal mask (transformers uses a 4-D mask as given). cache: decoding
        (infer/kv_cache.py) with transformers' own cache (a DynamicCache), attention_mask (batch, cached + new
        tokens) 0 at padding."""
        if positions is not None and positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(tokens.shape[0], -1)
        if cache is not None:
            # transformers 5.2x names it `cache`; earlier releases (and models not yet renamed) `past_key_values`
            named = "cache" if "cache" in inspect.signature(self.hf.forward).parameters else "past_key_values"
            return self.hf(input_ids=tokens, position_ids=positions, attention_mask=attention_mask,
                           use_cache=True, **{named: cache}).logits
        balancing = self.balancing if self.training and torch.is_grad_enabled() else 0.0
        kwargs = {"output_router_logits": True} if balancing else {}
        if doc_ids is None:
            out = self.hf(input_ids=tokens, position_ids=positions, use_cache=False, **kwargs)
        elif getattr(self, "attention_takes_documents", False):  # context parallel: the whole row's document ids
            out = self.hf(input_ids=tokens, position_ids=positions, doc_ids=doc_ids, use_cache=False, **kwargs)
        else:
            from paratrain.models.llama import document_mask

            out = self.hf(input_ids=tokens, position_ids=positions, attention_mask=document_mask(doc_ids),
                          use_cache=False, **kwargs)
        if balancing and getattr(out, "router_logits", None):
            from paratrain.models.hf_moe import add_balancing_loss

            return add_balancing_loss(self.hf, out.logits, out.router_logits, balancing)
        return out.logits


def build_hf_model(spec: str, seed: int | None = 0) -> HFCausalLM:
    """The model `hf:PATH` names, in fp32 on CPU: random weights from `seed`, or the directory's safetensors."""
    transformers = require_transformers()
    doc = read_hf_config(spec)
    config = hf_config_object(doc, spec)
    _, weights_dir = hf_location(spec)
    if seed is not None:
        torch.manual_seed(seed)  # the same initial weights on every rank and in the single-device reference
    files = sorted(weights_dir.glob("*.safetensors")) if weights_dir else []
    if files:
        model = with_supported_attention(lambda attention: load_safetensors(config, files, attention), spec)
    else:
        model = with_supported_attention(lambda attention: transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=attention, dtype=torch.float32), spec)
    from paratrain.models.hf_moe import install_paratrain_experts

    install_paratrain_experts(model)  # MoE layers: paratrain's experts forward (--ep, --tp, verify's routing)
    return HFCausalLM(model, spec)


def load_safetensors(config, files: list[Path], attention: str = "sdpa") -> nn.Module:
    """The model of `config` with every tensor from the files, loaded by transformers' own from_pretrained: it
    takes the layout save_pretrained writes (transformers 5 fuses one-weight-per-expert MoE tensors on load) as
    well as the state dict's own, and ties a head written once. Missing, foreign or misshaped names fail."""
    from safetensors.torch import load_file

    state = {}
    for f in files:
        state.update(load_file(str(f)))
    model_class = require_transformers().models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with quiet_transformers():
        model, info = model_class.from_pretrained(None, config=config, state_dict=state, dtype=torch.float32,
                                                  attn_implementation=attention, output_loading_info=True,
                                                  ignore_mismatched_sizes=True)
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(str(m[0] if isinstance(m, tuple) else m) for m in info.get("mismatched_keys") or ())
    if missing or unexpected or mismatched:
        raise UserError(f"{files[0].parent}: the safetensors do not match the config: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}, misshaped {mismatched[:3]}")
    return model


@contextlib.contextmanager
def quiet_transformers():
    """No progress bar and no load report on stderr: a mismatch is paratrain's one error line."""
    logging_ = require_transformers().utils.logging
    verbosity, bars = logging_.get_verbosity(), logging_.is_progress_bar_enabled()
    logging_.set_verbosity_error()
    logging_.disable_progress_bar()
    try:
        yield
    finally:
        logging_.set_verbosity(verbosity)
        if bars:
            logging_.enable_progress_bar()

