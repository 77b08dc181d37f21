"""Host-side microbenchmarks for `plan --calibrate`: DTensor and FSDP2 overheads beyond their collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.calibrate.timing import agree_max, collective_latency, time_together


class _DTensorOpCounter:
    """Counts aten ops that run on DTensors (a dispatch mode sees them before DTensor's own dispatch)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                from torch.distributed.tensor import DTensor
                from torch.utils._pytree import tree_leaves

                if any(isinstance(x, DTensor) for x in tree_leaves((args, kwargs or {}))):
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count, self.mode = 0, Mode()


def bench_framework(device, budget_s: float) -> dict[str, float]:
    """Host overheads, beyond their collectives: per DTensor op (a tensor-parallel MLP against the same MLP
    at its local shape, per op that runs on DTensors), and FSDP2's (bench_fsdp on CPU, else per parameter).
    The reference fits (fit.py) replace dtensor_op wherever the TP reference can run."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    width, x = 64, torch.randn(4, 32, 64, device=device)

    def mlp(hidden: int):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)).to(device)

    def step(m):
        m(x).sum().backward()

    local = mlp(4 * width // world)
    tp = parallelize_module(mlp(4 * width), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    step(tp)
    counter = _DTensorOpCounter()
    with counter.mode:
        step(tp)
    t_local = time_together(lambda: step(local), device, budget_s)
    t_tp = time_together(lambda: step(tp), device, budget_s)
    # one all-reduce forward and one backward (the row-parallel output, the column-parallel input grad)
    comm = 2 * collective_latency("all_reduce")
    dtensor_op = max(0.0, t_tp - t_local - comm) / max(counter.count, 1)

    result = {"dtensor_op": dtensor_op * 1e6}
    # on CPU the planner uses FSDP2's measured per-group costs; elsewhere its per-parameter host overhead
    result.update(bench_fsdp(device, mesh, budget_s) if device.type == "cpu" else
                  {"fsdp_param": _fsdp_param_overhead(device, mesh, budget_s)})
    return result


def _fsdp_param_overhead(device, mesh, budget_s: float, blocks: int = 6, per_block: int = 4) -> float:
    """Microseconds of FSDP2 host work per parameter per gather or reduce-scatter, beyond the collectives'
    latency: a stack of tiny blocks, sharded per block, against the same stack unsharded."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    inp = torch.randn(4, 16, device=device)

    def stack():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(*[nn.Linear(16, 16) for _ in range(per_block // 2)])
                               for _ in range(blocks)]).to(device)

    def fsdp_step(m):
        m(inp).sum().backward()

    plain = stack()
    sharded = stack()
    for block in sharded:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    base = time_together(lambda: fsdp_step(plain), device, budget_s)
    t_fsdp = time_together(lambda: fsdp_step(sharded), device, budget_s)
    # ZeRO-3 per block and step: a gather for the forward, one for the backward, a reduce-scatter, each with
    # its collective's latency (charged by the collective model already)
    latency = sum(collective_latency(k) for k in ("all_gather", "all_gather", "reduce_scatter"))
    params_per_block = 2 * (per_block // 2)
    return max(0.0, (t_fsdp - base) / blocks - latency) / (3 * params_per_block) * 1e6


def bench_fsdp(device, mesh, budget_s: float, blocks: int = 4, widths: tuple[int, ...] = (128, 384)) -> dict:
    """FSDP2's whole cost per parameter group on a host-synchronous device (CPU), measured end to end: a stack
    of `blocks` MLP blocks, each its own fully_shard group, against the same stack unsharded, at two widths.
    On CPU nothing runs ahead of the host, so a group's gather, copies, waits and bookkeeping add to the step
    as they are; the planner charges a + b * MiB per group for (1) the forward all-gather, (2) the backward
    re-gather (ZeRO-3), (3) the gradient reduce-scatter. Returns those six coefficients (microseconds)."""
    points = [_fsdp_group_times(device, mesh, width, blocks, budget_s) for width in widths]
    out = {"fsdp_world": float(dist.get_world_size())}
    for i, name in enumerate(("fsdp_gather", "fsdp_bwd_gather", "fsdp_reduce_scatter"), start=1):
        (x0, y0), (x1, y1) = (points[0][0], points[0][i]), (points[-1][0], points[-1][i])
        slope = max((y1 - y0) / (x1 - x0), 0.0) if x1 > x0 else 0.0
        out[f"{name}_us"] = max(y0 - slope * x0, 0.0)
        out[f"{name}_us_per_mib"] = slope
    return out


def _fsdp_group_times(device, mesh, width: int, blocks: int, budget_s: float) -> tuple[float, float, float, float]:
    """(MiB per group, then microseconds per group of: forward gather, backward re-gather, reduce-scatter)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    def stack():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, 3 * width), nn.Linear(3 * width, width))
                               for _ in range(blocks)]).to(device)

    x = torch.randn(8, 32, width, device=device)
    plain, sharded = stack(), stack()
    for block in sharded:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    group_mib = sum(p.numel() * 4 for p in plain[0].parameters()) / 2**20

    def timed(fn):
        return agree_max(time_together(fn, device, 2 * budget_s), device)

    def fwd_bwd(m):
        m(x).sum().backward()

    t_fwd_plain, t_fb_plain = timed(lambda: plain(x)), timed(lambda: fwd_bwd(plain))
    t_fwd = timed(lambda: sharded(x))
    t_fb_sync = timed(lambda: fwd_bwd(sharded))
    sharded.set_requires_gradient_sync(False)
    t_fb_nosync = timed(lambda: fwd_bwd(sharded))
    sharded.set_requires_gradient_sync(True)
    gather = (t_fwd - t_fwd_plain) / blocks
    bwd_gather = ((t_fb_nosync - t_fwd) - (t_fb_plain - t_fwd_plain)) / blocks
    reduce_scatter = (t_fb_sync - t_fb_nosync) / blocks
    return group_mib, max(gather, 0.0) * 1e6, max(bwd_gather, 0.0) * 1e6, max(reduce_scatter, 0.0) * 1e6
