"""Imports go one way: no import circle between files of src/, and packages only import those below them
(cli -> bench/doctor/launchers/verify/convert -> calibrate -> plan -> infer -> train -> parallel -> models), as docs/architecture.md
says; no module reaches a leading-underscore name of another paratrain module; no string names another
package's code; nothing reads or patches a private attribute it does not own, nor issues a torch.distributed
collective around the collective door, beyond the allow-lists below, each entry with its reason. Walks the
source with ast (no paratrain module is imported; only the non-paratrain base classes a class overrides)."""

from __future__ import annotations

import ast
from pathlib import Path

import source_rules

SRC = Path(__file__).resolve().parents[1] / "src" / "paratrain"
# lower index = lower layer; a package may import its own layer and anything below it
LAYERS = [{"errors", "gpu_catalog"}, {"costs"}, {"models"}, {"interop"}, {"parallel"}, {"config", "config_markers", "training_options", "lora_options"}, {"train"}, {"infer"}, {"plan"}, {"calibrate"},
          {"bench", "doctor", "launchers", "verify", "convert"}, {"cli", "cli_options", "env_report", "api", "__init__"}]


def module_files() -> dict[str, Path]:
    names = {}
    for path in SRC.rglob("*.py"):
        parts = ("paratrain", *path.relative_to(SRC).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def module_graph() -> dict[str, set[str]]:
    names = module_files()
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("paratrain"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in names else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("paratrain"))
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, group in enumerate(LAYERS) if top in group)


def test_no_import_circle_between_files():
    assert find_cycle(module_graph()) is None, " -> ".join(find_cycle(module_graph()) or [])


def test_packages_import_only_downwards():
    wrong = [f"{a} -> {b}" for a, deps in module_graph().items() for b in deps if layer_of(b) > layer_of(a)]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_circle_and_an_upward_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert layer_of("paratrain.models.llama") < layer_of("paratrain.parallel.layout") < layer_of("paratrain.plan.costing.time")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def foreign_uses(source: str, module: str, modules: set[str]) -> list[str]:
    """Where `source` (the file of `module`) reaches into another paratrain module: a private name (`from
    paratrain.x import _name`, `x._name`, getattr(x, "_name")) or an assignment to any of its attributes
    (`x.name = ...`, setattr(x, ...): a patch of its globals), x being an imported paratrain module."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the paratrain module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "paratrain":
            for alias in node.names:
                if is_private(alias.name) and node.module != module:
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                if f"{node.module}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "paratrain":
                    bound[alias.asname or "paratrain"] = alias.name if alias.asname else "paratrain"

    def module_of(expr) -> str | None:
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute) and (outer := module_of(expr.value)):
            return f"{outer}.{expr.attr}" if f"{outer}.{expr.attr}" in modules else None
        return None

    for node in ast.walk(tree):
        target, name, assigns = None, None, False
        if isinstance(node, ast.Attribute):
            target, name = module_of(node.value), node.attr
            assigns = isinstance(node.ctx, (ast.Store, ast.Del))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            target, name = module_of(node.args[0]), node.args[1].value
            assigns = node.func.id in ("setattr", "delattr")
        if target and target != module and (assigns or is_private(name)):
            found.append(f"{node.lineno}: {'assigns ' if assigns else ''}{target}.{name}")
    return found


def test_no_module_reaches_into_another_ones_privates_or_patches_it():
    names = module_files()
    wrong = [f"{path.relative_to(SRC.parent)}:{where}" for name, path in sorted(names.items())
             for where in foreign_uses(path.read_text(), name, set(names))]
    assert not wrong, "\n".join(wrong)


PLANTED = """
import paratrain.plan.tracing.trace
import paratrain.parallel.cp.ring_attention as ring
from paratrain.plan.costing import memory
from paratrain.plan.tracing.trace import _quiet, quiet_logs
from paratrain.plan.tracing.local_model import _nbytes as nbytes


