"""Where a transformers model's Mixture-of-Experts layers are and what they hold, read from its modules and
parameters, never from its model_type: `moe_layers(model)` works on a model built on the meta device.

An experts module is a module whose own parameters all share a leading dimension E >= 2 with at least one 3-D
one (transformers 5's fused layout: `gate_up_proj` (E, 2I, H), `down_proj` (E, H, I), optional biases (E, ...),
or the transposed (E, H, 2I) / (E, I, H)); where the config's `base_model_ep_plan` names experts modules
("ep_dispatch_experts"), those are the ones. Its parent is the MoE block. In the block, the child holding a
2-D parameter with E rows (the router's weight, (E, H)) is the router; a child Linear with one output is a shared
expert's gate; any other child with parameters is a shared expert (with or without its own gate). Two experts-like
modules in one block (weights split over modules) or experts weights that do not share E are layout "other".

The facts are plain data (`MoELayer`), so the planner can count expert and dense parameters from them and the
runtime can say in one line why a layer's experts cannot be split (`split_refusal`).
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from fnmatch import fnmatch

from torch import nn


@dataclass(frozen=True)
class MoELayer:
    layer: int | None                 # index in the decoder-layer list (None: outside it)
    block: str                        # module path of the MoE block (the experts' parent)
    experts: str                      # module path of the routed experts
    experts_class: str
    layout: str                       # "fused": one (E, ...) tensor per projection; "other": anything else
    interface: bool                   # takes transformers' experts interface: (hidden, top-k ids, top-k weights)
    n_experts: int
    top_k: int | None
    router: str | None                # module path of the router (None: no child scores the E experts)
    router_scores: str                # "softmax" | "sigmoid" | "unknown" (read from the router's forward)
    group_limited: bool               # top-k within the best groups of experts (DeepSeek-V3's n_group > 1)
    routing_bias: str | None          # "selection": a buffer added to choose only; "logits": a learned bias
    shared_experts: tuple[str, ...]   # module paths of experts every token uses
    shared_gate: str | None           # a shared expert's own gate (a Linear to one output)
    expert_params: tuple[str, ...]    # parameter names under `experts`, each (E, ...)
    expert_numel: int                 # the routed experts' parameters (all E)
    shared_numel: int                 # the shared experts' (and their gate's) parameters
    detail: str = ""                  # layout "other": what was found

    def to_dict(self) -> dict:
        return asdict(self)

    def split_refusal(self) -> str | None:
        """Why --ep / --tp cannot split this layer's experts, naming the module and the missing piece; None: they can."""
        where = f"{self.experts} ({self.experts_class})"
        if self.layout != "fused":
            return f"{where}: its experts are not one fused (E, ...) tensor per projection ({self.detail})"
        if not self.interface:
            return (f"{where}: its forward takes no (top-k expert ids, top-k weights) from a router "
                    "(transformers' experts interface), so tokens cannot be sent to the rank holding their experts")
        if self.router is None:
            return (f"{self.block}: no child module scores exactly its {self.n_experts} experts (a router with other "
                    "choices too, such as experts that compute nothing, routes tokens paratrain cannot place)")
        return None


def hidden_size(model: nn.Module) -> int | None:
    from paratrain.models.hf_files import config_value

    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return config_value(config, "hidden_size")


def _own(module: nn.Module) -> dict:
    return dict(module.named_parameters(recurse=False))


def _experts_like(module: nn.Module, hidden: int | None) -> int | None:
    """E when the module's own parameters hold a 3-D tensor (E, ., .) with E >= 2 and the hidden size behind it."""
    leading = {p.shape[0] for p in _own(module).values()
               if p.dim() == 3 and (hidden is None or hidden in p.shape[1:])}
    return max(leading) if leading and max(leading) >= 2 else None


