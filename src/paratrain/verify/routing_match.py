"""Router decisions under verify: the same tokens must reach the same experts as on one device.

Each MoE layer keeps, from its last forward, this rank's routing fingerprint (models/moe.py: per expert, the
routed copies and the sum of their tokens' first feature). Summed over the ranks of one tensor-parallel
column, a layer's fingerprint is that of the global batch, which the one-device reference computes at once:
counts must be equal and the feature sums equal within fp32 rounding. A token sent to another expert
changes both; the first layer (in model order) where they differ is reported.

A layer that counts its forwards (transformers' MoE layers under paratrain, models/hf_moe.py) is compared only in
a step where it ran exactly once: with several micro-batches per step (a pipeline's, gradient accumulation) or an
activation-checkpoint replay its last forward is not the whole batch, so that step's entry is None and skipped,
not a mismatch. A pipeline stage's layer is named as the whole model names it (models/hf_pipeline.py).
"""

from __future__ import annotations

from paratrain.models.hf_pipeline import hf_name
from paratrain.verify.recorder import clean_name

FEATURE_RTOL = 1e-4  # the feature sums add the same fp32 values in another order


def routing_of(parts) -> dict:
    """{layer name: [[copies per expert], [feature sum per expert]] or None (not comparable this step)} for this
    rank's MoE layers."""
    out = {}
    for part in parts:
        for name, module in part.named_modules():
            stats = getattr(module, "last_routing", None)
            if stats is None or not hasattr(module, "dispatch"):
                continue
            name = hf_name(getattr(part, "module", part), clean_name(name))
            forwards = getattr(module, "routing_forwards", None)
            if forwards is not None:
                module.routing_forwards = 0
                if forwards != 1:
                    out[name] = None
                    continue
            out[name] = stats.double().cpu().tolist()
    return out


def _layer_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in name.split("."))


class RoutingCheck:
    def __init__(self):
        self.ok: bool | None = None  # None: no MoE layer
        self.first: dict | None = None

    def add(self, step: int, ref: dict, ranks: list[dict]) -> bool:
        skipped = {name for name, v in ref.items() if v is None} | {
            name for rank in ranks for name, v in rank.items() if v is None}
        ref = {name: v for name, v in ref.items() if name not in skipped}
        if not ref:
            return True
        total: dict[str, list[list[float]]] = {}
        for rank in ranks:
            for name, stats in rank.items():
                if name in skipped:
                    continue
                counts, sums = stats
                have = total.setdefault(name, [[0.0] * len(counts), [0.0] * len(sums)])
                have[0] = [a + b for a, b in zip(have[0], counts)]
                have[1] = [a + b for a, b in zip(have[1], sums)]
        bad = [name for name in sorted(ref, key=_layer_key) if not self._same(ref[name], total.get(name))]
        self.ok = (self.ok is not False) and not bad
        if bad and self.first is None:
            got = total.get(bad[0])
            self.first = {"step": step, "layer": bad[0], "tokens_per_expert_ref": ref[bad[0]][0],
                          "tokens_per_expert": got[0] if got else None}
        return not bad

    @staticmethod
    def _same(ref, got) -> bool:
        if got is None:
            return False
        (ref_counts, ref_sums), (counts, sums) = ref, got
        if ref_counts != counts:
            return False
        scale = max(1.0, max(abs(v) for v in ref_sums))
        return all(abs(a - b) <= FEATURE_RTOL * scale for a, b in zip(ref_sums, sums))

    def result(self) -> dict:
        return {"expert_assignments_match": self.ok, "first_assignment_mismatch": self.first}
