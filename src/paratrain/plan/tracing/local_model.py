"""What one rank holds: the real model, cut down to this rank's shard, for the planner to trace on fake tensors.

TP reads the model family's own plan (models/plans.py) and shrinks every Colwise/Rowwise layer to its local
shape; the collectives the DTensor styles would run are simulated in hooks by ops that allocate what the
real ones allocate (a sequence all-gather makes a full-length tensor, a reduce-scatter a 1/tp one), and each
is logged with its payload. CP runs the real ring / Ulysses attention code over a simulated group: a CPComm,
the interface through which that code does all its communication. AC applies the real apply_ac. So what the
trace saves for backward is what the runtime would save, shard for shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.models.llama import ModelArgs
from paratrain.parallel.cp.cp_comm import CPComm


@dataclass
class CommLog:
    """Collectives one forward + backward would issue: (kind, payload bytes, group) per call."""

    fwd: list[tuple[str, int, str]] = field(default_factory=list)
    bwd: list[tuple[str, int, str]] = field(default_factory=list)
    active: bool = True
    in_comm: bool = False  # ops run while True simulate communication, not compute
    phase: str = "fwd"  # set by the tracer: which pass is running now
    op_weight: int = 1  # ops run now stand for this many identical ones (a loop traced once)
    dtensor: dict | None = None  # id -> weakref of the storages that would be DTensors under TP (ops on them
    # pay DTensor dispatch)
    unit: str = "pre"  # the model unit running now (units.py): pre | block | head
    by_unit: dict = field(default_factory=dict)  # "unit/fwd|bwd" -> collectives issued there
    # kinds of forward collectives whose outputs activation checkpointing keeps (activation_checkpoint.py
    # kept_collectives): a recomputation in the backward does not issue them again
    kept: frozenset = frozenset()

    def tag(self, t) -> None:
        if self.dtensor is not None and isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            self.dtensor[id(st)] = weakref.ref(st)

    def untag(self, t) -> None:
        if self.dtensor is not None and isinstance(t, torch.Tensor):
            self.dtensor.pop(id(t.untyped_storage()), None)

    def is_dtensor(self, tensors) -> bool:
        """Whether any of `tensors` lives in a tagged storage (the very storage: an id is reused once its
        storage dies, so a dead entry never tags the newcomer)."""
        if self.dtensor is None:
            return False
        for t in tensors:
            st = t.untyped_storage()
            ref = self.dtensor.get(id(st))
            if ref is not None and ref() is st:
                return True
        return False

    def add(self, kind: str, nbytes: int, group: str, mirrored: bool = False) -> None:
        """Log a collective issued now; `mirrored` ones are the backward twin of a forward collective, logged
        when the forward runs (a recomputation in the backward issues only the forward ones again, and not those
        whose outputs the activation checkpointing keeps: `kept`)."""
        if not self.active or (self.phase == "bwd" and (mirrored or kind in self.kept)):
            return
        phase = "bwd" if mirrored or self.phase == "bwd" else "fwd"
        (self.bwd if phase == "bwd" else self.fwd).append((kind, int(nbytes), group))
        self.by_unit.setdefault(f"{self.unit}/{phase}", []).append((kind, int(nbytes), group))

    @contextlib.contextmanager
    def simulating(self):
        prev, self.in_comm = self.in_comm, True
        try:
            yield
        finally:
            self.in_comm = prev


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- tensor parallel -------------------------------------------------------------------------------------------
def _is_shard(layout, dim: int | None = None) -> bool:
    from torch.distributed.tensor import Shard

    return isinstance(layout, Shard) and (dim is None or layout.dim == dim)


def _is_replicate(layout) -> bool:
    from torch.distributed.tensor import Replicate

    return isinstance(layout, Replicate)


def _shrink(module: nn.Module, colwise: bool, tp: int) -> None:
    """Give a Linear / Embedding the local shape a Colwise / Rowwise style would leave on one rank."""
    w = module.weight
    if isinstance(module, nn.Linear):
        shape = (w.shape[0] // tp, w.shape[1]) if colwise else (w.shape[0], w.shape[1] // tp)
    else:  # nn.Embedding: colwise splits the embedding dim, rowwise the vocabulary
        shape = (w.shape[0], w.shape[1] // tp) if colwise else (w.shape[0] // tp, w.shape[1])
    module.weight = nn.Parameter(torch.empty(shape, dtype=w.dtype), requires_grad=w.requires_grad)  # LoRA: frozen
    bias = getattr(module, "bias", None)
    if bias is not None and colwise:
        module.bias = nn.Parameter(torch.empty(shape[0], dtype=bias.dtype), requires_grad=bias.requires_grad)


def _gather_seq(x: torch.Tensor, tp: int, log: CommLog) -> torch.Tensor:
    with log.simulating():
        full = x.repeat(1, tp, *([1] * (x.dim() - 2)))
    log.add("all_gather", _nbytes(full), "tp")
    log.add("reduce_scatter", _nbytes(full), "tp", mirrored=True)
    return full


def _scatter_seq(x: torch.Tensor, tp: int, log: CommLog) -> torch.Tensor:
    with log.simulating():
        local = x.narrow(1, 0, x.shape[1] // tp).clone()
    log.add("reduce_scatter", _nbytes(x), "tp")
    log.add("all_gather", _nbytes(x), "tp", mirrored=True)
    return local


def _all_reduce(x: torch.Tensor, log: CommLog) -> torch.Tensor:
    with log.simulating():
        out = x.clone()
    log.add("all_reduce", _nbytes(out), "tp")
    return out


def _gather_last(x: torch.Tensor, tp: int, log: CommLog) -> torch.Tensor:
    with log.simulating():
        full = x.repeat(*([1] * (x.dim() - 1)), tp)
    log.add("all_gather", _nbytes(full), "tp")
    return full


def simulate_tp(model: nn.Module, plan: dict, tp: int, log: CommLog) -> None:
    """Shrink the layers a TP plan shards and hook in the collectives its styles would run."""
    # The styles' own _apply needs a real device mesh and runs real collectives, so their effect is mirrored
    # here from each style's public fields (input/output layouts, use_local_output) and its torch class.
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
    )

    from paratrain.parallel.tp.tensor_parallel import match_modules

    def halves(style) -> tuple:
        """(input style, output style) of a layout-preparing style (PrepareModuleInputOutput has both)."""
        if isinstance(style, PrepareModuleInputOutput):
            return style.prepare_module_input, style.prepare_module_output
        return (style if isinstance(style, PrepareModuleInput) else None,
                style if isinstance(style, PrepareModuleOutput) else None)

    prepared = set()
    for path, style in plan.items():
        if halves(style)[0] is not None:
            prepared.update(name for name, _ in match_modules(model, path))

    def under_prepared(name: str) -> bool:
        return any(name.startswith(p + ".") for p in prepared)

    for path, style in plan.items():
        for name, module in match_modules(model, path):
            into, out_of = halves(style)
            if into is not None or out_of is not None:
                if into is not None:
                    module.register_forward_pre_hook(_prepare_input_hook(into, tp, log))
                if out_of is not None:
                    module.register_forward_hook(_prepare_output_hook(out_of, tp, log))
            elif isinstance(style, ColwiseParallel):
                _shrink(module, True, tp)
                module.register_forward_pre_hook(_colwise_pre_hook(style, tp, log, not under_prepared(name)))
                if _is_replicate(style.output_layouts[0]):
                    module.register_forward_hook(lambda m, a, out: _gather_last(out, tp, log))
            elif isinstance(style, RowwiseParallel):
                _shrink(module, False, tp)
                out_layout = style.output_layouts[0]
                if _is_shard(out_layout, 1):
                    module.register_forward_hook(lambda m, a, out: _scatter_seq(out, tp, log))
                elif _is_replicate(out_layout):
                    module.register_forward_hook(lambda m, a, out: _all_reduce(out, log))
            # SequenceParallel / ReplicateParallel: parameters whole, activations already local: no comm
            _track_dtensor_boundary(module, style, log)


def _redistribute(x: torch.Tensor, have, want, tp: int, log: CommLog, feeds_colwise: bool) -> torch.Tensor:
    """What a DTensor layout change allocates and sends: Shard(1) -> Replicate all-gathers the sequence,
    Replicate -> Shard(1) keeps this rank's slice (free); a replicated input of colwise layers has its
    gradient all-reduced in backward."""
    if _is_shard(have, 1) and _is_replicate(want):
        return _gather_seq(x, tp, log)
    if _is_replicate(have) and _is_shard(want, 1):
        return x.narrow(1, 0, x.shape[1] // tp)
    if _is_replicate(have) and _is_replicate(want) and feeds_colwise:
        log.add("all_reduce", _nbytes(x), "tp", mirrored=True)
    return x


def _track_dtensor_boundary(module: nn.Module, style, log: CommLog) -> None:
    """Inputs a style wraps become DTensors; outputs it hands back as local tensors stop being ones."""
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    from paratrain.models.tp_styles import ReplicateParallel

    if log.dtensor is None:
        return
    for p in module.parameters(recurse=False):
        log.tag(p)

    def pre(mod, args):
        for a in args:
            log.tag(a)

    def post(mod, args, out):
        local = getattr(style, "use_local_output", None)
        if local is None and isinstance(style, PrepareModuleInputOutput):
            local = style.prepare_module_output.use_local_output
        if local or isinstance(style, ReplicateParallel):
            log.untag(out)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _prepare_input_hook(style, tp: int, log: CommLog):
    def hook(module, args):
        if getattr(style, "input_layouts", None) is None:
            return None
        out = list(args)
        for i, (have, want) in enumerate(zip(style.input_layouts, style.desired_input_layouts)):
            if i >= len(out) or have is None or want is None or not isinstance(out[i], torch.Tensor):
                continue
            out[i] = _redistribute(out[i], have, want, tp, log, feeds_colwise=True)
        return tuple(out)

    return hook


def _prepare_output_hook(style, tp: int, log: CommLog):
    def hook(module, args, out):
        if not isinstance(out, torch.Tensor):
            return None
        have, want = style.output_layouts[0], style.desired_output_layouts[0]
        if have is None or want is None:
            return None
        return _redistribute(out, have, want, tp, log, feeds_colwise=False)

    return hook


def _colwise_pre_hook(style, tp: int, log: CommLog, owns_input: bool):
    def hook(module, args):
        if not owns_input or not args or not isinstance(args[0], torch.Tensor):
            return None
        layout = style.input_layouts[0]
        if _is_shard(layout, 1):
            return (_gather_seq(args[0], tp, log),) + tuple(args[1:])
        log.add("all_reduce", _nbytes(args[0]), "tp", mirrored=True)
        return None

    return hook


# -- context parallel --------------------------------------------------------------------------------------------
class _RingSteps:
    """Ring attention on a simulated ring of 3 standing for one of `cp` > 3: its steps 1 .. cp-2 are alike
    (rank 0 holds a K/V block from a later rank: the same shapes, unmasked, the same shifts), so the one
    middle step is traced and its ops, collectives and row tiles weighted cp - 2 times."""

    size = 3

    def __init__(self, cp: int, log: CommLog):
        self.cp, self.log = cp, log
        self.weight = 1

    def enter(self, step: int) -> None:
        self.weight = self.cp - 2 if step == 1 else 1
        self.log.op_weight = self.weight


class SimulatedCP(CPComm):
    """The cp group the planner's attention runs over: rank 0 of `size`; a transfer allocates what it
    receives and logs its payload. With `steps`, ring attention's alike middle steps count as many as they
    stand for."""

    def __init__(self, size: int, log: CommLog, steps: _RingSteps | None = None):
        self.size, self.rank, self.log, self.steps = size, 0, log, steps

    def _step_weight(self) -> int:
        return self.steps.weight if self.steps is not None else 1

    def ring_step(self, step: int) -> None:
        if self.steps is not None:
            self.steps.enter(step)

    def shift(self, tensor: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        recv = torch.empty_like(tensor)
        for _ in range(self._step_weight()):
            self.log.add("p2p", _nbytes(tensor), "cp")
        return recv, []

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.log.add("all_to_all", _nbytes(inp), "cp")

    def row_tiles(self, tiles: list[slice]):
        # the tiles of one block are alike: trace the first and count its ops once per tile
        if not tiles:
            return
        self.log.op_weight = len(tiles) * self._step_weight()
        try:
            yield tiles[0]
        finally:
            self.log.op_weight = self._step_weight()


def simulated_cp(cp: int, impl: str, ac: str, log: CommLog) -> SimulatedCP:
    """The simulated group for `impl` attention at `cp`. Ring attention's alike middle steps are traced once
    and weighted (_RingSteps), except under selective AC: its policy saves each step's matmul outputs for the
    backward, so the live bytes grow with every step and the whole ring is walked."""
    if impl == "ring" and cp > _RingSteps.size and ac != "selective":
        steps = _RingSteps(cp, log)
        return SimulatedCP(steps.size, log, steps)
    return SimulatedCP(cp, log)


def cp_attention(impl: str, comm: CPComm):
    from paratrain.parallel.cp.ring_attention import ring_attention
    from paratrain.parallel.cp.ulysses import ulysses_attention

    fn = ring_attention if impl == "ring" else ulysses_attention
    return lambda q, k, v: fn(q, k, v, group=comm)


# -- the rank's model --------------------------------------------------------------------------------------------
def stage_args(args: ModelArgs, layers: int) -> ModelArgs:
    return dataclasses.replace(args, n_layers=layers)


def build_local_model(args: ModelArgs, layers: int, part: str, tp: int, sp: bool, cp: int, cp_impl: str, ac: str,
                      log: CommLog, loss_parallel: bool | None = None, ep: int = 1, lora: tuple = ()) -> nn.Module:
    """The model one rank runs, on whatever fake/meta mode is active: `layers` blocks, this pipeline `part`,
    TP-local shapes with simulated collectives, CP attention, activation checkpointing, LoRA adapters on a
    frozen base (`lora`: lora_trace.py). `loss_parallel` defaults to what the trainer does: vocab-sharded logits
    into the loss only without a pipeline."""
    from paratrain.models.presets import build_model
    from paratrain.plan.tracing.lora_trace import attach_traced_adapters, shard_traced_adapters

    model = build_model(stage_args(args, layers), "cpu", seed=None)
    if args.moe:
        from paratrain.plan.tracing.moe_trace import trace_balanced_moe

        trace_balanced_moe(model, ep, log)
    if part in ("middle", "last"):
        model.tok_embeddings = None
    if part in ("first", "middle"):
        model.norm = None
        model.output = None
    if lora:  # attached before the TP plan is applied, as the trainer does
        attach_traced_adapters(model, lora)
    if tp > 1:
        from paratrain.models.plans import tp_plan_for

        tied = model.output is not None and model.tok_embeddings is not None and \
            model.output.weight is getattr(model.tok_embeddings, "tokens", model.tok_embeddings).weight
        # as the trainer runs it: without a pipeline the logits stay vocab-sharded into the loss (loss parallel)
        sharded_loss = part == "whole" if loss_parallel is None else loss_parallel
        plan = tp_plan_for(model, tp, sp=sp, loss_parallel=sharded_loss)
        simulate_tp(model, plan, tp, log)
        if lora:
            shard_traced_adapters(model, plan, tp, log)
        if tied:  # one shard of the table serves the lookup and the head, as under TiedColwiseParallel
            model.output.weight = model.tok_embeddings.tokens.weight
    if cp > 1:
        attn = cp_attention(cp_impl, simulated_cp(cp, cp_impl, ac, log))
        for block in model.layers.values():
            block.attention.attn_fn = attn
    if ac != "none":
        from paratrain.parallel.activation_checkpoint import apply_ac, kept_collectives

        apply_ac(model, ac)
        log.kept = kept_collectives(ac)
    return model
