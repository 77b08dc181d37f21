"""A tiny config of any transformers family, made with the family's own config class: its structure kept (layer
types, experts and their routing, attention kind), its sizes made small by one rule.

The rule. Start from the config class's defaults (transformers writes each family's published structure there).
Then, by field name:
  widths (hidden_size, d_model, n_embd, ...)                      -> 64
  feed-forward and expert widths (intermediate_size, ffn_dim, ...)  -> scaled by 64 / the default width, rounded
                                                                      up to a multiple of 16, at least 16
  attention heads -> 4; key/value heads -> 1 where the family shares one, 2 where it groups them, else 4
  head sizes (head_dim, v_head_dim, qk_rope_head_dim, rotary_dim, ...) -> scaled together: the largest whole head
      (or width / heads where the class declares none) to 16 unless that takes the smallest below 8, then the
      smallest to 8; rotary parts at the same scale, at least 8: sizes keep their ratios (equal ones stay equal,
      a query head stays the sum of its parts)
  low ranks (kv_lora_rank, q_lora_rank, ...) -> 16
  vocabulary -> 256 (special token ids beyond it moved inside: 255, 254, ...); no pad token (the runs train on
      unpadded rows, and a family that zeroes its pad token's embedding would see it in the data); positions -> 256
  windows and chunks (sliding_window, attention_chunk_size, ...) -> 8, so they act on short sequences
  experts -> at most 8, top-k -> at most 2, expert groups -> at most 4 (at least 2 experts each), the groups a
      token may use -> at most half of them
  dense layers before the MoE ones (first_k_dense_replace) -> at most 1
  layers -> enough that every kind of layer appears: each distinct entry of a per-layer list (layer_types, ...)
      once, every period (decoder_sparse_step, ...) once, the first MoE layer after the dense ones; at least 2,
      at most 8; per-layer lists cut to that many, layer-index lists kept below it
  dropout and training noise (router jitter) -> 0 (a parallel run must match one device step for step)
  sub-configs (DBRX's attn_config, ffn_config) -> the same rule, at the parent's scale
Counts the class leaves undefined (None) where its model needs them are filled: head sizes as above, key/value
heads as the heads, top-k 2 in a class that counts experts. COMPLETIONS lists the few fields transformers' own
defaults leave out for a family (so that no model builds from them), with the published models' values, scaled
by the rule. Everything else keeps the family's default.
"""

from __future__ import annotations

import dataclasses
import math
import re

TINY_WIDTH = 64
TINY_VOCAB = 256
TINY_POSITIONS = 256
TINY_HEADS = 4
TINY_HEAD_DIM = 16
MIN_HEAD_DIM = 8
TINY_RANK = 16
TINY_WINDOW = 8
MAX_EXPERTS = 8
MAX_TOP_K = 2
MAX_GROUPS = 4
MAX_LAYERS = 8

WIDTH = re.compile(r"^(hidden_size|d_model|n_embd|dim|embed_dim|embedding_size|embedding_dim|emb_dim|"
                   r"hidden_dim|word_embed_proj_dim)$")
FFN = re.compile(r"(intermediate|ffn|inner|^d_ff$|^dff$|^dim_ff$|ff_dim|mlp_dim|expert_hidden|"
                 r"shared_expert_size|router_hidden_size)")
HEADS = re.compile(r"^(num_attention_heads|n_head|n_heads|num_heads|attention_heads|decoder_attention_heads|"
                   r"swa_num_attention_heads|linear_num_value_heads|index_n_heads|num_attention_heads_per_layer)$")
KV_HEADS = re.compile(r"^(num_key_value_heads|num_kv_heads|n_kv_heads|kv_n_heads|multi_query_group_num|"
                      r"swa_num_key_value_heads|linear_num_key_heads)$")
HEAD_DIM = re.compile(r"(head_dim|^d_head$|^dim_head$|^kv_channels$|head_size$|^attention_head_size$|rotary_dim|"
                      r"^rope_dim$)")