def _ep_plan_paths(model: nn.Module, names: list[str]) -> set[str]:
    """Module paths the config's base_model_ep_plan names as experts modules ("ep_dispatch_experts")."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_ep_plan", None) or getattr(type(config), "base_model_ep_plan", None) or {}
    patterns = [p for p, style in plan.items() if style == "ep_dispatch_experts"]
    return {n for n in names for p in patterns if fnmatch(n, f"*{p}") and n.count(".") >= p.count(".")}


def _layer_index(path: str, modules: dict) -> int | None:
    """The index of the decoder layer holding `path`: its first numbered component under a ModuleList."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and isinstance(modules.get(".".join(parts[:i])), nn.ModuleList):
            return int(part)
    return None


def _router_scores(router: nn.Module) -> str:
    try:
        source = inspect.getsource(type(router).forward)
    except (OSError, TypeError):
        return "unknown"
    sigmoid, softmax = "sigmoid" in source, "softmax" in source
    return "sigmoid" if sigmoid and not softmax else "softmax" if softmax and not sigmoid else "unknown"


def _routing_bias(router: nn.Module, n_experts: int) -> str | None:
    if any(b.dim() == 1 and b.shape[0] == n_experts for b in router.buffers()):
        return "selection"
    if any(name != "weight" and p.dim() == 1 and p.shape[0] == n_experts for name, p in router.named_parameters()):
        return "logits"
    return None


