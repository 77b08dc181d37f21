"""`paratrain bench`: measure strategies x world sizes, warm-up then measured steps, one process group each.

Weak scaling (default) keeps the batch per device fixed, so the global batch grows with the data-parallel
degree; strong scaling keeps the global batch fixed. Efficiency = tokens/s(N) / (N x tokens/s(1)), per
strategy (against its smallest measured world size when 1 is not in the list).
"""

from __future__ import annotations

import gc
import logging
import os
import statistics

import torch

from paratrain.errors import CheckFailed, UserError
from paratrain.parallel.layout import DEGREE_NAMES

log = logging.getLogger("paratrain")
PHASE_KEYS = ("data_wait", "forward", "backward", "optimizer", "loss_sync", "other")


def parse_list(text: str, what: str, cast=str) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UserError(f"--{what} needs at least one value")
    try:
        return [cast(t) for t in items]
    except ValueError:
        raise UserError(f"--{what} must be a comma-separated list, got {text!r}") from None


def bench_config(base, strategy: str, world: int, steps: int, warmup: int, scaling: str, per_device: int):
    """The run config of one (strategy, world size) cell, validated against that world size."""
    from paratrain.train.validate import validate_run

    cfg = base.model_copy(update={"strategy": strategy, "nproc": world, "steps": warmup + steps, "metrics": False,
                                  "resume": "never", "ckpt_every": 0, "out": None})
    from paratrain.parallel.strategies import given_degrees, resolve_degrees, runs_on_one_device

    if runs_on_one_device(strategy) and world != 1:
        raise UserError(f"strategy {strategy!r} runs on one device; drop it or use --nproc 1 (got {world})")
    if scaling == "weak":
        degrees = resolve_degrees(cfg.strategy, world, given_degrees(cfg))
        dp = degrees["dp_replicate"] * degrees["dp_shard"]
        cfg = cfg.model_copy(update={"global_batch": per_device * dp, "micro_batch": None})
    return cfg, validate_run(cfg, world)


def threads_per_rank(world: int) -> int:
    """OMP_NUM_THREADS when the user set it, else this machine's cores shared evenly by the ranks."""
    given = os.environ.get("OMP_NUM_THREADS")
    if given and given.isdigit() and int(given) > 0:
        return int(given)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // world)


def run_cell(cfg, world: int, warmup: int, steps: int) -> dict | None:
    """One process group of `world` fresh processes (one-process cells too: memory must not carry over)."""
    out = run_cells([cfg], world, warmup, steps)
    return out[0] if out else None


def run_cells(cfgs: list, world: int, warmup: int, steps: int, keep_going: bool = False) -> list | None:
    """Several cells of one world size, one after the other in one process group (the probe of `train --strategy
    auto --probe`: no start-up per layout). keep_going: a cell that fails gives {"error": ...} and the next runs."""
    args = ([c.model_dump() for c in cfgs], warmup, steps, threads_per_rank(world), keep_going)
    return run_fresh_group(measure_cells, args, world, cfgs[0].timeout_s, f"bench {cfgs[0].strategy}")


def run_fresh_group(entry, args: tuple, world: int, timeout_s: float, what: str):
    """entry(*args) on `world` fresh processes, rank 0's return value. One process too: memory must not carry
    over, and this process must not join a group (its environment would then say it runs under a launcher)."""
    if world > 1:
        from paratrain.train.launch import run_workers

        return run_workers(entry, args, world, 0, timeout_s).get(0)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "paratrain.train.trainer"])  # no effect once the server runs
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        try:
            return pool.submit(entry, *args).result()
        except SystemExit as exc:  # the worker printed its one-line error
            raise UserError(f"{what} on 1 process failed (exit {exc.code})") from None


def current_rss_gib() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return None


class RssPeak:
    """Peak resident set size of this process between start() and stop(), sampled every few ms.

    The process-lifetime peak (ru_maxrss) would carry over between the one-process cells bench runs
    inside its own process; this one belongs to a single cell.
    """

    def __init__(self, interval_s: float = 0.005):
        import threading

        self.interval_s, self.peak = interval_s, current_rss_gib()
        self.baseline = self.peak
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="paratrain-rss")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = current_rss_gib()
            if now is not None:
                self.peak = max(self.peak or 0.0, now)

    def start(self) -> RssPeak:
        if self.baseline is not None:
            self._thread.start()
        return self

    def stop(self) -> float | None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1)
        now = current_rss_gib()
        return max(self.peak or 0.0, now or 0.0) if self.peak is not None else None