ROTARY = re.compile(r"rope|rotary")
RANK = re.compile(r"_rank$")
VOCAB = re.compile(r"vocab")
POSITIONS = re.compile(r"^(max_position_embeddings|n_positions|n_ctx|max_seq_len|max_sequence_length|"
                       r"context_length|seq_length|max_target_positions)$")
WINDOW = re.compile(r"(sliding_window|window_size|window_len|attention_chunk_size|^local_attention$|"
                    r"^chunk_size$|attention_window)")
EXPERTS = re.compile(r"^(num_experts|n_routed_experts|num_local_experts|moe_num_experts|n_experts)$")
TOP_K = re.compile(r"^(num_experts_per_tok|moe_k|moe_topk|moe_top_k|top_k|num_selected_experts|"
                   r"experts_per_token)$")
GROUPS = re.compile(r"^(n_group|num_expert_group|n_groups_experts)$")
TOPK_GROUPS = re.compile(r"^(topk_group|topk_groups)$")
DENSE_FIRST = re.compile(r"^(first_k_dense_replace|first_k_dense|num_dense_layers|n_dense_layers)$")
PERIODS = re.compile(r"(_step$|_pattern$|_interval$|_freq$|_period$)")
LAYERS = re.compile(r"^(num_hidden_layers|n_layer|n_layers|num_layers|decoder_layers)$")
TOKEN_ID = re.compile(r"_(token_id|token_ids|token_index|id)$")
DROPOUT = re.compile(r"(dropout|pdrop|drop_rate|jitter)")

# Fields transformers 5.24's defaults leave out for these families (no model builds from the defaults), with the
# published models' values scaled by the rule: DBRX's rotary base and q/k/v clamp (its checkpoints carry them in
# attn_config),
# dots.llm1's experts (128 experts, top-6, 2 shared -> 8, 2, 2), Cohere Compass's rotary parameters per layer type,
# GPT-Neo's alternating global/local attention for the tiny layer count, Hunyuan-MoE's experts (its default has one;
# the published model 64, top-8 -> 8, 2), Gemma 3n's key/value sharing (the last
# layers reuse the caches of layers of both types: 10 layers, the last 5 sharing), and dots3's sliding-window
# layers, sized by keyword defaults the rule cannot see (heads 64 -> 4, ranks 1024 -> 16, head parts 256 : 192 :
# 128 -> 32 : 24 : 16 as the rule scales head sizes).
COMPLETIONS = {
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    "dots1": {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "gemma3n_text": {"num_hidden_layers": 10, "num_kv_shared_layers": 5},
    # one expert by default; Hunyuan-A13B routes top-8 of 64
    "hunyuan_v1_moe": {"num_experts": 8, "moe_topk": 2},
    # its sliding-window layers' sizes are keyword defaults of the class (swa_*), not fields the rule sees
    "dots3_note_text": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 16,
                        "swa_kv_lora_rank": 16, "swa_head_dim": 32, "swa_qk_nope_head_dim": 24, "swa_v_head_dim": 16},
}


def class_fields(config_class) -> list[str]:
    """The config class's own fields (not PreTrainedConfig's common ones)."""
    from transformers import PreTrainedConfig

    common = {f.name for f in dataclasses.fields(PreTrainedConfig)} - {"tie_word_embeddings", "pad_token_id",
                                                                       "bos_token_id", "eos_token_id"}
    return [f.name for f in dataclasses.fields(config_class) if f.name not in common]


def default_values(config_class) -> dict:
    """Each field's value in the default config (after the class's own __post_init__ filled derived ones); from the
    dataclass defaults where the class cannot build its own default."""
    try:
        default = config_class()
    except Exception:  # a few classes need an argument their default leaves out: read the declared defaults
        default = None
    out = {}
    for f in dataclasses.fields(config_class):
        value = f.default if f.default is not dataclasses.MISSING else None
        if default is not None:
            try:
                value = getattr(default, f.name)
            except Exception:  # per-layer attributes that refuse a global read
                pass
        out[f.name] = value
    return out


