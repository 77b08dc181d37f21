"""Microbenchmarks for `paratrain plan --calibrate`, measured on this machine and backend.

Every rank measures at once (as ranks compete in training): matmul FLOP/s per dtype at several sizes,
memory bandwidth, per-op overhead (forward ops from Python, backward ops from the autograd engine), and
all-reduce / all-gather / reduce-scatter / broadcast / all-to-all / p2p at several sizes, fitted to
latency + bytes / bus bandwidth; plus how much of an all-reduce hides under a concurrent matmul loop.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from paratrain.calibrate.timing import agree_max, time_call, time_together

log = logging.getLogger("paratrain")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# square matmul sizes per device: a GPU reaches its plateau only from a few thousand (a curve that stops at
# 1024 prices an LLM's large matmuls at a tenth of what an H100 does)
MATMUL_SIZES = {"cpu": (64, 128, 256, 512, 1024), "cuda": (256, 512, 1024, 2048, 4096, 8192)}


def bench_matmul(device, sizes, budget_s: float) -> dict[str, list[list[float]]]:
    curves: dict[str, list[list[float]]] = {}
    for name, dtype in DTYPES.items():
        points = []
        for n in sizes:
            try:
                a = torch.randn(n, n, device=device).to(dtype)
                b = torch.randn(n, n, device=device).to(dtype)
                t = time_call(lambda a=a, b=b: torch.mm(a, b), device, budget_s)
            except RuntimeError:
                break
            points.append([2.0 * n ** 3, 2.0 * n ** 3 / t / 1e12])
        if points:
            curves[name] = points
    return curves


# bytes per copied tensor: past the last-level cache, and on a GPU large enough that one copy's ~20 us launch
# and timing overhead is noise (32 MiB on an H100, 50 MB of L2, read 1.2 TB/s where a big copy moves ~3 TB/s)
MEMORY_BYTES = {"cpu": 32 * 2**20, "cuda": 1024 * 2**20}


def bench_memory(device, budget_s: float) -> float:
    """Bytes read plus bytes written per second by a large device-to-device copy."""
    x = torch.empty(MEMORY_BYTES.get(torch.device(device).type, MEMORY_BYTES["cpu"]) // 4, device=device)
    y = torch.empty_like(x)
    t = time_call(lambda: y.copy_(x), device, budget_s)
    return 2 * x.numel() * 4 / t / 1e9


def bench_overheads(device, budget_s: float) -> dict[str, float]:
    """Seconds per forward op (Python -> dispatcher -> tiny kernel), per backward op, per view op."""
    x = torch.ones(8, device=device)
    n = 200

    def fwd():
        y = x
        for _ in range(n):
            y = y * 1.0001
        return y

    t_fwd = time_call(fwd, device, budget_s) / n
    leaf = torch.ones(8, device=device, requires_grad=True)

    def chain():
        y = leaf
        for _ in range(n):
            y = y * 1.0001
        return y.sum()

    def fwd_bwd():
        chain().backward()

    t_fb = time_call(fwd_bwd, device, budget_s)
    t_bwd = max(t_fb - time_call(chain, device, budget_s), 0.0) / n  # one mul backward per forward mul
    v = torch.ones(4, 8, device=device)
    t_view = time_call(lambda: [v.view(8, 4) for _ in range(n)], device, budget_s) / n
    return {"fwd": t_fwd * 1e6, "bwd": t_bwd * 1e6, "view": t_view * 1e6, "opt": t_fwd * 1e6}


def _collective(kind: str, nbytes: int, device, world: int):
    numel = max(world, nbytes // 4 // world * world)
    if kind == "all_reduce":
        t = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(t), numel * 4
    if kind == "all_gather":
        shard = torch.ones(numel // world, device=device)
        out = torch.empty(numel, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, shard), numel * 4
    if kind == "reduce_scatter":
        full = torch.ones(numel, device=device)
        out = torch.empty(numel // world, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, full), numel * 4
    if kind == "broadcast":
        t = torch.ones(numel, device=device)
        return lambda: dist.broadcast(t, src=0), numel * 4
    if kind == "all_to_all":
        t = torch.ones(numel, device=device)
        out = torch.empty_like(t)
        return lambda: dist.all_to_all_single(out, t), numel * 4
    # p2p: ring exchange (send to next, receive from previous), as the pipeline and ring attention do
    rank = dist.get_rank()
    send, recv = torch.ones(numel, device=device), torch.empty(numel, device=device)

    def exchange():
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    return exchange, numel * 4


def _fit(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least-squares t = a + b * wire_bytes over the measured sizes; a >= 0, b > 0."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    b = max(b, 1e-12)
    a = max(my - b * mx, 0.0)
    return {"latency_us": a * 1e6, "busbw_gbs": 1.0 / b / 1e9}


def _latency_between_compute(fn, device, budget_s: float) -> float:
    """Seconds one small collective adds to a loop that computes between calls, as training does. Ranks drift
    apart while they compute, and (on CPU) the backend's threads compete with the compute for cores; a
    collective-only loop sees neither, so it under-states the per-call cost that training pays."""
    a = torch.randn(256, 256, device=device)

    def compute():
        for _ in range(4):
            torch.mm(a, a)

    def both():
        compute()
        fn()

    samples = []
    for _ in range(3):
        t_both = agree_max(time_together(both, device, budget_s), device)
        t_compute = agree_max(time_together(compute, device, budget_s), device)
        samples.append(t_both - t_compute)
    return max(sorted(samples)[1], 0.0)


def bench_collectives(device, sizes, budget_s: float) -> dict[str, dict[str, float]]:
    from paratrain.costs.collectives import WIRE_FACTOR

    world = dist.get_world_size()
    out = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p"):
        points = []
        try:
            for size in sizes:
                fn, payload = _collective(kind, size, device, world)
                dist.barrier()
                t = agree_max(time_together(fn, device, budget_s), device)
                points.append((payload * WIRE_FACTOR[kind](world), t))
            small, _ = _collective(kind, 4096, device, world)
            between = _latency_between_compute(small, device, budget_s)
        except (RuntimeError, NotImplementedError) as exc:  # e.g. a backend without this collective
            log.warning("calibrate: %s not measured (%s)", kind, str(exc).splitlines()[0])
            continue
        fit = _fit(points)
        # the per-call latency is the larger of the fitted intercept and the cost measured between compute
        fit["latency_us"] = max(fit["latency_us"], between * 1e6)
        out[kind] = {**fit, "points": [[x, y] for x, y in points], "world": world,
                     "latency_between_compute_us": between * 1e6}
    return out


def bench_overlap(device, budget_s: float) -> float:
    """Fraction of an all-reduce that hides under a concurrent matmul loop (0: none, 1: all)."""
    a = torch.randn(256, 256, device=device)
    buf = torch.ones(4 * 2**20 // 4, device=device)

    def compute():
        for _ in range(8):
            torch.mm(a, a)

    def comm():
        dist.all_reduce(buf)

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    t_c = agree_max(time_together(compute, device, budget_s), device)
    t_m = agree_max(time_together(comm, device, budget_s), device)
    t_b = agree_max(time_together(both, device, budget_s), device)
    hidden = (t_c + t_m - t_b) / max(min(t_c, t_m), 1e-9)
    return float(min(max(hidden, 0.0), 1.0))