def measure_cells(cfg_dicts: list[dict], warmup: int, steps: int, threads: int,
                  keep_going: bool = False) -> list | None:
    """Cells one after the other on every rank of one group; rank 0 returns their measurements."""
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.worker import setup_logging

    cfgs = [TrainConfig(**d) for d in cfg_dicts]
    setup_logging(int(os.environ.get("RANK", "0")))
    torch.set_num_threads(threads)
    rt = init_runtime(cfgs[0].device, cfgs[0].timeout_s)
    results = []
    for cfg in cfgs:
        try:
            results.append(measure_cell(cfg, rt, warmup, steps))
        except UserError as exc:
            if not keep_going:  # raised on: the launcher makes it the run's one last line (exit 2)
                shutdown()
                raise
            results.append({"error": str(exc)})
        # free the cell's trainer (DDP reducer, FSDP state) while the groups are registered: see train/worker.py
        gc.collect()
    shutdown()
    return results if rt.is_main else None


def measure_cell(cfg, rt, warmup: int, steps: int) -> dict:
    """Warm-up, then measured steps of one config: per-rank step and phase times, memory, collectives."""
    from paratrain.doctor.capture import gather_to_rank0
    from paratrain.doctor.timers import PHASES, PhaseTimer
    from paratrain.train.trainer import Trainer

    rss = RssPeak().start() if rt.device_type == "cpu" else None
    trainer = Trainer(cfg, rt, None, quiet=True)
    timer = PhaseTimer(rt.device_type)
    handles = timer.attach(trainer)
    rows, comm = [], {}
    counting = {}

    def on_step(t, record):
        step = record["step"]
        if step > warmup:
            rows.append({"step_time_s": record["step_time_s"], "data_wait_s": record["data_wait_s"],
                         **{f"{p}_s": timer.current.get(p, 0.0) for p in PHASES}})
        if step == warmup - 1:
            from paratrain.parallel.collective_bytes import count_collectives

            counting["ctx"] = count_collectives()
            counting["stats"] = counting["ctx"].__enter__()
        if step == warmup and "ctx" in counting:
            counting["ctx"].__exit__(None, None, None)
            comm.update(counting["stats"].per_step(1))

    trainer.fit(on_step=on_step)
    for h in handles:
        h.remove()
    from paratrain.parallel.model_states import model_state_bytes

    peak = rss.stop() if rss is not None else None
    local = {"memory_gib": peak if peak is not None else trainer.memory_gib(),
             "baseline_gib": rss.baseline if rss is not None and rss.baseline else 0.0, "rows": rows,
             "states": model_state_bytes(trainer.step_runner.model_parts, trainer.optimizers)}
    everyone = gather_to_rank0(local)
    return {"ranks": everyone, "comm": comm, "layout": trainer.layout.to_dict(),
            "tokens_per_step": trainer.tokens_per_step, "flops_per_step": trainer.flops_per_step,
            "peak_tflops": trainer.peak_tflops}


def slowest_rank_step_times(raw: dict) -> list[float]:
    """Per measured step of a cell, the slowest rank's step time (the step is as slow as it)."""
    ranks = raw["ranks"]
    return [max(r["rows"][i]["step_time_s"] for r in ranks) for i in range(len(ranks[0]["rows"]))]


def summarize_cell(strategy: str, world: int, cfg, raw: dict, predicted: dict | None) -> dict:
    ranks = raw["ranks"]
    # the step is as slow as its slowest rank; average that over the measured steps
    step_time = statistics.fmean(slowest_rank_step_times(raw))
    phases = {k: statistics.fmean(statistics.fmean(row.get(f"{k}_s", 0.0) for row in r["rows"]) for r in ranks)
              for k in PHASE_KEYS if k != "other"}
    phases["other"] = max(0.0, step_time - sum(phases.values()))
    states = ranks[0]["states"]
    tps = raw["tokens_per_step"] / step_time
    mfu = (raw["flops_per_step"] / step_time / (raw["peak_tflops"] * 1e12 * world)) if raw["peak_tflops"] else None
    comm = raw.get("comm") or {}
    return {"strategy": strategy, "world_size": world, "step_time_s": step_time, "tokens_per_s": tps,
            "scaling_efficiency": None,
            "predicted_step_time_s": (predicted or {}).get("step_time_s"),
            "peak_mem_gib": max(r["memory_gib"] for r in ranks),
            "baseline_mem_gib": max(r["baseline_gib"] for r in ranks),
            "predicted_mem_gib": (predicted or {}).get("mem_gib"),
            "comm_bytes_per_step": comm.get("total_bytes"),
            "predicted_comm_bytes_per_step": (predicted or {}).get("comm_bytes"),
            "peak_mem_above_baseline_gib": max(r["memory_gib"] - r["baseline_gib"] for r in ranks),
            "comm_wire_bytes_per_step": comm.get("total_wire_bytes"),
            "comm_bytes_by_op": comm.get("bytes_by_op"),
            "global_batch": cfg.global_batch, "seq_len": cfg.seq_len, "mfu": mfu,
            "dims": {n: raw["layout"][n] for n in DEGREE_NAMES},
            "layout": raw["layout"], "predicted_layout": (predicted or {}).get("layout_fields"),
            "model_state_gib": {k: states[k] / 2**30 for k in ("params", "grads", "optimizer")},
            "phases_s": phases}


