"""Traces cached on disk by what they depend on: the block shape and layout options, torch's version and the
source of the code they trace. JSON only (never pickle); a file that does not read back is traced again.

Where: $PARATRAIN_CACHE/traces, else $XDG_CACHE_HOME/paratrain/traces, else ~/.cache/paratrain/traces (never
inside the repository). PARATRAIN_TRACE_CACHE=0 turns the disk cache off.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

FORMAT = "paratrain-trace/1"
# the code a trace runs: a change in any of these files makes every cached trace stale
_TRACED_MODULES = ("paratrain.models", "paratrain.plan.tracing.local_model", "paratrain.plan.tracing.units",
                   "paratrain.plan.tracing.trace", "paratrain.plan.tracing.tracker", "paratrain.parallel.cp.ring_attention",
                   "paratrain.parallel.cp.ulysses", "paratrain.parallel.cp.cp_comm",
                   "paratrain.parallel.activation_checkpoint", "paratrain.train.step", "paratrain.train.optim",
                   "paratrain.plan.tracing.moe_trace", "paratrain.costs.expert_spread",
                   "paratrain.plan.tracing.lora_trace")


def cache_dir() -> Path:
    base = os.environ.get("PARATRAIN_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "paratrain")
    return Path(base) / "traces"


def enabled() -> bool:
    return os.environ.get("PARATRAIN_TRACE_CACHE", "1") not in ("0", "off", "false")


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """torch's version and a hash of the traced code's source files (found, not imported: a plan answered from
    the cache never imports torch or the traced code)."""
    import importlib.metadata
    import importlib.util

    h = hashlib.sha256(importlib.metadata.version("torch").encode())
    for name in _TRACED_MODULES:
        paths = [Path(importlib.util.find_spec(name).origin)]
        if paths[0].name == "__init__.py":
            paths = sorted(paths[0].parent.glob("*.py"))
        for p in paths:
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _plain(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    return x


def cached(kind: str, key, build: Callable[[], object], decode: Callable[[dict], object]):
    """build() unless a valid file for (kind, key, code version) exists; store what build() returns."""
    if not enabled():
        return build()
    key_doc = {"kind": kind, "key": _plain(key), "code": code_version()}
    digest = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:32]
    path = cache_dir() / f"{kind}-{digest}.json"
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") == FORMAT and doc.get("key") == key_doc:
            return decode(doc["value"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # absent, unreadable or from another version: trace again
    value = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"format": FORMAT, "key": key_doc, "value": _plain(value)}, f)
        os.replace(f.name, path)
    except OSError:
        pass  # a read-only cache directory costs speed, not correctness
    return value