def _top_k(router: nn.Module | None, block: nn.Module, model: nn.Module) -> int | None:
    for holder in (router, block):
        for key in ("top_k", "num_experts_per_tok", "topk", "moe_topk"):
            value = getattr(holder, key, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    from paratrain.models.hf_files import config_value

    value = config_value(getattr(model, "config", None), "num_experts_per_tok")
    return value if isinstance(value, int) else None


def _takes_interface(experts: nn.Module) -> bool:
    """transformers' @use_experts_implementation sets is_concatenated (and the other layout flags) on each instance."""
    return hasattr(experts, "is_concatenated")


def _describe(block: nn.Module, experts: nn.Module, n_experts: int, others: list[str]) -> tuple[str, str]:
    own = _own(experts)
    if others:
        return "other", f"expert weights in {len(others) + 1} modules: {', '.join(others[:3])}"
    odd = [f"{n} {tuple(p.shape)}" for n, p in own.items() if p.shape[0] != n_experts]
    if odd:
        return "other", f"{', '.join(odd[:2])} not led by its {n_experts} experts"
    return "fused", ""


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every MoE block of `model` (a transformers *ForCausalLM, on any device, meta included), in model order."""
    modules = dict(model.named_modules())
    named = _ep_plan_paths(model, list(modules))
    hidden = hidden_size(model)
    candidates = {name: e for name, m in modules.items() if (e := _experts_like(m, hidden)) is not None}
    blocks: dict[str, list[str]] = {}
    for name in candidates:
        blocks.setdefault(name.rpartition(".")[0], []).append(name)
    out = []
    for block_path, members in blocks.items():
        block = modules[block_path] if block_path else model
        # the ep plan's module, else the one with the most experts; others in the block: shared or split weights
        members.sort(key=lambda n: (n not in named, -candidates[n]))
        experts_path = members[0]
        experts, n_experts = modules[experts_path], candidates[experts_path]
        router_name, router = _find_router(block, experts, n_experts, hidden)
        if router is None and experts_path not in named:
            continue  # 3-D weights that no router scores (e.g. attention's per-head tensors): not an MoE block
        shared, gate = [], None
        split = [m for m in members[1:] if candidates[m] == n_experts]
        for child_name, child in block.named_children():
            path = f"{block_path}.{child_name}" if block_path else child_name
            if child is experts or child is router or path in split or all(p.dim() < 2 for p in child.parameters()):
                continue  # norms and parameter-free children are no experts
            if isinstance(child, nn.Linear) and child.out_features == 1:
                gate = path
            else:
                shared.append(path)
        layout, detail = _describe(block, experts, n_experts, split)
        params = tuple(n for n, p in _own(experts).items() if p.shape[0] == n_experts)
        shared_modules = [modules[p] for p in (*shared, *([gate] if gate else []))]
        out.append(MoELayer(
            layer=_layer_index(experts_path, modules), block=block_path, experts=experts_path,
            experts_class=type(experts).__name__, layout=layout, interface=_takes_interface(experts),
            n_experts=n_experts, top_k=_top_k(router, block, model),
            router=f"{block_path}.{router_name}" if router is not None and block_path else router_name,
            router_scores=_router_scores(router) if router is not None else "unknown",
            group_limited=_group_limited(router), routing_bias=_routing_bias(router, n_experts) if router else None,
            shared_experts=tuple(shared), shared_gate=gate, expert_params=params,
            expert_numel=sum(_own(experts)[n].numel() for n in params),
            shared_numel=sum(p.numel() for m in shared_modules for p in m.parameters()), detail=detail))
    return sorted(out + _stacked_experts(modules, hidden, {layer.block for layer in out}),
                  key=lambda layer: list(modules).index(layer.experts))


def _stacked_experts(modules: dict, hidden: int | None, seen: set[str]) -> list[MoELayer]:
    """MoE blocks whose experts are stacked in 2-D tensors (E x I, H) (DBRX): layout "other", found through a
    sibling router with an (E, H) weight whose E divides the stacked rows."""
    out = []
    for name, module in modules.items():
        own = list(_own(module).values())
        if len(own) < 2 or any(p.dim() != 2 or p.shape != own[0].shape for p in own) or own[0].shape[1] != hidden:
            continue
        parts = name.split(".")
        for depth in (1, 2):  # the block: the parent or the grandparent of the stacked weights
            block_path, experts_path = ".".join(parts[:-depth - 1]), ".".join(parts[:-depth])
            block = modules.get(block_path)
            if block is None or block_path in seen:
                continue
            router_name, router = next(((n, c) for n, c in block.named_children() if isinstance(c, nn.Module)
                                        and modules.get(f"{block_path}.{n}") is not modules[experts_path]
                                        and any(p.dim() == 2 and p.shape[1] == hidden and 1 < p.shape[0] < own[0].shape[0]
                                                and own[0].shape[0] % p.shape[0] == 0 for p in c.parameters())),
                                       (None, None))
            if router is None:
                continue
            n_experts = next(p.shape[0] for p in router.parameters() if p.dim() == 2 and p.shape[1] == hidden)
            seen.add(block_path)
            out.append(MoELayer(
                layer=_layer_index(experts_path, modules), block=block_path, experts=experts_path,
                experts_class=type(modules[experts_path]).__name__, layout="other", interface=False,
                n_experts=n_experts, top_k=_top_k(router, block, None), router=f"{block_path}.{router_name}",
                router_scores=_router_scores(router), group_limited=False, routing_bias=None, shared_experts=(),
                shared_gate=None, expert_params=(), expert_numel=sum(p.numel() for p in own), shared_numel=0,
                detail=f"experts stacked in 2-D tensors: {name.rpartition('.')[2]} {tuple(own[0].shape)}"))
            break
    return out


def _find_router(block: nn.Module, experts: nn.Module, n_experts: int,
                 hidden: int | None) -> tuple[str | None, nn.Module | None]:
    """The block's child that scores the E experts: one holding an (E, H) weight, else (a router MLP) one whose
    last 2-D weight has E rows."""
    children = [(name, child) for name, child in block.named_children() if child is not experts]
    for name, child in children:
        if any(p.dim() == 2 and p.shape[0] == n_experts and n_experts != p.shape[1] and hidden in (None, p.shape[1])
               for p in child.parameters()):
            return name, child
    for name, child in children:
        matrices = [p for p in child.parameters() if p.dim() == 2]
        if len(matrices) > 1 and matrices[-1].shape[0] == n_experts and matrices[0].shape[1] == hidden:
            return name, child
    return None, None


def _group_limited(router: nn.Module | None) -> bool:
    for key in ("n_group", "num_group", "num_expert_group", "n_groups"):
        value = getattr(router, key, None) if router is not None else None
        if isinstance(value, int) and value > 1:
            return True
    return False


def split_refusals(model: nn.Module) -> list[str]:
    """One line per MoE layer whose experts --ep / --tp cannot split (empty: all can)."""
    return [why for layer in moe_layers(model) if (why := layer.split_refusal())]
