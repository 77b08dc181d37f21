"""The trainer's documented extension points (docs/hooks.md): a small registry of callbacks the Trainer holds.

    hooks = Hooks()
    hooks.on_phase(lambda phase: print(phase))
    Trainer(cfg, runtime, hooks=hooks)

Every kind, what it receives and when it runs, is in KINDS below. Without a registration a point costs one
empty-list check. A registration returns a handle whose remove() undoes it.

Plugins: PARATRAIN_PLUGINS="module:function[,module:function]" names functions that every paratrain process
(the CLI's and each worker's) imports and calls once, with the process's default registry, before it first
uses it. paratrain forwards every PARATRAIN_* variable to its workers, so a plugin can read its own settings
from one. Tests plant faults, stalls and slow ranks this way (tests/support/); nothing in paratrain does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable

from paratrain.errors import UserError
from paratrain.parallel.collective_hooks import add_interceptor

PLUGINS_ENV = "PARATRAIN_PLUGINS"

# kind -> (what the callback receives and returns, when it runs)
KINDS = {
    "on_phase": ("fn(phase)", 'train_step: "start", then as each phase ends: "forward_backward", "optimizer", '
                 '"loss_sync"'),
    "wrap_step": ("fn(trainer, micro_batches, step) -> dict; step(micro_batches) runs the rest",
                  "around the whole train_step (the first registered is the outermost)"),
    "tp_plan": ("fn(model, plan) -> plan", "before parallelize, once per model (per pipeline stage) under tp > 1"),
    "after_parallelize": ("fn(module, layout)", "after parallelize, once per model part (per pipeline stage)"),
    "on_pipeline_stage": ("fn(stage, spec)", "once per PipelineStage this rank holds, before its busy clock"),
    "around_compute": ("fn(index) -> context manager", "around each micro-batch's forward + backward (no pipeline)"),
    "prepare_batch": ("fn(inputs, targets, extra, layout) -> (inputs, targets, extra)",
                      "each micro-batch, after the runner's own preparation (context parallel's sharding)"),
    "loss_weight": ("fn(layout, dp_rank, weight) -> weight", "once, at build; weight None means 1 / micro-batches"),
    "on_gradients": ("fn(trainer)", "each step, gradients complete: before unscaling and clipping"),
    "before_optimizer_step": ("fn(trainer)", "each step, after clipping, before the optimizers step"),
    "before_batch": ("fn(step)", "on the loader thread, before each step's batch is read"),
    "after_step": ("fn(trainer, record)", "each step, after its metrics record is logged and before that step's "
                   "checkpoint (record: the metrics.jsonl fields)"),
    "auto_candidates": ("fn(candidates) -> candidates", "--strategy auto: the feasible layouts, fastest first"),
    "on_collective": ("fn(call, proceed) -> result", "around each of paratrain's own collectives, process-wide "
                      "(parallel/collective_hooks.py)"),
    "next_token_logits": ("fn(logits, layout) -> logits", "generate: each decoding step, the next-token logits "
                          "(batch, vocab; whole, on every rank) before a token is chosen (infer/generate.py)"),
}


class Handle:
    """What a registration returns: remove() unregisters it (twice is harmless)."""

    def __init__(self, remove: Callable[[], None]):
        self._remove = remove

    def remove(self) -> None:
        self._remove()


class Hooks:
    """Callbacks by kind. A child registry (Hooks(parent)) runs its parent's callbacks first, then its own:
    each Trainer holds a child of the registry it was given, so what doctor or --monitor attach to one
    trainer stays with it."""

    def __init__(self, parent: Hooks | None = None):
        self.parent = parent
        # kind -> [(callback, owner, what else to undo on removal)]
        self._entries: dict[str, list[tuple]] = {kind: [] for kind in KINDS}
        self._owner: object = None  # while a plugin loads: a mark, so a reload can take its registrations back

    # -- registration --------------------------------------------------------------------------------------------
    def _add(self, kind: str, fn: Callable, remove_also: Callable[[], None] | None = None) -> Handle:
        if not callable(fn):
            raise UserError(f"hooks.{kind}: expected a function, got {type(fn).__name__}")
        entry = (fn, self._owner, remove_also)
        self._entries[kind].append(entry)
        return Handle(functools.partial(self._remove, kind, entry))

    def _remove(self, kind: str, entry: tuple) -> None:
        if entry in self._entries[kind]:
            self._entries[kind].remove(entry)
        if entry[2] is not None:
            entry[2]()

    def on_phase(self, fn) -> Handle:
        return self._add("on_phase", fn)

    def wrap_step(self, fn) -> Handle:
        return self._add("wrap_step", fn)

    def tp_plan(self, fn) -> Handle:
        return self._add("tp_plan", fn)

    def after_parallelize(self, fn) -> Handle:
        return self._add("after_parallelize", fn)

    def on_pipeline_stage(self, fn) -> Handle:
        return self._add("on_pipeline_stage", fn)

    def around_compute(self, fn) -> Handle:
        return self._add("around_compute", fn)

    def prepare_batch(self, fn) -> Handle:
        return self._add("prepare_batch", fn)

    def loss_weight(self, fn) -> Handle:
        return self._add("loss_weight", fn)

    def on_gradients(self, fn) -> Handle:
        return self._add("on_gradients", fn)

    def before_optimizer_step(self, fn) -> Handle:
        return self._add("before_optimizer_step", fn)

    def before_batch(self, fn) -> Handle:
        return self._add("before_batch", fn)

    def after_step(self, fn) -> Handle:
        return self._add("after_step", fn)

    def auto_candidates(self, fn) -> Handle:
        return self._add("auto_candidates", fn)

    def on_collective(self, fn) -> Handle:
        """Process-wide, whichever registry it is registered on (a collective knows no trainer)."""
        return self._add("on_collective", fn, remove_also=add_interceptor(fn))

    def next_token_logits(self, fn) -> Handle:
        return self._add("next_token_logits", fn)

    def remove_owned(self, owner: object) -> None:
        for kind, entries in self._entries.items():
            for entry in [e for e in entries if e[1] is owner]:
                self._remove(kind, entry)

    # -- what paratrain calls ------------------------------------------------------------------------------------
    def callbacks(self, kind: str) -> list[Callable]:
        own = [entry[0] for entry in self._entries[kind]]
        return self.parent.callbacks(kind) + own if self.parent is not None else own

    def has(self, kind: str) -> bool:
        return bool(self._entries[kind]) or (self.parent is not None and self.parent.has(kind))

    def fire(self, kind: str, *args) -> None:
        """Call every callback of `kind` with args (the kinds that return nothing)."""
        if self.has(kind):
            for fn in self.callbacks(kind):
                fn(*args)

    def phase(self, name: str) -> None:
        self.fire("on_phase", name)

    def run_step(self, trainer, micro_batches, step: Callable) -> dict:
        run = step
        for fn in reversed(self.callbacks("wrap_step")):
            run = functools.partial(_wrapped_step, fn, trainer, run)
        return run(micro_batches)

    def apply_tp_plan(self, model, plan):
        for fn in self.callbacks("tp_plan"):
            plan = fn(model, plan)
        return plan

    def apply_loss_weight(self, layout, dp_rank: int, weight):
        for fn in self.callbacks("loss_weight"):
            weight = fn(layout, dp_rank, weight)
        return weight

    def apply_prepare_batch(self, inputs, targets, extra: dict, layout):
        for fn in self.callbacks("prepare_batch"):
            inputs, targets, extra = fn(inputs, targets, extra, layout)
        return inputs, targets, extra

    def compute(self, index: int):
        """The context every around_compute callback gives for micro-batch `index`, entered together."""
        if not self.has("around_compute"):
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for fn in self.callbacks("around_compute"):
            stack.enter_context(fn(index))
        return stack

    def apply_next_token_logits(self, logits, layout):
        for fn in self.callbacks("next_token_logits"):
            logits = fn(logits, layout)
        return logits

    def apply_auto_candidates(self, candidates: list) -> list:
        for fn in self.callbacks("auto_candidates"):
            candidates = fn(candidates)
        return candidates


def _wrapped_step(fn, trainer, run, micro_batches):
    return fn(trainer, micro_batches, run)


# -- the process's default registry and its plugins ------------------------------------------------------------
_default: Hooks | None = None
_loaded_spec: str | None = None


def default_hooks() -> Hooks:
    """This process's registry: what PARATRAIN_PLUGINS names, loaded on first use (and again if it changed)."""
    global _default, _loaded_spec
    if _default is None:
        _default = Hooks()
    spec = os.environ.get(PLUGINS_ENV, "").strip()
    if spec != _loaded_spec:
        _default.remove_owned(PLUGINS_ENV)
        _loaded_spec = spec  # set first: a failing plugin is reported once, not on every later use
        load_plugins(_default, spec)
    return _default


def load_plugins(hooks: Hooks, spec: str) -> None:
    """Import and call each "module:function" of `spec` with `hooks`; one UserError line for a bad entry."""
    for item in filter(None, (part.strip() for part in spec.split(","))):
        fn = resolve_plugin(item)
        previous, hooks._owner = hooks._owner, PLUGINS_ENV
        try:
            fn(hooks)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's plugin: name it in one line
            raise UserError(f"{PLUGINS_ENV}: plugin {item} failed: {type(exc).__name__}: {exc}") from None
        finally:
            hooks._owner = previous


def resolve_plugin(item: str) -> Callable:
    module_name, sep, function = item.partition(":")
    if not sep or not module_name.strip() or not function.strip():
        raise UserError(f"{PLUGINS_ENV}: {item!r} is not MODULE:FUNCTION (e.g. my_plugins:register)")
    try:
        module = importlib.import_module(module_name.strip())
    except Exception as exc:  # noqa: BLE001 - ImportError, or whatever the module raised on import
        raise UserError(f"{PLUGINS_ENV}: cannot import {module_name.strip()!r}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, function.strip(), None)
    if not callable(fn):
        raise UserError(f"{PLUGINS_ENV}: module {module_name.strip()!r} has no function {function.strip()!r}")
    return fn
