"""What a job asks of each node: whole GPUs, MIG slices, shared GPUs (HAMi) or none (--device cpu), the CPUs
for its ranks, and the threads each rank runs. Every target renders the same NodeResources its own way."""

from __future__ import annotations

import re
from dataclasses import dataclass

from paratrain.errors import UserError

GPU_CPUS_PER_RANK = 8  # a GPU job's default CPUs (and threads) per rank, as before
_SHARE = re.compile(r"(\d+):(\d+)")


@dataclass(frozen=True)
class NodeResources:
    ranks: int  # processes per node (--gpus-per-node)
    cpu_only: bool  # --device cpu: no GPU request
    cpus: int | None  # CPUs per node asked for; None: not asked (a Kubernetes GPU job's default)
    threads: int  # OMP_NUM_THREADS per rank
    mig: str | None = None  # each rank one MIG slice of this profile
    gpu_mem_mib: int | None = None  # HAMi: each rank a shared GPU with this memory ...
    gpu_cores_pct: int | None = None  # ... and this percentage of its cores

    def k8s_limits(self) -> dict[str, str]:
        """The container's resource limits; quantities as strings, as the Kubernetes API returns them."""
        limits = {"cpu": str(self.cpus)} if self.cpus else {}
        if self.cpu_only:
            return limits
        limits[f"nvidia.com/mig-{self.mig}" if self.mig else "nvidia.com/gpu"] = str(self.ranks)
        if self.gpu_mem_mib is not None:
            limits["nvidia.com/gpumem"] = str(self.gpu_mem_mib)
            limits["nvidia.com/gpucores"] = str(self.gpu_cores_pct)
        return limits


def parse_gpu_share(value: str) -> tuple[int, int]:
    """'20000:50' -> (20000 MiB, 50 % of the cores)."""
    match = _SHARE.fullmatch(value)
    if not match or int(match[1]) < 1 or not 1 <= int(match[2]) <= 100:
        raise UserError(f"--gpu-share {value!r} must be MEM_MIB:CORES_PCT (memory in MiB >= 1, cores 1..100), "
                        "e.g. 20000:50")
    return int(match[1]), int(match[2])


def node_resources(target: str, device: str, ranks: int, cpus_per_task: int | None = None, mig: str | None = None,
                   gpu_share: str | None = None) -> NodeResources:
    """The request for one node of `ranks` processes; UserError for an option the target or device cannot take."""
    from paratrain.gpu_catalog import check_mig_profile

    cpu_only = device == "cpu"
    if cpu_only and (mig or gpu_share):
        raise UserError(f"{'--mig' if mig else '--gpu-share'} asks for GPUs; drop it or --device cpu")
    if mig and gpu_share:
        raise UserError("--mig and --gpu-share are two ways to split a GPU: give one")
    if mig and target == "skypilot":
        raise UserError("--mig is for slurm and k8s; SkyPilot names whole accelerators (--accelerator)")
    if gpu_share and target != "k8s":
        raise UserError("--gpu-share is Kubernetes only (HAMi's nvidia.com/gpumem and nvidia.com/gpucores)")
    if cpus_per_task is not None and cpus_per_task < ranks:
        raise UserError(f"--cpus-per-task {cpus_per_task} is fewer than the {ranks} ranks per node: "
                        "each rank needs a CPU")
    if cpus_per_task is not None:
        cpus = cpus_per_task
    elif cpu_only:
        cpus = ranks
    else:
        cpus = None if target == "k8s" else GPU_CPUS_PER_RANK * ranks
    threads = cpus // ranks if cpus else GPU_CPUS_PER_RANK
    mem, cores = parse_gpu_share(gpu_share) if gpu_share else (None, None)
    return NodeResources(ranks, cpu_only, cpus, threads, mig and check_mig_profile(mig), mem, cores)
