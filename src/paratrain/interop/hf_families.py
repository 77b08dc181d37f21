"""Every causal-LM model type transformers registers, each either in scope (a decoder-only model whose layers mix
tokens by attention: what `--model hf:` trains) or out of scope with the reason, read from the family itself:

  encoder-decoder decoder  the config is an encoder-decoder one, or its layers attend to an encoder (cross-attention)
  encoder                  a BERT-like encoder that also has a causal-LM head (transformers lists its masked-LM head)
  multimodal               its causal LM takes images, audio or video (pixel_values, input_features, ...), or its config
                           holds a vision, audio or image-tokenizer part; a text-only sibling type is listed apart
  recurrent                some layers mix tokens by a state-space or recurrent block (Mamba, RWKV, xLSTM, RG-LRU,
                           gated delta rule, linear or lightning attention, short convolutions)
  assistant                a drafting model for speculative decoding: its forward reads another model's states
                           (shared_kv_states), it is no language model on its own

The families and their tiny configs (interop/hf_tiny_config.py) serve benchmarks/hf_coverage.py and the tests.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

MULTIMODAL_INPUTS = re.compile(r"pixel|image|audio|video|input_features|input_values|speech")
MULTIMODAL_PARTS = re.compile(r"vision|audio|vq_|image|speech")
RECURRENT_FIELDS = re.compile(r"^(conv_|mamba_|ssm_|linear_(key|value|num)|time_step|lru_)")
RECURRENT_LAYER_TYPES = re.compile(r"linear_attention|conv|mamba|recurrent")
ASSISTANT_INPUTS = re.compile(r"shared_kv|target_hidden")
CROSS_ATTENTION = re.compile(r"encoder_attn|crossattention|cross_attn", re.I)
RECURRENT_BLOCKS = re.compile(r"Mamba|Rwkv|RWKV|Rglru|LSTM|DeltaNet|DeltaAttention|LinearAttention$|Lightning|"
                              r"ShortConv$|Mixer$")


@dataclass(frozen=True)
class Family:
    model_type: str
    causal_lm_class: str
    out_of_scope: str | None  # why paratrain's hf: path does not cover it; None: in scope


def causal_lm_types() -> dict[str, str]:
    """model_type -> causal-LM class name, as transformers' AutoModelForCausalLM registers them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def scope_by_registration(model_type: str, class_name: str) -> str | None:
    """What the auto mappings and the config class say, before any model is built."""
    import transformers
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    seq2seq = set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES) | \
        set(modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)
    config_class = CONFIG_MAPPING[model_type]
    if model_type in seq2seq or _default_is_encoder_decoder(config_class):
        return "encoder-decoder decoder: the decoder half of an encoder-decoder model"
    if model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder: a bidirectional encoder (it has a masked-LM head) used as a decoder"
    parts = [name for name in (getattr(config_class, "sub_configs", None) or {}) if MULTIMODAL_PARTS.search(name)]
    model_class = getattr(transformers, class_name, None)
    inputs = [p for p in (inspect.signature(model_class.forward).parameters if model_class else ())
              if MULTIMODAL_INPUTS.search(p)]
    if inputs or parts:
        return f"multimodal: {class_name} takes {', '.join(inputs or parts)}"
    drafts = [p for p in (inspect.signature(model_class.forward).parameters if model_class else ())
              if ASSISTANT_INPUTS.search(p)]
    if drafts:
        return f"assistant: {class_name} drafts for another model (its forward takes {', '.join(drafts)})"
    return None


def _default_is_encoder_decoder(config_class) -> bool:
    try:
        return bool(config_class().is_encoder_decoder)
    except Exception:  # a class that cannot build its own default is no encoder-decoder one by that test
        return False


def scope_by_modules(model) -> str | None:
    """What the built model (meta device) shows: cross-attention to an encoder, or recurrent token mixers."""
    cross = next((name for name, _ in model.named_modules() if CROSS_ATTENTION.search(name.rpartition(".")[2])), None)
    if cross:
        return f"encoder-decoder decoder: {cross} attends to an encoder's output"
    recurrent = sorted({type(m).__name__ for m in model.modules() if RECURRENT_BLOCKS.search(type(m).__name__)
                        and not type(m).__name__.endswith(("Model", "ForCausalLM"))})
    if recurrent:
        return f"recurrent: layers mix tokens through {', '.join(recurrent[:2])}, not attention alone"
    return None


def causal_lm_families() -> list[Family]:
    """Every registered causal-LM type with its scope. A family whose tiny config or meta model cannot be made is
    in scope (its failure is the coverage run's to report)."""
    from paratrain.interop.hf_tiny_config import tiny_config
    from paratrain.models.hf_model import meta_model

    out = []
    for model_type, class_name in causal_lm_types().items():
        reason = scope_by_registration(model_type, class_name)
        if reason is None:
            reason = _scope_of_built(model_type, tiny_config, meta_model)
        out.append(Family(model_type, class_name, reason))
    return out


def _scope_of_built(model_type: str, tiny_config, meta_model) -> str | None:
    """scope_by_modules of the tiny model, else of the family's default model (a tiny config the family's own
    checks refuse still shows its blocks at full size, on the meta device); where neither builds, what the config
    class declares (scope_by_config_fields)."""
    from transformers import AutoConfig

    for make in (lambda: tiny_config(model_type), lambda: AutoConfig.for_model(model_type)):
        try:
            return scope_by_modules(meta_model(make()))
        except Exception:  # the coverage run reports an in-scope family that does not build
            continue
    return scope_by_config_fields(model_type)


def scope_by_config_fields(model_type: str) -> str | None:
    """A family whose config class declares the sizes of recurrent or convolutional token mixers (conv_*, mamba_*,
    linear-attention heads) or lists such layer types."""
    import dataclasses

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fields = dataclasses.fields(CONFIG_MAPPING[model_type])
    declared = [f.name for f in fields if RECURRENT_FIELDS.search(f.name)]
    kinds = sorted({t for f in fields if f.name == "layer_types" and isinstance(f.default, list)
                    for t in f.default if RECURRENT_LAYER_TYPES.search(str(t))})
    if declared or kinds:
        return f"recurrent: its config declares {', '.join((kinds or declared)[:2])} (layers beside attention)"
    return None
