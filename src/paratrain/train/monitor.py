"""`train --monitor`: a breakdown every N steps from perf counters, alerts, and a Prometheus textfile.

Each window of `monitor_every` steps (from step 2: the first includes one-time setup) becomes one `{"event": "monitor", ...}` line in RUNDIR/metrics.jsonl:
fractions of the step spent waiting for data, in forward+backward, in the optimizer and in the loss sync,
plus throughput and each rank's own work per phase. A cause over its threshold for
`monitor_windows` consecutive windows raises one alert: a line on stderr and an `{"event": "alert"}` line.
No profiler runs: the timers read `time.perf_counter()` at phase boundaries (no CUDA sync), and the ranks
exchange one small tensor per window (each rank's seconds per phase) for the straggler check.

A rank's own work is its time from the step's start to its arrival at the loss all-reduce (forward+backward
and the optimizer), not its waits there: in a synchronous job the ranks leave each loss all-reduce together, so
a rank that arrives late by the same phase every step is the straggler, and the others' wait in the loss sync is
its doing, not the network's. So `loss_sync` is judged by the rank that waited least in it (the last to arrive),
and `straggler` names the rank and the phase where its time goes. A slowdown before DDP's gradient all-reduce
makes every rank leave backward together and is not seen this way (docs/monitoring.md). Each window also carries the monitor's own cost:
`monitor_s`, the seconds spent inside `observe` since the previous window (its bookkeeping, that window's
collective and writes), and `monitor_overhead`, that over the window's wall time.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.parallel.collective_device import collective_device
from paratrain.parallel.collective_hooks import collective

log = logging.getLogger("paratrain")

# cause -> (threshold, what the value is); a window over it counts towards an alert
THRESHOLDS = {
    "data_loading": 0.10,      # data wait / step time
    "loss_sync": 0.30,         # the blocking loss all-reduce / step time (the exposed collective we can time)
    "throughput_drop": 0.20,   # 1 - tokens/s / running median of earlier windows
    "straggler": 0.20,         # slowest rank's own work / the other ranks' median - 1
}
OWN_PHASES = ("forward_backward", "optimizer")  # before the step's loss all-reduce: each rank's own pace
# and the straggler's excess must be this share of the step too: tiny steps jitter by more than 20% on a busy host
STRAGGLER_MIN_SHARE = 0.15
HISTORY_FOR_DROP = 3  # windows before a throughput median means anything (the first ones include warm-up)
# Scrapers read the textfile every 15-60 s; rewriting it for every window (a file create and rename, 0.2-1 ms on
# rank 0 while its peers wait at the next collective) was most of the monitor's own time on 10 ms steps
PROM_FILE_EVERY_S = 5.0


class PhaseClock:
    """Seconds per phase per window on bare perf counters, fed by the trainer's on_phase hook (on_phase)."""

    def __init__(self):
        self.totals = {"forward_backward": 0.0, "optimizer": 0.0, "loss_sync": 0.0}
        self._t = 0.0

    def begin(self) -> None:
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self._t
        self._t = now

    def on_phase(self, phase: str) -> None:
        """The trainer's on_phase hook (train/hooks.py): "start", then each phase as it ends."""
        if phase == "start":
            self.begin()
        else:
            self.mark(phase)

    def take(self) -> dict:
        out, self.totals = self.totals, dict.fromkeys(self.totals, 0.0)
        return out


