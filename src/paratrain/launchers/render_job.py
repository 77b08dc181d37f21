"""Turn `paratrain launch TARGET [train options]` into the job text for that target."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.errors import UserError
from paratrain.launchers.common import (
    DEFAULT_IMAGE,
    JobSpec,
    check_job,
    check_launch_values,
    degree_flags,
    scale_default_batch,
    validate_for_cluster,
)
from paratrain.launchers.resources import node_resources

TARGETS = ("slurm", "k8s", "skypilot")
K8S_APIS = ("trainjob", "pytorchjob")


@dataclass(frozen=True)
class LaunchOptions:
    nodes: int = 1
    gpus_per_node: int = 8
    job_name: str | None = None
    max_restarts: int = 3
    port: int = 29500
    image: str = DEFAULT_IMAGE
    k8s_api: str = "trainjob"
    namespace: str | None = None
    partition: str | None = None
    account: str | None = None
    time_limit: str = "24:00:00"
    accelerator: str = "H100"
    cloud: str | None = None
    cpus_per_task: int | None = None
    mig: str | None = None
    gpu_share: str | None = None
    queue: str | None = None


def render_launch(target: str, cfg, opts: LaunchOptions, batch_given: bool = True) -> str:
    """Validate the run for nodes x gpus_per_node ranks, then render the job (UserError on bad input).

    `batch_given`: the user set the global batch; if not, the default is scaled to the cluster."""
    if target not in TARGETS:
        raise UserError(f"unknown launch target {target!r}; choose one of: {', '.join(TARGETS)}")
    if opts.k8s_api not in K8S_APIS:
        raise UserError(f"--k8s-api must be one of: {', '.join(K8S_APIS)}")
    if opts.max_restarts < 0:
        raise UserError(f"--max-restarts must be at least 0, got {opts.max_restarts}")
    if opts.queue is not None and target != "k8s":
        hint = " (Slurm: --partition)" if target == "slurm" else ""
        raise UserError(f"--queue is Kubernetes only (Kueue's LocalQueue){hint}")
    name = opts.job_name or f"paratrain-{cfg.strategy}"
    check_job(opts.nodes, opts.gpus_per_node, name, opts.port)
    check_launch_values(cfg, {"--partition": opts.partition, "--account": opts.account, "--time": opts.time_limit,
                              "--image": opts.image, "--namespace": opts.namespace,
                              "--accelerator": opts.accelerator, "--cloud": opts.cloud, "--queue": opts.queue})
    resources = node_resources(target, cfg.device, opts.gpus_per_node, opts.cpus_per_task, opts.mig, opts.gpu_share)
    cfg = scale_default_batch(cfg, opts.nodes * opts.gpus_per_node, batch_given)
    if target == "slurm" and cfg.preempt_signal is None:  # the job asks Slurm for it before its time limit
        cfg = cfg.model_copy(update={"preempt_signal": "USR1"})
    validate_for_cluster(cfg, opts.nodes * opts.gpus_per_node)
    job = JobSpec(
        name=name,
        nodes=opts.nodes,
        gpus_per_node=opts.gpus_per_node,
        config_toml=cfg.to_toml(),
        max_restarts=opts.max_restarts,
        port=opts.port,
        image=opts.image,
        out=cfg.out,
        degree_flags=degree_flags(cfg),
        resources=resources,
    )
    if target == "slurm":
        from paratrain.launchers.slurm import render_sbatch

        return render_sbatch(job, opts.partition, opts.account, opts.time_limit, cfg.preempt_signal)
    if target == "k8s":
        from paratrain.launchers.kubernetes import render_pytorchjob, render_trainjob

        return (render_trainjob if opts.k8s_api == "trainjob" else render_pytorchjob)(job, opts.namespace, opts.queue)
    from paratrain.launchers.skypilot import render_skypilot

    return render_skypilot(job, opts.accelerator, opts.cloud)
