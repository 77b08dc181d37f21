"""Pipeline layout: cost-balanced stage split, stage -> rank placement, and carving stage modules.
(The checks that reject a bad pipeline layout live in checks.py with the others.)"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.errors import UserError
from paratrain.parallel.tied_weights import tied_table_name, untied_head


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: which layers it runs and whether it owns the embedding or norm+head+loss."""

    index: int
    layers: tuple[str, ...]
    first: bool
    last: bool
    cost: float  # training FLOPs per token, the quantity the split balances


def layer_costs(model: nn.Module, seq_len: int) -> tuple[list[float], float, float]:
    """(per-layer cost, embedding cost, norm+head+loss cost) in training FLOPs per token.

    Matmuls cost 6 FLOPs per parameter per token (forward + backward); attention adds 12*dim*seq_len per
    layer. The embedding is a lookup (its backward a scatter-add), so it costs ~dim, not ~vocab*dim.
    """
    dim = model.args.dim
    costs = [6.0 * sum(p.numel() for p in layer.parameters()) + 12.0 * dim * seq_len
             for layer in model.layers.values()]
    embed = 4.0 * dim
    head = 6.0 * sum(p.numel() for m in (model.norm, model.output) for p in m.parameters())
    head += 10.0 * model.args.vocab_size  # softmax + cross-entropy, forward and backward
    return costs, embed, head


def split_into_stages(model: nn.Module, pp: int, virtual_stages: int = 1, seq_len: int | None = None,
                      counts: tuple[int, ...] = ()) -> list[StageSpec]:
    """Cut the layers into pp * virtual_stages contiguous stages minimising the most expensive stage, or, with
    `counts` (--pp-layers), into stages of exactly those many layers each (e.g. for unequal devices).

    The embedding always sits on the first stage and norm + head + loss on the last; their cost counts
    toward those stages, so the ends get fewer layers when the head is heavy. Each stage gets >= 1 layer.
    """
    n_stages = pp * virtual_stages
    names = list(model.layers.keys())
    if n_stages > len(names):
        raise UserError(f"{n_stages} pipeline stages (pp={pp} x {virtual_stages} per rank) but the model has only "
                        f"{len(names)} layers")
    costs, embed, head = layer_costs(model, seq_len or model.args.max_seq_len)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, lo: int, hi: int) -> float:
        extra = (embed if s == 0 else 0.0) + (head if s == n_stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    n = len(names)
    if counts:
        bounds = explicit_bounds(counts, n_stages, n)
        return [StageSpec(s, tuple(names[lo:hi]), s == 0, s == n_stages - 1, stage_cost(s, lo, hi))
                for s, (lo, hi) in enumerate(bounds)]
    inf = float("inf")
    # best[s][i]: the smallest achievable max-stage cost putting layers [0, i) into stages 0..s
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for i in range(1, n + 1):
        best[0][i] = stage_cost(0, 0, i)
    for s in range(1, n_stages):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                value = max(best[s - 1][j], stage_cost(s, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, hi = [], n
    for s in range(n_stages - 1, 0, -1):
        lo = cut[s][hi]
        bounds.append((lo, hi))
        hi = lo
    bounds.append((0, hi))
    bounds.reverse()
    return [StageSpec(s, tuple(names[lo:hi]), s == 0, s == n_stages - 1, stage_cost(s, lo, hi))
            for s, (lo, hi) in enumerate(bounds)]


def explicit_bounds(counts: tuple[int, ...], n_stages: int, n_layers: int) -> list[tuple[int, int]]:
    """[lo, hi) layer ranges of stages holding counts[s] layers each (checked: one per stage, summing to all)."""
    from paratrain.parallel.uneven_split import stage_layer_counts

    stage_layer_counts(":".join(map(str, counts)), n_stages, n_layers)
    bounds, lo = [], 0
    for count in counts:
        bounds.append((lo, lo + count))
        lo += count
    return bounds


def stage_ranks(pp: int, n_stages: int, style: str = "loop") -> list[int]:
    """Pipeline rank of each stage: "loop" puts stage s on rank s % pp (interleaved 1F1B); "v" folds the
    second half back (rank r holds stages r and 2pp-1-r), which the ZBV zero-bubble schedule needs."""
    if style == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(n_stages)]
    return [s % pp for s in range(n_stages)]


def carve_stage(model: nn.Module, spec: StageSpec) -> nn.Module:
    """A Transformer holding only this stage's modules, under their original names ("layers.3", ...).

    The shell is built on the meta device (free), then takes the real modules from `model`, so the
    parameters are shared with `model`, never copied. Absent parts are None, which Transformer skips.
    One exception: a last stage without the embedding whose head is tied to the token table gets a head of its
    own holding a copy of the table (parallel/tied_weights.py keeps the two in step); its `tied_names` say that
    the copy is the whole model's table, so verify and export name it as the unsplit model does.
    """
    with torch.device("meta"):
        part = type(model)(model.args)
    if hasattr(model, "speed"):  # the model's build-time options (a bf16 residual stream) apply to each stage
        part.speed = model.speed
    part.tok_embeddings = model.tok_embeddings if spec.first else None
    part.layers = nn.ModuleDict({name: model.layers[name] for name in spec.layers})
    part.norm = model.norm if spec.last else None
    part.output = model.output if spec.last else None
    table = tied_table_name(model)
    if table is not None and spec.last and not spec.first:
        part.output = untied_head(model.output)
        part.tied_names = {"output.weight": f"tok_embeddings.{table}"}
    return part