class Monitor:
    def __init__(self, every: int, windows: int, run_dir: Path | None, jsonl, is_main: bool, port: int | None = None):
        self.every, self.windows, self.is_main, self.jsonl = every, windows, is_main, jsonl
        self.clock = PhaseClock()
        self.rows: list[dict] = []
        self.throughputs: list[float] = []
        self.streak = dict.fromkeys(THRESHOLDS, 0)
        self.straggler_at: tuple | None = None  # (rank, phase) of the current straggler streak
        self.alerts: list[dict] = []
        self.prom_path = run_dir / "metrics.prom" if (run_dir and is_main) else None
        self.server = serve_prometheus(port, self) if (port is not None and is_main) else None
        self.latest_text = ""
        self.prom_written_at: float | None = None
        self.prom_alerts = 0  # alerts in the textfile as last written
        self.own_s = 0.0  # seconds inside observe() since the last window was cut
        self.window_t0: float | None = None

    def observe(self, record: dict) -> None:
        """Called after every step on every rank (the window's straggler exchange is a collective)."""
        t0 = time.perf_counter()
        try:
            self._observe(record, t0)
        finally:
            self.own_s += time.perf_counter() - t0

    def _observe(self, record: dict, t0: float) -> None:
        if record["step"] == 1:
            self.clock.take()  # the first step includes one-time setup and the loader's first batch
            self.window_t0 = time.perf_counter()
            return
        if self.window_t0 is None:  # resumed past step 1: the window starts where this step did
            self.window_t0 = t0 - record["step_time_s"]
        self.rows.append({"step_time_s": record["step_time_s"], "data_wait_s": record["data_wait_s"],
                          "tokens_per_s": record["tokens_per_s"], "mfu": record.get("mfu"), "step": record["step"]})
        if len(self.rows) < self.every:
            return
        phases = self.clock.take()
        rows, self.rows = self.rows, []
        step_s = sum(r["step_time_s"] for r in rows)
        busy = step_s - sum(r["data_wait_s"] for r in rows)
        per_rank_phases = gather_phases(busy, phases)
        per_rank = [row["busy"] for row in per_rank_phases]
        now = time.perf_counter()
        own, self.own_s = self.own_s + (now - t0), -(now - t0)  # the rest of this call counts towards the next
        wall, self.window_t0 = now - self.window_t0, now
        window = {"event": "monitor", "step": rows[-1]["step"], "steps": len(rows), "step_time_s": step_s / len(rows),
                  "breakdown": {"data_wait": sum(r["data_wait_s"] for r in rows) / step_s,
                                **{k: v / step_s for k, v in phases.items()}},
                  "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in rows),
                  "mfu": statistics.fmean(r["mfu"] for r in rows) if rows[0]["mfu"] is not None else None,
                  "busy_s_per_rank": per_rank,
                  "own_s_per_rank": [sum(row[p] for p in OWN_PHASES) for row in per_rank_phases],
                  "phase_s_per_rank": [{p: row[p] for p in phases} for row in per_rank_phases],
                  "monitor_s": own, "monitor_overhead": own / wall if wall > 0 else 0.0}
        if self.is_main:
            self.report(window)

    def report(self, window: dict) -> None:
        step_s = window["step_time_s"] * window["steps"]
        # the rank that waited least in the loss sync arrived last: its share is what the collective costs
        least_sync = min(row["loss_sync"] for row in window["phase_s_per_rank"])
        values = {"data_loading": window["breakdown"]["data_wait"], "loss_sync": least_sync / step_s if step_s else 0.0,
                  "throughput_drop": None, "straggler": None}
        if len(self.throughputs) >= HISTORY_FOR_DROP:
            values["throughput_drop"] = 1.0 - window["tokens_per_s"] / statistics.median(self.throughputs)
        self.throughputs.append(window["tokens_per_s"])
        window["straggler"] = straggler(window["own_s_per_rank"], window["phase_s_per_rank"], step_s)
        if window["straggler"] is not None:
            values["straggler"] = window["straggler"]["excess"]
        window["causes"] = values
        self.write(window)
        # a straggler is one rank losing its time in one phase, window after window: another rank or phase over
        # the threshold starts a new streak (a busy host's scheduling noise lands on whichever rank and phase)
        found = window.get("straggler") or {}
        slow_at = (found.get("rank"), found.get("phase"))
        if slow_at != self.straggler_at:
            self.streak["straggler"], self.straggler_at = 0, slow_at
        for cause, value in values.items():
            over = value is not None and value > THRESHOLDS[cause]
            self.streak[cause] = self.streak[cause] + 1 if over else 0
            if self.streak[cause] == self.windows:  # once per episode: it fires again after a healthy window
                self.alert(cause, value, window)
        self.write_prometheus(window)

    def alert(self, cause: str, value: float, window: dict) -> None:
        event = {"event": "alert", "cause": cause, "step": window["step"], "value": value,
                 "threshold": THRESHOLDS[cause], "windows": self.windows}
        who = ""
        if cause == "straggler":
            event["rank"], event["phase"] = window["straggler"]["rank"], window["straggler"]["phase"]
            who = f" rank {event['rank']} in {event['phase']},"
        self.alerts.append(event)
        self.write(event)
        print(f"paratrain: ALERT {cause}:{who} {value:.1%} (threshold {THRESHOLDS[cause]:.0%}) for {self.windows} "
              f"consecutive windows of {self.every} steps, at step {window['step']}", file=sys.stderr, flush=True)

    def write(self, event: dict) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(event) + "\n")
            self.jsonl.flush()

    def write_prometheus(self, window: dict) -> None:
        """The endpoint's text every window; the textfile at most every PROM_FILE_EVERY_S, at once on a new
        alert, and at close()."""
        self.latest_text = prometheus_text(window, self.alerts)
        now = time.monotonic()
        if self.prom_written_at is None or now - self.prom_written_at >= PROM_FILE_EVERY_S or \
                len(self.alerts) != self.prom_alerts:
            self.flush_prometheus()

    def flush_prometheus(self) -> None:
        if self.prom_path is None or not self.latest_text:
            return
        tmp = self.prom_path.with_suffix(".prom.tmp")
        tmp.write_text(self.latest_text)
        os.replace(tmp, self.prom_path)  # scrapers never see half a file
        self.prom_written_at, self.prom_alerts = time.monotonic(), len(self.alerts)

    def close(self) -> None:
        try:
            self.flush_prometheus()
        except OSError as err:  # close() runs in the trainer's finally: never mask the run's own error
            log.warning("monitor: could not write %s: %s", self.prom_path, err)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def gather_phases(busy: float, phases: dict[str, float]) -> list[dict[str, float]]:
    """Every rank's {"busy", phase: seconds} for the window, in one all-reduce."""
    names = ["busy", *phases]
    mine = [busy, *phases.values()]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [dict(zip(names, mine))]
    out = torch.zeros(dist.get_world_size(), len(names), dtype=torch.float64, device=collective_device())
    out[dist.get_rank()] = torch.tensor(mine, dtype=torch.float64)
    collective("monitor_phases", "world", "all_reduce", None, lambda: dist.all_reduce(out), (out,))
    return [dict(zip(names, row)) for row in out.tolist()]


