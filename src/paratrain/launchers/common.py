"""What every launcher shares: the job description, the torchrun command line, and a small YAML writer.

Generated jobs run `python -m torch.distributed.run ... -m paratrain.cli train --config FILE --out DIR`
on every node, with the run's resolved config embedded in the job, so the cluster trains exactly what
`paratrain train` would train here (see docs/launch.md).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from paratrain.errors import UserError

CONFIG_ENV = "PARATRAIN_CONFIG_TOML"
CONFIG_PATH = "/tmp/paratrain-config.toml"
DEFAULT_IMAGE = "paratrain:latest"
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class JobSpec:
    name: str
    nodes: int
    gpus_per_node: int
    config_toml: str
    max_restarts: int = 3
    port: int = 29500
    image: str = DEFAULT_IMAGE
    out: str | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def check_job(nodes: int, gpus_per_node: int, name: str, port: int) -> None:
    if nodes < 1:
        raise UserError(f"--nodes must be at least 1, got {nodes}")
    if gpus_per_node < 1:
        raise UserError(f"--gpus-per-node must be at least 1, got {gpus_per_node}")
    if not NAME.match(name) or len(name) > 63:
        raise UserError(
            f"job name {name!r} must be lowercase letters, digits and '-' (at most 63), "
            "as Kubernetes requires"
        )
    if not 1 <= port <= 65535:
        raise UserError(f"--port must be 1..65535, got {port}")


def validate_for_cluster(cfg, world_size: int):
    """The same checks as `paratrain train`, for the cluster's world size; the device and a data path
    belong to the cluster, so they are not checked here."""
    from paratrain.train.validate import validate_run

    if cfg.strategy == "auto":
        raise UserError(
            "--strategy auto is resolved where it trains; pick one (`paratrain plan` suggests one)"
        )
    data = cfg.data if cfg.data == "synthetic" else "synthetic"
    return validate_run(cfg.model_copy(update={"device": "cpu", "data": data}), world_size)


def torchrun_args(nodes: int, gpus_per_node: int, max_restarts: int) -> list[str]:
    return [
        "python",
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc-per-node={gpus_per_node}",
        f"--max-restarts={max_restarts}",
    ]


def train_args(config_path: str, out: str) -> list[str]:
    return ["-m", "paratrain.cli", "train", "--config", config_path, "--out", out]


def shell_join(args: list[str]) -> str:
    """Join for a shell: arguments holding "$" are written shell-ready by us and kept, the rest quoted."""
    return " ".join(a if "$" in a else shlex.quote(a) for a in args)


# -- YAML ----------------------------------------------------------------------------------------------
def _scalar(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid YAML double-quoted scalar


def _block_ok(text: str) -> bool:
    """Readable as a literal block (|): several lines, no leading blank, no trailing spaces or tabs."""
    return (
        "\n" in text.rstrip("\n")
        and not text[:1].isspace()
        and not text.endswith("\n\n")
        and "\t" not in text
        and "\r" not in text
        and all(ln == ln.rstrip() for ln in text.split("\n"))
    )


def _block(head: str, text: str, pad: str, out: list[str]) -> None:
    out.append(f"{head} |{'' if text.endswith(chr(10)) else '-'}")
    out.extend(f"{pad}  {ln}" if ln else "" for ln in text.rstrip("\n").split("\n"))


def _inline(value) -> str:
    if isinstance(value, dict | list):
        return "{}" if isinstance(value, dict) else "[]"  # only empty ones are written inline
    return _scalar(value)


def _emit(value, indent: int, out: list[str], first_prefix: str) -> None:
    """Write a non-empty dict or list; the first line starts with first_prefix (e.g. "  - ")."""
    pad = " " * indent
    if isinstance(value, dict):
        for i, (key, item) in enumerate(value.items()):
            head = f"{first_prefix if i == 0 else pad}{key}:"
            if isinstance(item, dict | list) and item:
                out.append(head)
                _emit(item, indent + 2, out, " " * (indent + 2))
            elif isinstance(item, str) and _block_ok(item):
                _block(head, item, pad, out)
            else:
                out.append(f"{head} {_inline(item)}")
        return
    for item in value:
        if isinstance(item, dict) and item:
            _emit(item, indent + 2, out, f"{pad}- ")
        elif isinstance(item, str) and _block_ok(item):
            _block(f"{pad}-", item, pad, out)
        else:
            out.append(f"{pad}- {_inline(item)}")


def to_yaml(*documents: dict) -> str:
    """Block-style YAML for plain dicts/lists/scalars; several documents are separated by '---'."""
    parts = []
    for doc in documents:
        lines: list[str] = []
        _emit(doc, 0, lines, "")
        parts.append("\n".join(lines) + "\n")
    return "---\n".join(parts)
