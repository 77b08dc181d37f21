"""What every launcher shares: the job description, the torchrun command line, and a small YAML writer.

Generated jobs run `python -m torch.distributed.run ... -m paratrain.cli train --config FILE --out DIR`
on every node, with the run's resolved config embedded in the job, so the cluster trains exactly what
`paratrain train` would train here (see docs/launch.md). The degrees the run sets are also written on that
line, as each dimension renders itself (parallel/dims.py: `--tp 2`), so the job shows its layout.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from paratrain.errors import UserError
from paratrain.launchers.resources import NodeResources

CONFIG_ENV = "PARATRAIN_CONFIG_TOML"
# the config file a job writes: a fresh private file per job (mktemp), never a fixed /tmp name
CONFIG_FILE_LINES = ['CONFIG_FILE="$(mktemp -t paratrain-config.XXXXXXXX)"',
                     f'printf \'%s\\n\' "${CONFIG_ENV}" > "$CONFIG_FILE"']
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
    degree_flags: tuple[str, ...] = ()  # the degrees the config sets, as train flags (repeats the config)
    resources: NodeResources | None = None  # what each node asks for (None: gpus_per_node whole GPUs)

    def node(self, target: str) -> NodeResources:
        from paratrain.launchers.resources import node_resources

        return self.resources or node_resources(target, "cuda", self.gpus_per_node)

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


def scale_default_batch(cfg, world_size: int, given: bool):
    """The default global batch (16) rarely divides over a cluster's data-parallel ranks: when the user did not
    set one, round it up to the next size that does (logged); a batch the user set is kept as given."""
    import logging
    import math

    from paratrain.parallel.strategies import given_degrees, resolve_degrees

    if given or cfg.strategy == "auto":
        return cfg
    degrees = resolve_degrees(cfg.strategy, world_size, given_degrees(cfg))
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    per_rank = math.ceil(cfg.global_batch / dp)
    step = math.lcm(cfg.micro_batch or 1, cfg.microbatches or 1)
    per_rank = math.ceil(per_rank / step) * step
    if per_rank * dp == cfg.global_batch:
        return cfg
    logging.getLogger("paratrain").info(
        "launch: the default global batch %d does not divide over %d data-parallel ranks; using %d (%d per rank). "
        "Set --global-batch to choose.", cfg.global_batch, dp, per_rank * dp, per_rank)
    return cfg.model_copy(update={"global_batch": per_rank * dp})


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


def degree_flags(cfg) -> tuple[str, ...]:
    """The degrees a run config sets, as `paratrain train` flags, each as its dimension renders it."""
    from paratrain.parallel.dims import all_dims

    return tuple(arg for d in all_dims() if getattr(cfg, d.name) is not None for arg in d.render(getattr(cfg, d.name)))


def train_args(job: JobSpec, config_path: str, out: str) -> list[str]:
    return ["-m", "paratrain.cli", "train", "--config", config_path, "--out", out, *job.degree_flags]


class ShellWord(str):
    """A shell word we wrote ourselves, e.g. '"$HEAD_NODE:$PORT"': the only kind shell_join leaves unquoted.
    Never build one from a user's value."""


def shell_join(args: list[str]) -> str:
    """Join for a shell: every argument is quoted, except our own ShellWords (which expand our variables)."""
    return " ".join(a if isinstance(a, ShellWord) else shlex.quote(a) for a in args)


# values that reach a shell line, a #SBATCH directive or a YAML scalar unquoted by their consumer
_PATTERNS = {
    "--partition": r"[A-Za-z0-9][A-Za-z0-9_.,:@+-]*",
    "--account": r"[A-Za-z0-9][A-Za-z0-9_.,:@+-]*",
    "--time": r"\d+(-\d+)?(:\d+){0,2}|UNLIMITED|INFINITE|unlimited|infinite",
    "--image": r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*",
    "--namespace": r"[a-z0-9]([-a-z0-9]*[a-z0-9])?",
    "--accelerator": r"[A-Za-z0-9][A-Za-z0-9._-]*",
    "--cloud": r"[A-Za-z0-9][A-Za-z0-9._-]*",
    "--queue": r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]",  # a label value
}


def check_launch_values(cfg, values: dict[str, str | None]) -> None:
    """UserError for a launch option that does not look like what it names, or a config string with a
    control or line-break character (it would end a shell or YAML line)."""
    from paratrain.config import check_text

    for flag, value in values.items():
        if value is not None and not re.fullmatch(_PATTERNS[flag], value):
            raise UserError(f"{flag} {value!r} is not a valid value (expected {_PATTERNS[flag]})")
    for key, value in cfg.model_dump().items():
        if isinstance(value, str):
            check_text(f"config value {key}", value)


# -- YAML ----------------------------------------------------------------------------------------------
def _scalar(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid YAML double-quoted scalar


# YAML breaks lines at these too (and \r), so a literal block holding one would be cut there
_YAML_BREAKS = ("\r", "\x85", "\u2028", "\u2029")


def _block_ok(text: str) -> bool:
    """Readable as a literal block (|): several lines, no leading blank, no trailing spaces or tabs, no
    control or line-break character other than "\n" (else a JSON-escaped double-quoted scalar is written)."""
    return (
        "\n" in text.rstrip("\n")
        and not any(c in text for c in _YAML_BREAKS)
        and all(c == "\n" or c.isprintable() for c in text)
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