def straggler(own: list[float], phases: list[dict[str, float]], step_s: float) -> dict | None:
    """The slowest rank's own work against the median of the others' (with two ranks: the other one's), and the
    phase that holds most of its excess; None with one rank or when its excess is a small part of the step."""
    if len(own) < 2:
        return None
    slow = max(range(len(own)), key=own.__getitem__)
    others = [v for i, v in enumerate(own) if i != slow]
    median = statistics.median(others)
    if median <= 0 or (step_s and (own[slow] - median) / step_s < STRAGGLER_MIN_SHARE):
        return {"rank": slow, "phase": None, "excess": 0.0}
    excess = {p: phases[slow][p] - statistics.median(phases[i][p] for i in range(len(own)) if i != slow)
              for p in OWN_PHASES}
    return {"rank": slow, "phase": max(excess, key=excess.get), "excess": own[slow] / median - 1.0}


def prometheus_text(window: dict, alerts: list[dict]) -> str:
    lines = []

    def gauge(name: str, help_text: str, value, labels: str = "") -> None:
        if value is None:
            return
        if not any(line.startswith(f"# HELP {name} ") for line in lines):
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} gauge")
        lines.append(f"{name}{labels} {float(value):.6g}")

    gauge("paratrain_step", "last step of the latest monitor window", window["step"])
    gauge("paratrain_step_time_seconds", "mean step time over the window", window["step_time_s"])
    gauge("paratrain_tokens_per_second", "mean tokens per second over the window", window["tokens_per_s"])
    gauge("paratrain_mfu", "model FLOPs utilization over the window", window["mfu"])
    for key, value in window["breakdown"].items():
        gauge("paratrain_step_fraction", "fraction of the step time per phase", value, f'{{phase="{key}"}}')
    for rank, busy in enumerate(window["busy_s_per_rank"]):
        gauge("paratrain_rank_busy_seconds", "seconds per window not waiting for data, per rank", busy,
              f'{{rank="{rank}"}}')
    for rank, own in enumerate(window.get("own_s_per_rank", [])):
        gauge("paratrain_rank_own_seconds", "seconds per window from each step's start to the rank's arrival at "
              "its loss all-reduce (its own work, not its waits there), per rank", own, f'{{rank="{rank}"}}')
    lines += ["# HELP paratrain_alerts_total alerts raised so far", "# TYPE paratrain_alerts_total counter"]
    for cause in THRESHOLDS:
        lines.append(f'paratrain_alerts_total{{cause="{cause}"}} {sum(a["cause"] == cause for a in alerts)}')
    return "\n".join(lines) + "\n"


def serve_prometheus(port: int, monitor: Monitor):
    """An HTTP endpoint for scrapers, bound to 127.0.0.1 only (a node exporter or agent on the host forwards)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = monitor.latest_text.encode()
            self.send_response(200 if self.path in ("/", "/metrics") else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # keep stderr for the run's own lines
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="paratrain-prometheus").start()
    log.info("monitor: Prometheus metrics on http://127.0.0.1:%d/metrics", server.server_address[1])
    return server
