"""What verify records on each rank after each step: loss, pre-clip grad norm, full gradients before clipping,
full parameters, and fingerprints of forward activations (to name the first module whose output differs)."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from paratrain.models.hf_pipeline import hf_name

# wrapper path components (DDP, torch.compile, activation checkpointing, FSDP1) that are not part of the model
STRIP = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def clean_name(name: str) -> str:
    # whole components only: replacing the substring "module." would eat "_checkpoint_wrapped_module."
    return ".".join(part for part in name.split(".") if part not in STRIP)


def full_tensors(model_parts, kind: str, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """{fqn: full fp32 CPU tensor} of this rank's parameters (kind="param") or gradients (kind="grad").

    DTensors are gathered with full_tensor(), a collective over their mesh, so every rank holding a shard of the
    same module must call this in the same order (named_parameters order guarantees it). A Replicate dimension
    is not communicated: each rank returns its own copy, which is what lets verify compare every replica.
    """
    out = {}
    for part in model_parts:
        for name, p in part.named_parameters():
            t = p if kind == "param" else p.grad
            if t is None:
                continue
            t = t.detach()
            if hasattr(t, "full_tensor"):
                with _quiet_sequential_gathers():
                    t = t.full_tensor()
            t = t.float().cpu().clone()
            out[hf_name(getattr(part, "module", part), clean_name(name))] = t / scale if scale != 1.0 else t
    return out


def _drop_sequential_gathers(record: logging.LogRecord) -> bool:
    return "sequential all_gather" not in record.getMessage()


@contextlib.contextmanager
def _quiet_sequential_gathers():
    """DTensor warns that a weight FSDP and TP both split on dim 0 is gathered in two all-gathers in sequence, which
    could order reductions differently on each rank: a gather reduces nothing, so every rank gets the same tensor."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    logger.addFilter(_drop_sequential_gathers)
    try:
        yield
    finally:
        logger.removeFilter(_drop_sequential_gathers)


def fingerprinted(path: str) -> bool:
    """Top-level modules, each block and the block's direct children (norms, attention, MLP): their outputs are
    whole or DTensors under every strategy (unlike a column-parallel linear's local output)."""
    parts = path.split(".") if path else []
    if parts[:1] == ["hf"]:  # a transformers model (models/hf_model.py): hf.<base model>.<layer list>.N...
        parts = parts[2:] if len(parts) > 2 else parts[1:]
        if len(parts) >= 2 and parts[1].isdigit():
            return len(parts) in (2, 3)
        return len(parts) == 1 and path.count(".") >= 1
    if parts[:1] == ["layers"]:
        return len(parts) in (2, 3)
    return len(parts) == 1


def local_fingerprint(output: torch.Tensor, tp_rank: int) -> torch.Tensor | None:
    """(numel, sum, sum of squares, sum |x|) of the part of `output` this rank alone holds, in float64; None
    when another rank holds the same values (a Replicate DTensor dim, or a plain tensor on tp rank > 0)."""
    if hasattr(output, "to_local"):
        coords = output.device_mesh.get_coordinate() or []
        if any(p.is_replicate() and c != 0 for p, c in zip(output.placements, coords)):
            return None
        x = output.detach().to_local()
    elif tp_rank != 0:
        return None
    else:
        x = output.detach()
    x = x.double()
    return torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device), x.sum(), (x * x).sum(),
                        x.abs().sum()]).cpu()


def batch_independent(part: nn.Module, path: str, module: nn.Module) -> bool:
    """A transformers model's modules whose output is the same on every rank whatever its data (rotary tables,
    learned position tables): their sums over data-parallel ranks would not add up to the reference's."""
    if not path.startswith("hf."):
        return False
    if next(module.parameters(), None) is None:
        return True
    if isinstance(module, nn.Embedding):
        token_tables = {id(m.hf.get_input_embeddings()) for m in part.modules() if hasattr(m, "use_attention")}
        token_tables |= {id(m.tok_embeddings) for m in part.modules() if getattr(m, "hf_prefixes", None)}  # a stage
        return id(module) not in token_tables
    return False


def _in_backward() -> bool:
    # activation checkpointing recomputes forwards inside backward: those calls are not new activations
    return torch._C._current_graph_task_id() != -1


class Fingerprints:
    """Forward hooks that add up each fingerprinted module's output per step (over micro-batches)."""

    def __init__(self, model_parts: list[nn.Module], tp_rank: int):
        self.tp_rank = tp_rank
        self.calls: dict[str, list[torch.Tensor]] = {}
        self.order: list[str] = []
        self.handles = []
        for part in model_parts:
            seen = set()
            for name, module in part.named_modules():
                path = hf_name(getattr(part, "module", part), clean_name(name))
                if not fingerprinted(path) or path in seen or batch_independent(part, path, module):
                    continue
                seen.add(path)  # the outermost module of that path: wrappers (AC, compile) share it
                self.handles.append(module.register_forward_hook(self._hook(path)))

    def _hook(self, path: str):
        def hook(module, args, output):
            if isinstance(output, (tuple, list)):
                output = output[0] if output else None
            # a 0-dim output is a loss (--fused-loss's head returns its mean): no activation whose sums add over ranks
            if not torch.is_tensor(output) or output.dim() == 0 or _in_backward() or not torch.is_grad_enabled():
                return
            if path not in self.order:
                self.order.append(path)
            stats = local_fingerprint(output, self.tp_rank)
            if stats is not None:
                self.calls.setdefault(path, []).append(stats)

        return hook

    def take(self, calls_per_step: int) -> dict[str, list[float]]:
        """This step's sums, keeping the last `calls_per_step` calls (a pipeline's step 1 adds a forward on
        placeholder tensors to infer shapes); then start the next step."""
        out = {}
        for path, calls in self.calls.items():
            if calls:
                out[path] = torch.stack(calls[-calls_per_step:]).sum(0).tolist()
        self.calls = {}
        return out

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