def f(x):
    paratrain.plan.tracing.trace._recorder
    ring._row_tiles = None
    memory._from_chunks([], [], 1, False)
    getattr(ring, "_KV_TAG", 0)
    memory.GIB = 1
    setattr(ring, "ring_attention", f)
    x.y, x._z = ring.ring_attention, memory.GIB
    return x._private, paratrain.__name__, _own
"""


def test_the_checker_sees_private_names_and_patches():
    modules = set(module_files())
    assert set(foreign_uses(PLANTED, "paratrain.plan.tracing.units", modules)) == {
        "5: from paratrain.plan.tracing.trace import _quiet", "6: from paratrain.plan.tracing.local_model import _nbytes",
        "10: paratrain.plan.tracing.trace._recorder", "11: assigns paratrain.parallel.cp.ring_attention._row_tiles",
        "12: paratrain.plan.costing.memory._from_chunks", "13: paratrain.parallel.cp.ring_attention._KV_TAG",
        "14: assigns paratrain.plan.costing.memory.GIB",
        "15: assigns paratrain.parallel.cp.ring_attention.ring_attention"}
    # a module's own private names and globals are its own business
    own = "from paratrain.plan.tracing.trace import _quiet\nimport paratrain.plan.tracing.trace as t\nt._quiet\nt.X = 1"
    assert foreign_uses(own, "paratrain.plan.tracing.trace", modules) == []


# -- strings naming code, private reaches, the collective door (tests/source_rules.py) --------------------------
def findings(check) -> dict[str, str]:
    """{"path: what": "path:LINE: what" of its first line} over src/, `check(source, module)` giving "LINE: what"."""
    out: dict[str, str] = {}
    for name, path in sorted(module_files().items()):
        rel = path.relative_to(SRC).as_posix()
        for where in check(path.read_text(), name):
            line, _, what = where.partition(": ")
            out.setdefault(f"{rel}: {what}", f"{rel}:{line}: {what}")
    return out


def allowed(groups: dict[tuple[str, ...], str]) -> dict[str, str]:
    return {entry: reason for entries, reason in groups.items() for entry in entries}


ALLOWED_STRING_REFERENCES = allowed({
    ("launchers/common.py: names paratrain.cli",):
        "the command a generated job script runs (python -m paratrain.cli): a program started, not code called",
})

TORCH_GROUPED_MM = "torch's grouped GEMM has no public name in torch 2.13; used only where grouped_mm_supported()"
CHECKPOINT_WRAPPER = "torch's checkpoint_wrapper exposes the wrapped block only as _checkpoint_wrapped_module"
PG_TIMEOUT = "a process group's timeout is readable and settable only through its backend options' _timeout"
MESH_FLATTEN = "DeviceMesh's flattened dims (dp_cp, dp) have no public constructor in torch 2.13 (torchtitan uses _flatten too)"
ALLOWED_REACHES = allowed({
    ("parallel/dp/data_parallel.py: overrides ZeroRedundancyOptimizer._broadcast_params_from_rank",):
        "ZeRO-1's post-step parameter broadcast, routed through the collective door; torch has no public hook there",
    tuple(f"models/{f}: overrides {base}._apply" for f, base in (
        ("hf_moe.py", "ParallelStyle"), ("hf_tp_plan.py", "ParallelStyle"), ("tp_styles.py", "ParallelStyle"),
        ("tp_styles.py", "RowwiseParallel"), ("tp_styles.py", "ColwiseParallel"), ("lora_tp.py", "ParallelStyle"))):
        "torch's ParallelStyle contract: a custom style implements _apply (parallelize_module calls it)",
    ("models/hf_moe.py: reads torch._grouped_mm", "models/moe.py: reads torch._grouped_mm"): TORCH_GROUPED_MM,
    ("models/hf_moe.py: reads module._apply_gate",):
        "transformers' MoE experts keep their gated activation in _apply_gate: called so the math stays theirs",
    ("models/hf_model.py: reads model._no_split_modules", "convert/hf_model_export.py: reads model._tied_weights_keys"):
        "transformers' per-architecture declarations (decoder block class, tied weights) exist only under these names",
    ("models/hf_model.py: patches self.hf.config._attn_implementation",
     "models/hf_model.py: reads self.hf.config._attn_implementation"):
        "transformers selects a registered attention function through config._attn_implementation",
    ("cli.py: reads os._exit",): "Python's documented immediate exit (os._exit)",
    ("train/optimizer_graph.py: reads torch._foreach_copy_", "train/param_copies.py: reads torch._foreach_copy_"):
        "one multi-tensor copy per step (torch's own optimizers use the _foreach ops); a Python loop of copy_ "
        "launches a kernel per tensor, the cost these speed options remove",
    ("train/param_copies.py: reads m._version",):
        "the tensor's in-place version counter: the one way to see a weight changed outside the optimizer "
        "(a checkpoint load, a healed replica) before a forward reads a stale bf16 copy",
    ("parallel/activation_checkpoint.py: reads block._checkpoint_wrapped_module",
     "parallel/compile.py: reads block._checkpoint_wrapped_module"): CHECKPOINT_WRAPPER,
    ("parallel/activation_checkpoint.py: reads nn.modules.dropout._DropoutNd",):
        "the common base of torch's dropout modules; a tuple of the public ones would drift with torch",
    ("parallel/activation_checkpoint.py: reads torch.ops._c10d_functional",):
        "the functional collectives' op namespace is private; selective AC must name reduce_scatter_tensor's op",
    ("parallel/compile.py: reads block._orig_mod", "parallel/compile.py: reads inner._compiled_call_impl"):
        "torch.compile marks a compiled module only through _orig_mod (OptimizedModule) / _compiled_call_impl",
    ("parallel/layout.py: reads mesh[present]._flatten", "parallel/layout.py: reads parent._flatten",
     "parallel/layout.py: reads parent._unflatten", "parallel/layout.py: reads split._flatten"): MESH_FLATTEN,
    ("parallel/layout.py: patches options._timeout", "parallel/layout.py: reads default._get_backend",
     "parallel/layout.py: reads default._get_backend(torch.device(device_type)).options._timeout",
     "parallel/layout.py: reads dist.ProcessGroupGloo._Options",
     "parallel/layout.py: reads dist.distributed_c10d._get_default_group",
     "parallel/tied_weights.py: reads pp_mesh.get_group()._get_backend",
     "parallel/tied_weights.py: reads pp_mesh.get_group()._get_backend(torch.device(device_type)).options._timeout"):
        PG_TIMEOUT,
    ("train/recovery/flight_recorder.py: reads torch._C._distributed_c10d._dump_fr_trace_json",):
        "PyTorch's flight recorder is dumped only through this binding (torch's own fr_trace tool uses it)",
    ("train/memory_snapshot.py: reads torch.cuda.memory._record_memory_history",
     "train/memory_snapshot.py: reads torch.cuda.memory._dump_snapshot"):
        "torch's documented memory-snapshot API (docs: 'Understanding CUDA Memory Usage') has only these names",
    ("verify/recorder.py: reads torch._C._current_graph_task_id",):
        "the only way to tell a checkpoint's recomputed forward (inside backward) from a new one",
})

CALIBRATION = "calibration times the raw collective and synchronizes its timing ranks; no training step runs there"
TOOL_REPORT = "a tool gathers its report or aligns its ranks outside training steps, where no interceptor aims"
ALLOWED_OUTSIDE_THE_DOOR = allowed({
    tuple(f"calibrate/{f}: dist.{op}" for f, op in (
        ("harness.py", "all_gather_object"), ("harness.py", "all_reduce"), ("harness.py", "barrier"),
        ("microbench.py", "all_reduce"), ("microbench.py", "all_to_all_single"), ("microbench.py", "barrier"),
        ("microbench.py", "batch_isend_irecv"), ("microbench.py", "broadcast"), ("save_profile.py", "barrier"),
        ("timing.py", "all_reduce"), ("timing.py", "barrier"))): CALIBRATION,
    ("doctor/capture.py: dist.gather_object", "doctor/counterfactual.py: dist.barrier",
     "verify/parity.py: dist.gather_object"): TOOL_REPORT,
})


def unexplained(found: dict[str, str], allow: dict[str, str]) -> list[str]:
    return [where for key, where in found.items() if key not in allow]


def test_no_string_names_another_packages_code():
    names = set(module_files())
    found = findings(lambda source, module: source_rules.string_references(source, module, names, layer_of))
    assert not unexplained(found, ALLOWED_STRING_REFERENCES), "\n".join(unexplained(found, ALLOWED_STRING_REFERENCES))
    assert set(ALLOWED_STRING_REFERENCES) <= set(found), set(ALLOWED_STRING_REFERENCES) - set(found)


def test_no_module_reads_or_patches_privates_it_does_not_own():
    found = findings(lambda source, module: source_rules.private_reaches(source))
    assert not unexplained(found, ALLOWED_REACHES), "\n".join(unexplained(found, ALLOWED_REACHES))
    assert set(ALLOWED_REACHES) <= set(found), set(ALLOWED_REACHES) - set(found)  # the list stays true


def test_collectives_go_through_the_door():
    found = findings(lambda source, module: source_rules.collectives_outside_the_door(source))
    assert not unexplained(found, ALLOWED_OUTSIDE_THE_DOOR), "\n".join(unexplained(found, ALLOWED_OUTSIDE_THE_DOOR))
    assert set(ALLOWED_OUTSIDE_THE_DOOR) <= set(found), set(ALLOWED_OUTSIDE_THE_DOOR) - set(found)


PLANTED_REFERENCES = '''
COST = "paratrain.plan.costing.time:chunk_time"
SAME = "paratrain.parallel.checks:check_tp"
BELOW = "paratrain.models"
ABOVE = "paratrain.cli"
LOGGER = "paratrain.forward_backward"
'''

PLANTED_REACHES = '''
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import PipelineStage
from paratrain.plan.tracing.tracker import LiveTensorTracker


class Zero(ZeroRedundancyOptimizer):
    def _broadcast_params_from_rank(self, rank):
        return self._partition_parameters()

    def _helper(self):
        return super()._helper()


class Own:
    _cache = None


def f(stage, tracker: LiveTensorTracker, own: Own, x):
    stage._compute_outputs = f
    PipelineStage._compute_outputs = f
    setattr(torch.nn.Module, "_call_impl", f)
    live = tracker._live
    getattr(x, "_hidden", None)
    return torch._C._get_tracing_state, own._cache, Own._cache, x.public
'''

PLANTED_DOOR = '''
import functools
import torch.distributed as dist
from paratrain.parallel.collective_hooks import collective


def f(t, group):
    dist.all_reduce(t)
    collective("loss", "dp", "all_reduce", group, lambda: dist.all_reduce(t, group=group), (t,))
    collective("x", "dp", "broadcast", group, functools.partial(dist.broadcast, t, src=0), (t,))
    dist.get_rank()
    return [dist.P2POp(dist.isend, t, 1)], dist.batch_isend_irecv([])
'''


def test_the_checkers_see_string_references_private_reaches_and_bypassed_collectives():
    names = set(module_files())
    assert source_rules.string_references(PLANTED_REFERENCES, "paratrain.parallel.dims", names, layer_of) == [
        "2: names paratrain.plan.costing.time:chunk_time", "5: names paratrain.cli"]
    assert sorted(source_rules.private_reaches(PLANTED_REACHES), key=lambda s: int(s.split(":")[0])) == [
        "9: overrides ZeroRedundancyOptimizer._broadcast_params_from_rank",
        "21: patches stage._compute_outputs", "22: patches PipelineStage._compute_outputs",
        "23: patches torch.nn.Module._call_impl", "24: reads tracker._live", "25: reads x._hidden",
        "26: reads torch._C._get_tracing_state"]
    assert source_rules.collectives_outside_the_door(PLANTED_DOOR) == ["8: dist.all_reduce", "12: dist.batch_isend_irecv"]
