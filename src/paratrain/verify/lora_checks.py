"""verify's LoRA checks (--lora-r), beside the parity of the adapters' gradients and values with one device
(verify/parity.py compares every trainable parameter): on every rank the frozen base stays bitwise what it was,
holds no gradient, and the optimizer keeps state for the adapters alone, 2 x the adapter elements the rank holds
under Adam(W); on one device the adapted model's first logits equal the base model's (B starts at zero)."""

from __future__ import annotations

import torch

from paratrain.models.lora import attach_lora

STATE_PER_ELEMENT = {"adamw": 2, "adam": 2}  # exp_avg and exp_avg_sq; the step counters are scalars


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class LoraChecks:
    """One rank's checks over a verify run: start() before the first step, finish() after the last."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.parts = trainer.step_runner.model_parts
        self.frozen = {n: _local(p).detach().clone() for part in self.parts for n, p in part.named_parameters()
                       if not p.requires_grad}
        self.grads_on_frozen: set[str] = set()
        self.handle = trainer.hooks.on_gradients(self._read_grads)

    def _read_grads(self, trainer) -> None:
        self.grads_on_frozen |= {n for part in self.parts for n, p in part.named_parameters()
                                 if not p.requires_grad and p.grad is not None}

    def finish(self) -> dict:
        self.handle.remove()
        live = {n: _local(p).detach() for part in self.parts for n, p in part.named_parameters()
                if not p.requires_grad}
        changed = sorted(n for n, before in self.frozen.items() if not torch.equal(live[n], before))
        held, stated, frozen_in_optimizer = self._optimizer_elements()
        per_element = STATE_PER_ELEMENT.get(self.trainer.cfg.optimizer)
        trainable = sum(_local(p).numel() for part in self.parts for p in part.parameters() if p.requires_grad)
        # ZeRO-1 steps (and keeps state for) its own partition of them
        all_stepped = self.trainer.layout.zero_stage == 1 or held == trainable
        return {"adapter_elements": trainable, "optimizer_elements": held, "optimizer_state_elements": stated,
                "all_adapters_stepped": all_stepped,
                "frozen_parameters": len(self.frozen), "base_changed": changed,
                "frozen_with_grad": sorted(self.grads_on_frozen), "frozen_in_optimizer": frozen_in_optimizer,
                "state_is_2x_adapters": per_element is None or stated == per_element * held}

    def _optimizer_elements(self) -> tuple[int, int, int]:
        """(adapter elements this rank's optimizers step, their state elements, frozen parameters they hold).
        ZeRO-1 steps the parameters of its own partition only."""
        held = stated = frozen = 0
        for opt in self.trainer.optimizers:
            inner = getattr(opt, "optim", opt)
            params = [p for group in inner.param_groups for p in group["params"]]
            frozen += sum(not p.requires_grad for p in params)
            held += sum(_local(p).numel() for p in params)
            stated += sum(_local(v).numel() for state in inner.state.values() for v in state.values()
                          if torch.is_tensor(v) and v.dim() > 0)
        return held, stated, frozen


def first_logits_match_base(trainer) -> bool | None:
    """One device: the model built as the run builds it, its logits on a seeded batch before and after the adapters
    are attached, compared bitwise (None for a user's own model: its inputs are its own)."""
    if trainer.custom is not None:
        return None
    from paratrain.models.hf_model import build_hf_model
    from paratrain.models.presets import build_model
    from paratrain.models.speed import model_speed_for

    cfg, args = trainer.cfg, trainer.args
    model = build_hf_model(cfg.model, cfg.seed) if trainer.hf else \
        build_model(args, "cpu", seed=cfg.seed, speed=model_speed_for(cfg))
    tokens = torch.randint(args.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(cfg.seed))
    with torch.no_grad():
        before = model(tokens)
        attach_lora(model, trainer.lora, cfg.seed)
        after = model(tokens)
    return torch.equal(before, after)


def lora_result(records: list[dict], logits_match: bool | None) -> dict:
    ok = logits_match is not False and all(not r["base_changed"] and not r["frozen_with_grad"] and not r["frozen_in_optimizer"]
                              and r["state_is_2x_adapters"] and r["all_adapters_stepped"] for r in records)
    return {"passed": ok, "first_logits_equal_base": logits_match, "per_rank": records}
