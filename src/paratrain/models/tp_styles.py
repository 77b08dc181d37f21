"""ParallelStyles that model plans use beyond torch's own (ColwiseParallel, RowwiseParallel, ...)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every tp rank, its parameters held as Replicate DTensors.

    For layers between the sharded ones (e.g. norms without sequence parallel): every parameter then is a
    DTensor on the same mesh, which foreach optimizers, grad-norm clipping and FSDP's 2-D sharding need.
    Costs no communication: inputs are wrapped as Replicate, outputs handed back as local tensors.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        # no partition_fn: distribute_module replicates every parameter (broadcast from tp rank 0)
        return distribute_module(module, device_mesh, input_fn=_inputs_as_replicate, output_fn=_output_as_local)


def _inputs_as_replicate(module: nn.Module, inputs: tuple, mesh) -> tuple:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)


def _output_as_local(module: nn.Module, output, mesh):
    return output.to_local() if isinstance(output, DTensor) else output
