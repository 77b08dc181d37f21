"""ParallelStyles that model plans use beyond torch's own (ColwiseParallel, RowwiseParallel, ...)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every tp rank, its parameters held as Replicate DTensors.

    For layers between the sharded ones (e.g. norms without sequence parallel): every parameter then is a
    DTensor on the same mesh, which foreach optimizers, grad-norm clipping and FSDP's 2-D sharding need.
    Costs no communication: inputs are wrapped as Replicate, outputs handed back as local tensors.
    local_inputs: inputs stay local tensors (a module that reads its weights' local values itself, as MoE
    experts do).
    """

    def __init__(self, local_inputs: bool = False):
        super().__init__()
        self.local_inputs = local_inputs

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        # no partition_fn: distribute_module replicates every parameter (broadcast from tp rank 0)
        return distribute_module(module, device_mesh, input_fn=None if self.local_inputs else _inputs_as_replicate,
                                 output_fn=_output_as_local)


def _inputs_as_replicate(module: nn.Module, inputs: tuple, mesh) -> tuple:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)


def _output_as_local(module: nn.Module, output, mesh):
    return output.to_local() if isinstance(output, DTensor) else output


class VocabParallelEmbedding(RowwiseParallel):
    """A token table sharded by vocabulary rows (Shard(0)), looked up Megatron-style on the local rows.

    For a table the output head shares (tied embedding): DTensor's own embedding leaves the table's gradient
    Replicate (full size) while the head's arrives Shard(0), and autograd's in-place accumulation of a Shard(0)
    gradient into a Replicate one gives wrong values (torch 2.13). Looking up through `weight.to_local()` makes
    the gradient come back Shard(0) too, so both land on the one shard. The output is the all-reduced (or, with
    `output_layouts=Shard(1)`, reduce-scattered) sum of the ranks' masked lookups, handed on as a local tensor, or
    with `use_local_output=False` as a DTensor (a sequence-parallel residual stream that must keep global shapes).
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        weight = module.weight
        module.weight = nn.Parameter(distribute_tensor(weight.detach(), device_mesh, [Shard(0)]),
                                     requires_grad=weight.requires_grad)
        out_layout = self.output_layouts[0] if isinstance(self.output_layouts, tuple) else self.output_layouts

        def lookup(ids: torch.Tensor) -> torch.Tensor:
            local = module.weight.to_local()
            start = device_mesh.get_local_rank() * local.shape[0]
            shifted = ids - start
            outside = (shifted < 0) | (shifted >= local.shape[0])
            rows = F.embedding(shifted.masked_fill(outside, 0), local).masked_fill(outside.unsqueeze(-1), 0.0)
            summed = DTensor.from_local(rows, device_mesh, [Partial()], run_check=False)
            out = summed.redistribute(device_mesh, [out_layout])
            return out.to_local() if self.use_local_output else out

        module.forward = lookup
        return module


class TiedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for an output head whose weight is the token table: shard it as ColwiseParallel does
    (Shard(0), the vocabulary rows, the table's own layout), then point it back at the table's sharded
    parameter, which must already be distributed (the plan lists the embedding first)."""

    def __init__(self, table: nn.Module, **kwargs):
        super().__init__(**kwargs)
        self.table = table

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        out = super()._apply(module, device_mesh)
        if not isinstance(self.table.weight, DTensor):
            raise RuntimeError("tied head: the token table must be distributed before the head (plan order)")
        module.weight = self.table.weight
        return out
