"""`plan --calibrate`, last part: fit the step-time model's free costs to measured reference training steps.

Microbenchmarks price ops and collectives one at a time. A real step also pays what they do not show: how
much slower ops run inside a model than alone (allocation, autograd, caches: `compute_scale`), DDP's bucket
copies and contention per MiB of gradients (`ddp_us_per_mib`), FSDP inside a model rather than a toy stack
(`fsdp_scale`, `fsdp_bwd_scale`), DTensor's dispatch per op under TP (`dtensor_op`), sequence parallelism's
redistribution per all-gather / reduce-scatter (`sp_call`), context parallelism's Python and waiting per
collective call (`cp_p2p_call`, `cp_all_to_all_call`), and the pipeline runtime per micro-batch per stage
(`pp_microbatch`). They are fitted so the planner reproduces measured steps
of a small reference transformer under each strategy; every prediction is linear in them, so that is a
(non-negative) least-squares solve.

The reference is deliberately none of the presets (other width, depth, vocabulary and sequence length), so a
plan for any model is a prediction, not a replay of the fit. It keeps the `small` preset's head layout (8 query
heads sharing 4 key/value heads), the Llama family's usual grouped-query shape.
"""

from __future__ import annotations

import statistics

REFERENCE = {"model": "small", "dim": 192, "n_layers": 2, "ffn_dim": 512, "vocab_size": 2048, "seq_len": 96,
             "global_batch": 8, "micro_batch": 2, "dtype": "fp32"}

# (name, overrides, the cost it fits), fitted in this order. The single-device ones run on every rank at once
# (as ranks share the machine in training) and fit compute_scale (two sizes: also overhead_scale); the others
# use the whole world. Costs are in microseconds (per op, call, micro-batch or MiB); fsdp_scale multiplies
# the FSDP gather and reduce-scatter costs host_bench.bench_fsdp measured, fsdp_bwd_scale its backward
# re-gather (ZeRO-3). The framework costs are fitted jointly (fit_profile);
# a cost two references name is fitted to both (least squares).
WIDE = {"dim": 384, "ffn_dim": 1024, "seq_len": 128}
# the strategy references are 4 blocks deep: per-block costs (a collective per block and pass) must outweigh
# the embedding, head and optimizer there, as they do in real models, or a fit mistakes one for the other
DEEP = {**WIDE, "n_layers": 4}
FITS = [("single", {"strategy": "single"}, "compute_scale"),
        ("single-wide", {"strategy": "single", **WIDE}, "compute_scale"),
        ("ddp", {"strategy": "ddp", **DEEP}, "ddp_us_per_mib"),
        ("zero2", {"strategy": "zero2", **DEEP}, "fsdp_scale"),
        ("zero3", {"strategy": "zero3", **DEEP}, "fsdp_bwd_scale"),
        ("tp", {"strategy": "tp", **DEEP}, "dtensor_op"),
        ("tp-sp", {"strategy": "tp-sp", **DEEP}, "sp_call"),
        ("cp-ring", {"strategy": "cp-ring", **DEEP}, "cp_p2p_call"),
        ("cp-ulysses", {"strategy": "cp-ulysses", **DEEP}, "cp_all_to_all_call"),
        ("pp", {"strategy": "pp", "pp_schedule": "1f1b", **DEEP}, "pp_microbatch")]


def _single(name: str) -> bool:
    """The reference runs on one device (its strategy does), on every rank at once."""
    from paratrain.parallel.strategies import runs_on_one_device

    return runs_on_one_device(next(o for n, o, _ in FITS if n == name)["strategy"])


def reference_config(name: str, world: int, device: str):
    from paratrain.config import TrainConfig

    overrides = next(o for n, o, _ in FITS if n == name)
    fields = {**REFERENCE, **overrides, "device": device, "nproc": 1 if _single(name) else world,
              "resume": "never", "ckpt_every": 0, "metrics": False, "steps": 1000, "timeout_s": 120}
    return TrainConfig(**fields)


def measure_references(rt, rounds: int = 9, warmup: int = 2) -> dict[str, float]:
    """Median step seconds of each reference (the slowest rank's), measured in interleaved rounds in this
    process group, as benchmarks/planner_accuracy.py measures the configs it checks."""
    from paratrain.calibrate.harness import interleaved_step_times
    from paratrain.errors import UserError
    from paratrain.parallel.strategies import resolve_layout
    from paratrain.train.trainer import Trainer

    names, trainers = [], []
    for name, _, _ in FITS:
        if not _single(name) and rt.world_size == 1:
            continue
        cfg = reference_config(name, rt.world_size, rt.device_type)
        try:
            layout = resolve_layout(cfg, 1 if _single(name) else rt.world_size)
            trainers.append(Trainer(cfg, rt, None, quiet=True, layout=layout))
        except UserError:
            continue  # e.g. a strategy this world size cannot run
        names.append(name)
    times = interleaved_step_times(trainers, rt, rounds, warmup)
    del trainers
    return {name: statistics.median(t) for name, t in zip(names, times)}