def _round_width(value: int, scale: float) -> int:
    return max(16, int(math.ceil(value * scale / 16)) * 16)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first_int(names: list[str], values: dict, pattern: re.Pattern) -> int | None:
    return next((values[n] for n in names if pattern.match(n) and _is_int(values[n])), None)


def tiny_changes(config_class, width_scale: float | None = None, layers: int | None = None) -> dict:
    """The keyword arguments that make `config_class` tiny (module docstring). `width_scale`: a sub-config's
    parent's (64 / the parent's default width); `layers`: the layer count where COMPLETIONS sets one."""
    from transformers import PreTrainedConfig

    values = default_values(config_class)
    names = class_fields(config_class)
    width = _first_int(names, values, WIDTH)
    scale = width_scale or TINY_WIDTH / (width or 1024)
    heads = _first_int(names, values, HEADS) or TINY_HEADS
    head_sizes = [values[n] for n in names if HEAD_DIM.search(n) and _is_int(values[n])]
    # the scale comes from the whole heads (a rotary part follows them), else from the head width / heads gives
    sizes = [values[n] for n in names if HEAD_DIM.search(n) and _is_int(values[n]) and not ROTARY.search(n)] or \
        ([width // heads] if width else head_sizes)
    head_scale = max(TINY_HEAD_DIM / max(sizes or [1]), MIN_HEAD_DIM / min(sizes or [1]))
    counts_experts = any(EXPERTS.match(n) for n in names)
    changes: dict = {}
    experts = None
    for name in names:
        value = values[name]
        if isinstance(value, float) and DROPOUT.search(name):
            changes[name] = 0.0
        elif isinstance(value, PreTrainedConfig):
            changes[name] = tiny_changes(type(value), scale)
        elif isinstance(value, list) and value and all(_is_int(v) for v in value) and FFN.search(name):
            changes[name] = [_round_width(v, scale) for v in value]
        elif value is None:
            if name == "head_dim":  # others left None are derived by the class (qk_head_dim = nope + rope)
                changes[name] = TINY_HEAD_DIM
            elif KV_HEADS.match(name):
                changes[name] = TINY_HEADS
            elif TOP_K.match(name) and counts_experts:
                changes[name] = MAX_TOP_K
        if not _is_int(value) or value <= 0:
            continue
        if EXPERTS.match(name):
            experts = min(value, MAX_EXPERTS)
            changes[name] = experts
        elif TOP_K.match(name):
            changes[name] = min(value, MAX_TOP_K)
        elif VOCAB.search(name):
            changes[name] = TINY_VOCAB
        elif POSITIONS.match(name):
            changes[name] = TINY_POSITIONS
        elif WIDTH.match(name):
            changes[name] = TINY_WIDTH
        elif KV_HEADS.match(name):
            changes[name] = 1 if value == 1 else (TINY_HEADS if value >= heads else 2)
        elif HEADS.match(name):
            changes[name] = TINY_HEADS
        elif HEAD_DIM.search(name):
            changes[name] = max(MIN_HEAD_DIM, round(value * head_scale / 2) * 2)
        elif RANK.search(name):
            changes[name] = min(value, TINY_RANK)
        elif WINDOW.search(name):
            changes[name] = min(value, TINY_WINDOW)
        elif FFN.search(name) and value > 16:
            changes[name] = _round_width(value, scale)
        elif DENSE_FIRST.match(name):
            changes[name] = min(value, 1)
    _scale_groups(names, values, changes, experts)
    nullable = {f.name: "None" in str(f.type) for f in dataclasses.fields(config_class)}
    _move_token_ids(names, values, changes, nullable)
    _scale_rope(values, changes)
    _cut_layers(names, values, changes, layers)
    return changes


def _scale_groups(names: list[str], values: dict, changes: dict, experts: int | None) -> None:
    """Expert groups (group-limited routing): at most 4, at least 2 experts each, dividing the experts; the groups a
    token may use at most half of them."""
    group_name = next((n for n in names if GROUPS.match(n) and _is_int(values[n])), None)
    if group_name is None or experts is None:
        return
    groups = max(g for g in range(1, min(values[group_name], MAX_GROUPS, max(1, experts // 2)) + 1)
                 if experts % g == 0)
    changes[group_name] = groups
    for name in names:
        if TOPK_GROUPS.match(name) and _is_int(values[name]):
            changes[name] = max(1, min(values[name], groups // 2))


def _move_token_ids(names: list[str], values: dict, changes: dict, nullable: dict[str, bool]) -> None:
    """Special token ids past the tiny vocabulary moved inside it (255, 254, ...), the same id to the same place;
    no pad token where the class allows none (module docstring)."""
    moved: dict[int, int] = {}

    def inside(token: int) -> int:
        if token < TINY_VOCAB:
            return token
        return moved.setdefault(token, TINY_VOCAB - 1 - len(moved))

    for name in names:
        value = values[name]
        if name == "pad_token_id" and nullable.get(name, True):
            changes[name] = None
        elif not TOKEN_ID.search(name):
            continue
        elif _is_int(value):
            changes[name] = inside(value)
        elif isinstance(value, list) and value and all(_is_int(v) for v in value):
            changes[name] = [inside(v) for v in value]


def _scale_rope(values: dict, changes: dict) -> None:
    """A YaRN-style rotary scaling keeps its factor: the pre-scaling context shrinks with the positions."""
    rope = values.get("rope_parameters")
    if isinstance(rope, dict) and _is_int(rope.get("original_max_position_embeddings")):
        factor = float(rope.get("factor") or 1.0)
        changes["rope_parameters"] = {**rope, "original_max_position_embeddings":
                                      max(1, int(TINY_POSITIONS / factor))}


def _per_layer_lists(names: list[str], values: dict, layers: int) -> dict[str, list]:
    return {n: values[n] for n in names
            if isinstance(values[n], list) and len(values[n]) == layers and not LAYERS.match(n)}


def _cut_layers(names: list[str], values: dict, changes: dict, wanted: int | None) -> None:
    layer_name = next((n for n in names if LAYERS.match(n) and _is_int(values[n])), None)
    if layer_name is None:
        return
    layers = values[layer_name]
    per_layer = _per_layer_lists(names, values, layers)
    needed = 2
    for entries in per_layer.values():  # each distinct entry once
        firsts: dict = {}
        for i, entry in enumerate(entries):
            firsts.setdefault(repr(entry), i)
        needed = max(needed, max(firsts.values()) + 1)
    dense_first = next((changes.get(n, values[n]) for n in names if DENSE_FIRST.match(n) and _is_int(values[n])), 0)
    needed = max(needed, dense_first + 2)
    for name in names:  # every period once (a step of 2: a dense and an MoE layer)
        if PERIODS.search(name) and _is_int(values[name]) and 1 < values[name] <= MAX_LAYERS:
            needed = max(needed, values[name] + dense_first)
    new = wanted or min(layers, max(needed, 2), MAX_LAYERS)
    changes[layer_name] = new
    for name, entries in per_layer.items():
        changes[name] = [_round_width(v, TINY_WIDTH / max(entries)) if FFN.search(name) and _is_int(v) else v
                         for v in entries[:new]] if name not in changes else changes[name][:new]
    for name in names:  # lists of layer indices (mlp_only_layers, moe_layers, ...) kept below the new count
        value = values[name]
        if name in per_layer or not isinstance(value, list) or not value or not all(_is_int(v) for v in value):
            continue
        if "layer" in name and all(0 <= v < layers for v in value) and len(value) < layers:
            changes[name] = [v for v in value if v < new]


def tiny_config(model_type: str, **overrides):
    """The tiny config object of `model_type` (its own config class), with `overrides` on top of the rule."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    completion = COMPLETIONS.get(model_type, {})
    rule = tiny_changes(CONFIG_MAPPING[model_type], layers=completion.get("num_hidden_layers"))
    for name, value in completion.items():  # a completed sub-config keeps the rule's sizes
        rule[name] = {**rule[name], **value} if isinstance(rule.get(name), dict) and name != "rope_parameters" \
            else value
    return AutoConfig.for_model(model_type, **{**rule, **overrides})