def add_efficiency(runs: list[dict]) -> None:
    for strategy in {r["strategy"] for r in runs}:
        cells = sorted((r for r in runs if r["strategy"] == strategy), key=lambda r: r["world_size"])
        base = cells[0]
        for r in cells:
            ideal = base["tokens_per_s"] * r["world_size"] / base["world_size"]
            r["scaling_efficiency"] = r["tokens_per_s"] / ideal if ideal else None
            r["ideal_tokens_per_s"] = ideal


def run_bench(base, strategies: list[str], worlds: list[int], steps: int, warmup: int, scaling: str) -> dict:
    from paratrain.models.presets import model_args_for
    from paratrain.parallel.layout import Layout
    from paratrain.plan.predict import predict_layout
    from paratrain.train.runtime import in_launched_process, pick_device_type

    if in_launched_process():
        raise UserError("bench starts its own process groups; run it directly, not under torchrun/srun")
    if scaling not in ("weak", "strong"):
        raise UserError(f"--scaling must be weak or strong, got {scaling!r}")
    if steps < 1 or warmup < 2:
        raise UserError("bench needs --steps >= 1 and --warmup >= 2")
    per_device = base.micro_batch or max(1, base.global_batch // max(1, base.nproc))
    cells = [(s, n, *bench_config(base, s, n, steps, warmup, scaling, per_device))
             for s in strategies for n in sorted(set(worlds))]
    runs, predictions = [], []
    for strategy, world, cfg, _layout in cells:
        log.info("bench: %s on %d process(es), global batch %d, %d warm-up + %d measured steps", strategy, world,
                 cfg.global_batch, warmup, steps)
        raw = run_cell(cfg, world, warmup, steps)
        if raw is None:
            raise CheckFailed(f"bench {strategy} x {world}: rank 0 returned nothing")
        # predict for exactly the layout the workers ran
        predicted = predict_layout(Layout.from_dict(raw["layout"]), model_args_for(cfg), cfg.seq_len, cfg.device)
        predictions.append(predicted)
        runs.append(summarize_cell(strategy, world, cfg, raw, predicted))
    add_efficiency(runs)
    hardware = next((p["hardware"] for p in predictions if p), None)
    on_cpu = pick_device_type(base.device) == "cpu"
    return {"runs": runs, "plot": None, "scaling": scaling, "steps": steps, "warmup": warmup,
            "prediction_hardware": hardware,
            # the planner's own words for a profile nobody measured (plan/auto.py): say so wherever it shows
            "prediction_calibrated": None if hardware is None else "placeholder" not in hardware,
            "memory_measure": ("peak process RSS during the cell (activations, temporaries and the runtime "
                               "included); predicted: tensor bytes" if on_cpu else "allocator peak"),
            "model": base.model, "seq_len": base.seq_len, "per_device_batch": per_device if scaling == "weak" else None}


def markdown_table(doc: dict) -> str:
    pred = "pred. step ms" if doc.get("prediction_calibrated") is not False else "pred. step ms (UNCALIBRATED)"
    head = (f"| strategy | N | step ms | tokens/s | efficiency | {pred} | peak GiB | pred. GiB | comm MiB/step |\n"
            "|---|---|---|---|---|---|---|---|---|\n")

    def fmt(v, scale=1.0, spec=".1f"):
        return "-" if v is None else format(v * scale, spec)

    rows = [f"| {r['strategy']} | {r['world_size']} | {fmt(r['step_time_s'], 1e3)} | {fmt(r['tokens_per_s'], 1, '.0f')} "
            f"| {fmt(r['scaling_efficiency'], 100, '.0f')}% | {fmt(r['predicted_step_time_s'], 1e3)} "
            f"| {fmt(r['peak_mem_gib'], 1, '.3f')} | {fmt(r['predicted_mem_gib'], 1, '.3f')} "
            f"| {fmt(r['comm_bytes_per_step'], 1 / 2**20, '.2f')} |" for r in doc["runs"]]
    notes = [f"peak GiB: {doc['memory_measure']}"] if doc.get("memory_measure") else []
    if doc.get("prediction_calibrated") is False:
        notes.append(f"predictions: {doc['prediction_hardware']} -- `paratrain plan --calibrate` measures this machine")
    return head + "\n".join(rows) + "\n" + "".join(f"{n}\n" for n in notes)
