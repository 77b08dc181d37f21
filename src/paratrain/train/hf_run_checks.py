"""What a transformers model (`--model hf:PATH`, models/hf_model.py) cannot run under a given Layout, refused in
one line: by train before any process starts (train/validate.py) and again in each worker (train/trainer.py),
and by the planner (plan/layout_rules.py), which marks such a candidate runtime_unsupported in the same words.

The model family only states its facts, read from its modules on the meta device (models/hf_moe_layout.py: why a
layer's experts cannot be split; models/hf_attention_impl.py: what its attention computes that context-parallel
attention does not); what a layout does to the model is asked of the Layout."""

from __future__ import annotations

import functools
import logging
import os

from paratrain.errors import UserError
from paratrain.models.hf_files import hf_location, read_hf_config
from paratrain.models.hf_model import hf_config_object

log = logging.getLogger("paratrain")


def check_hf_run(layout, cfg, args) -> None:
    """What a transformers model cannot do under paratrain (yet). `args`: the model's ModelArgs
    (models/hf_args.py)."""
    if cfg.init_from:
        raise UserError("--init-from loads weights into a paratrain preset; an hf: directory's own *.safetensors "
                        "are loaded by --model hf:DIR")
    kind = read_hf_config(cfg.model)["model_type"]
    split_refusal, cp_limits = (model_facts(cfg.model) if layout.splits_experts or layout.splits_within_layers
                                or layout.splits_sequences else (None, ()))
    if getattr(args, "moe", False):
        check_hf_moe_run(layout, kind, args.n_experts, split_refusal)
    check_hf_pipeline_layout(layout)  # after the MoE rules, in the planner's order (plan/layout_rules.py)
    if layout.splits_within_layers and not getattr(type(hf_config_object(read_hf_config(cfg.model), cfg.model)),
                                                   "base_model_tp_plan", None):
        raise UserError(f"{kind} has no tensor-parallel plan in transformers (base_model_tp_plan); run it with a "
                        "data-parallel strategy (ddp, zero1/2/3, hsdp), or cp/pp")
    if layout.splits_sequences and cp_limits:
        raise UserError(f"context parallelism (cp) on {kind}: its attention has {'; '.join(cp_limits)}, which "
                        "paratrain's ring and Ulysses attention do not compute; run it without cp")


def model_facts(spec: str) -> tuple[str | None, tuple[str, ...]]:
    """(why its experts cannot be split, or None; what its attention computes beyond plain causal attention) of
    the model `spec` names, read once per config file version."""
    config_path, _ = hf_location(spec)
    return _model_facts(str(config_path), os.stat(config_path).st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _model_facts(config_path: str, _mtime: int) -> tuple[str | None, tuple[str, ...]]:
    from paratrain.models.hf_attention_impl import context_parallel_limits
    from paratrain.models.hf_model import meta_model
    from paratrain.models.hf_moe_layout import split_refusals

    model = meta_model(hf_config_object(read_hf_config(config_path), config_path))
    refusals = split_refusals(model)
    return (refusals[0] if refusals else None), tuple(context_parallel_limits(model))


def check_hf_pipeline_layout(layout) -> None:
    """A transformers model's pipeline stages (models/hf_pipeline.py) compose with data parallelism only."""
    if layout.splits_stages and (layout.splits_within_layers or layout.splits_sequences):
        raise UserError("pipeline parallelism (pp) with tp or cp is not supported for --model hf: models yet; "
                        "pp composes with data parallelism (ddp, zero, hsdp) here")


def check_hf_moe_run(layout, kind: str, n_experts: int, split_refusal: str | None = None) -> None:
    """What a transformers MoE model cannot do with its experts split (--ep, --tp), in one line. `split_refusal`:
    why its experts cannot be split at all (models/hf_moe_layout.py), or None."""
    if (layout.splits_experts or layout.splits_within_layers) and split_refusal:
        flag = "--ep" if layout.splits_experts else "--tp"
        raise UserError(f"{flag} cannot split the experts of this {kind} model: {split_refusal}; run it with a "
                        "data-parallel strategy (ddp, zero1/2/3)")
    if layout.splits_experts and (layout.splits_within_layers or layout.splits_stages or layout.splits_sequences):
        raise UserError(f"--ep on an hf: model composes with FSDP only (dp_shard); {kind} with --ep and tp, pp or cp "
                        "is not supported: use --ep with --strategy ep or zero3")
    if layout.splits_within_layers and n_experts % layout.tp:  # --tp splits the experts by expert (models/hf_moe.py)
        raise UserError(f"--tp {layout.tp} does not divide the model's {n_experts} experts (tp splits them by expert)")
    if layout.splits_within_layers and layout.sp:
        raise UserError(f"sequence parallelism is not supported for an hf: MoE model ({kind}): use --strategy tp "
                        "(no SP)")


def warn_unapplied_balancing_loss(layout, cfg) -> None:
    """One line when an hf: MoE config's router_aux_loss_coef will not train (models/hf_moe.py): transformers
    itself leaves it out without output_router_logits, and a pipeline's stages do not compute it."""
    doc = read_hf_config(cfg.model)
    coef = doc.get("router_aux_loss_coef")
    if not isinstance(coef, int | float) or coef <= 0 or os.environ.get("RANK", "0") != "0":
        return
    if not doc.get("output_router_logits"):
        log.warning("%s: router_aux_loss_coef %g is not applied: the config's output_router_logits is false, and "
                    "transformers adds the balancing loss only with it (set it true to train with that loss)",
                    cfg.model, coef)
    elif layout.splits_stages:
        log.warning("%s: router_aux_loss_coef %g is not applied under pipeline parallelism (the balancing loss "
                    "needs every layer's router logits in one forward): run without pp to train with it",
                    cfg.model, coef)
