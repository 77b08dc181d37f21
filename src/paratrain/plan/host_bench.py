"""Host-side microbenchmarks for `plan --calibrate`: DTensor and FSDP2 overheads beyond their collectives, and a
small reference network's training step, against which the op-level figures are scaled."""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.plan.calibrate import _collective_latency, _timeit, _timeit_together


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
    at its local shape, per op that runs on DTensors), and per parameter per FSDP2 gather or reduce."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
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
    t_local = _timeit_together(lambda: step(local), device, budget_s)
    t_tp = _timeit_together(lambda: step(tp), device, budget_s)
    # one all-reduce forward and one backward (the row-parallel output, the column-parallel input grad)
    comm = 2 * _collective_latency("all_reduce")
    dtensor_op = max(0.0, t_tp - t_local - comm) / max(counter.count, 1)

    blocks, per_block = 6, 4
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
    base = _timeit_together(lambda: fsdp_step(plain), device, budget_s)
    t_fsdp = _timeit_together(lambda: fsdp_step(sharded), device, budget_s)
    # ZeRO-3 per block and step: a gather for the forward, one for the backward, a reduce-scatter, each with
    # its collective's latency (charged by the collective model already)
    latency = sum(_collective_latency(k) for k in ("all_gather", "all_gather", "reduce_scatter"))
    params_per_block = 2 * (per_block // 2)
    fsdp_param = max(0.0, (t_fsdp - base) / blocks - latency) / (3 * params_per_block)
    return {"dtensor_op": dtensor_op * 1e6, "fsdp_param": fsdp_param * 1e6}


def _reference_model(device, width: int = 512, depth: int = 2):
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    model = nn.Sequential(*layers)
    return model if str(device) == "cpu" else model.to(device)


def _reference_step(model, opt, x):
    opt.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    opt.step()


def bench_reference(device, budget_s: float) -> float:
    """Seconds per training step of a small reference network (LayerNorm + GELU MLP, AdamW): the end-to-end
    check the op-level figures are scaled to (host overheads the microbenchmarks miss: modules, autograd)."""
    from paratrain.train.optim import build_optimizer

    model = _reference_model(device)
    opt = build_optimizer(list(model.parameters()), 1e-3, (0.9, 0.95), 0.0, device.type)
    x = torch.randn(2, 128, 512, device=device)
    return _timeit(lambda: _reference_step(model, opt, x), device, budget_s * 4)


def predict_reference(profile, device_type: str) -> float:
    """The same reference step, priced by the planner's op-level roofline (profile scale 1)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from paratrain.plan.local_model import CommLog
    from paratrain.plan.time import op_cost
    from paratrain.plan.trace import _recorder
    from paratrain.plan.tracker import LiveTensorTracker
    from paratrain.train.optim import build_optimizer

    ops: dict[str, list] = {"fwd": [], "bwd": [], "opt": []}
    state = {"phase": None}
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _reference_model("cpu")
        opt = build_optimizer(list(model.parameters()), 1e-3, (0.9, 0.95), 0.0, device_type)
        x = torch.randn(2, 128, 512)
        with LiveTensorTracker(op_hook=_recorder(ops, state, CommLog()), resync=False):
            _reference_step(model, opt, x)  # creates the optimizer state
            state["phase"] = "fwd"
            opt.zero_grad(set_to_none=True)
            loss = model(x).float().pow(2).mean()
            state["phase"] = "bwd"
            loss.backward()
            state["phase"] = "opt"
            opt.step()
    return sum(n * op_cost(profile, "fp32", phase)(k, f, b, d) for phase, items in ops.items()
               for k, f, b, n, d in items)
