"""`paratrain env`: what a bug report needs to know about this machine."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

# Libraries a run may use besides torch: their versions, read from the installed metadata (no import).
OPTIONAL_PACKAGES = ("transformers", "tokenizers", "safetensors", "datasets", "torchao", "accelerate")


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def collect_env() -> dict:
    import numpy
    import torch
    import torch.distributed as dist

    import paratrain

    report = {
        "paratrain": paratrain.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        **{package: installed_version(package) for package in OPTIONAL_PACKAGES},
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    if torch.cuda.is_available():
        from paratrain.gpu_catalog import catalog_name_for

        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        report.update(devices=names, catalog_gpu=catalog_name_for(names[0]),
                      nccl_version=".".join(map(str, torch.cuda.nccl.version())))
        if torch.cuda.device_count() > 1:
            report["p2p_access"] = {f"{i}->{j}": torch.cuda.can_device_access_peer(i, j)
                                    for i in range(len(names)) for j in range(len(names)) if i != j}
    return report