def _predict(profile, name: str, world: int, device_type: str) -> float:
    from paratrain.models.presets import model_args_for
    from paratrain.parallel.strategies import resolve_layout
    from paratrain.plan.costing.time import estimate_time

    cfg = reference_config(name, world, device_type)
    layout = resolve_layout(cfg, 1 if _single(name) else world)
    return estimate_time(profile, model_args_for(cfg), layout, cfg.seq_len, cfg.dtype, device_type).step_s


def fit_profile(profile, measured: dict[str, float], world: int, device_type: str) -> None:
    """Set the fitted costs on `profile` (in place) and note them: compute first (fit_compute), then every
    framework cost at once, since a strategy may pay several (CP also runs DDP over its dp x cp group):
    non-negative least squares of measured - predicted over the references."""
    import numpy as np

    fit_compute(profile, measured, world, device_type)
    refs = [(n, p) for n, _, p in FITS if n in measured and p != "compute_scale"]
    if not refs:
        return
    params = list(dict.fromkeys(p for _, p in refs))
    for p in params:
        profile.framework_us[p] = 0.0

    def predict_all(values: dict[str, float]) -> np.ndarray:
        saved = dict(profile.framework_us)
        profile.framework_us.update(values)
        try:
            return np.array([_predict(profile, n, world, device_type) for n, _ in refs])
        finally:
            profile.framework_us.clear()
            profile.framework_us.update(saved)

    base = predict_all({})
    slopes = np.stack([predict_all({p: 1.0}) - base for p in params], axis=1)  # per unit of each cost
    target = np.array([measured[n] for n, _ in refs]) - base
    values = _nonnegative_lstsq(slopes, target)
    profile.framework_us.update(dict(zip(params, values.tolist())))
    fitted = predict_all({})
    for k, (name, param) in enumerate(refs):
        profile.notes.append(f"fit: reference step ({name}) measured {measured[name] * 1e3:.1f} ms, "
                             f"{base[k] * 1e3:.1f} ms without the fitted costs, {fitted[k] * 1e3:.1f} ms with: "
                             f"{param} = {profile.framework_us[param]:.3g}")


def _nonnegative_lstsq(a, b):
    """argmin |a x - b| subject to x >= 0, by active sets: solve on the free columns, pin the most negative
    one at zero, repeat (the systems here are small and nearly diagonal)."""
    import numpy as np

    free = [j for j in range(a.shape[1]) if np.any(a[:, j] > 0)]
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (sol >= 0).all():
            x[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return x


def fit_compute(profile, measured: dict[str, float], world: int, device_type: str) -> None:
    """compute_scale (and on CPU overhead_scale) from the single-device references. With two sizes on a
    host-synchronous device, solve measured_i = a * work_i + b * overhead_i (work: roofline time of the ops,
    overhead: their per-op cost), since bigger ops and more ops are mispriced by different factors; otherwise
    (or if that solution is not positive) one factor for both, from the first reference."""
    names = [n for n, _, p in FITS if p == "compute_scale" and n in measured]
    if not names:
        return

    def predict(name: str, a: float, b: float | None) -> float:
        profile.compute_scale, profile.overhead_scale = a, b
        return _predict(profile, name, world, device_type)

    if len(names) >= 2 and not profile.overhead_overlaps:
        rows = []
        for name in names[:2]:
            rest = predict(name, 0.0, 0.0)
            rows.append((predict(name, 1.0, 0.0) - rest, predict(name, 0.0, 1.0) - rest, measured[name] - rest))
        import numpy as np

        rows = np.array(rows)
        a, b = _nonnegative_lstsq(rows[:, :2], rows[:, 2]).tolist()
        if a > 0 and b > 0:
            profile.compute_scale, profile.overhead_scale = a, b
            profile.notes.append(
                "fit: reference steps " + ", ".join(f"{n} {measured[n] * 1e3:.1f} ms" for n in names[:2])
                + f": op work scaled by {a:.2f}, per-op overhead by {b:.2f}")
            return
    name = names[0]
    predicted = predict(name, 1.0, None)
    profile.compute_scale, profile.overhead_scale = (measured[name] / predicted if predicted > 0 else 1.0), None
    profile.notes.append(f"fit: reference step ({name}) measured {measured[name] * 1e3:.1f} ms vs "
                         f"{predicted * 1e3:.1f} ms op by op: compute scaled by {profile.compute_scale:.2f}")
