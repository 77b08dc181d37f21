"""paratrain's GPU suite: one command that measures the single-GPU step on a lent GPU and writes one table.

Each row is its own child process, most valuable first (benchmarks/gpu_suite_rows.py): first issue 47's
speed flags, each alone and then all together, on gpt2-124m compiled bf16 at micro-batch 16 and 32 against the
same call's row without them, and bf16 against fp8 on Llama 3 8B's shape cut to 4 blocks (micro-batch 2 x seq
4096); then `paratrain train --json` for gpt2-124m, llama-162m and a ~1B Llama at seq 1024 (eager bf16,
--compile, --compile --cuda-graphs, --dtype fp8 --compile; micro-batch 16, then 32 / 8), benchmarks/mfu.py's
hand-written loop of the same step (the ratio paratrain / plain), `paratrain verify --device cuda` in fp32 and
bf16 (fp8 and compiled last), `paratrain plan --calibrate` (the profile: OUT/hardware-profile.json) and
`paratrain doctor --trace`. Every train row gets the planner's predicted step time for the layout it ran, from
the catalog and from the calibrated profile (plan/predict.py); an fp8 row's MFU is also given against the bf16
peak. OUT/results.json and OUT/table.md are rewritten after every row, so a run cut off still leaves what it
measured; a row that cannot run (a flag this paratrain's train lacks included) gets one line saying why.

Time: --budget-s (default 330) covers everything. First a prewarm starts the compiled rows for 2-3 steps,
--prewarm-jobs at a time (fewer where their planned memory would not fit the GPU together), only to fill
torch.compile's caches, until what is left of the budget is what measuring them takes; the measured rows then
run one at a time on the otherwise idle GPU, each only if its (warm or cold) time estimate fits what is left.

    python benchmarks/gpu_suite.py --out DIR            # one CUDA GPU (without one every row says so)
    python benchmarks/gpu_suite.py --dry-run --out DIR  # the same code on CPU: tiny models, seconds
    python benchmarks/gpu_suite.py --list               # the rows, in order, with their time estimates
    python benchmarks/gpu_suite.py --only 'gpt2-124m-fp8-*,calibrate' --out DIR   # a subset
    python benchmarks/gpu_suite.py --rest-of DIR --out DIR2   # what DIR did not measure, with DIR's profile

On a lent GPU through the device tool (its image has torch 2.11 but no pydantic or torchao), in ONE call of at
most 5 minutes, with the committed H100 profile so no calibration runs (docs/performance.md, "The GPU suite").
Here first, once, in the repository root (.whl/ is git-ignored; never commit wheels):
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
      typing-inspection==0.4.5 typing-extensions==4.16.0 torchao==0.17.0
then run(carry=[".whl"], timeout_s=300, command=
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site
    .whl/*.whl && export PYTHONPATH=/tmp/site || exit; export PYTHONUNBUFFERED=1; timeout 270 python3
    benchmarks/gpu_suite.py --budget-s 245 --hardware
    benchmarks/results/gpu-suite-2026-11-26/hardware-profile-h100-sxm.json --out /tmp/gpu-suite;
    cp /tmp/gpu-suite/results.json /tmp/gpu-suite/table.md $OUT/; tar czf $OUT/gpu-suite.tar.gz -C /tmp gpu-suite
) and unpack the tarball into benchmarks/results/ to commit it.
A second call right after, on the still-warm machine, runs what the first did not reach: the same command with
`--rest-of /tmp/gpu-suite --out /tmp/gpu-suite-2` (and that folder copied and tarred).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STARTED = time.monotonic()  # the budget counts from here: imports and the machine probe are part of it
HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(HERE))
if (SRC / "paratrain").is_dir():
    sys.path.insert(0, str(SRC))  # this tree's paratrain, also where it is not pip-installed (the device image)

from gpu_suite_machine import probe_machine, skip_reason  # noqa: E402
from gpu_suite_report import (  # noqa: E402
    add_predictions,
    bf16_equivalent_mfu,
    last_line,
    last_line_of,
    read_row,
    summary,
    write_outputs,
)
from gpu_suite_rows import GPU_ROWS, Row, code_path, command, config_toml  # noqa: E402
from paratrain.cli_options import flag_of  # noqa: E402


class Interrupted(Exception):
    """SIGTERM/SIGINT (the caller's timeout): stop the row in flight, write what was measured, exit."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu-suite"), help="folder for everything the suite writes")
    p.add_argument("--budget-s", type=float, default=330.0, help="wall-clock seconds for the whole suite")
    p.add_argument("--dry-run", action="store_true", help="CPU: the same rows with tiny models, in seconds")
    p.add_argument("--only", help="comma-separated row-id patterns (fnmatch), e.g. 'gpt2-124m-*,calibrate'; rows "
                   "run in the order of the patterns")
    p.add_argument("--list", action="store_true", help="print the rows and their time estimates, run nothing")
    p.add_argument("--prewarm-jobs", type=int, default=None, help="compile-cache prewarm processes at a time "
                   "(default 4 on a GPU, 2 in --dry-run; 0: none)")
    p.add_argument("--prewarm-rows", type=int, default=None,
                   help="prewarm at most this many rows (default all; 1 in --dry-run)")
    p.add_argument("--prewarm-s", type=float, default=None,
                   help="seconds the prewarm may take (default: what the budget leaves after measuring the rows "
                        "it warms)")
    p.add_argument("--calibrate-rounds", type=int, default=None,
                   help="plan --calibrate rounds (default 5; 1 in --dry-run)")
    p.add_argument("--hardware", type=Path,
                   help="use this calibrated profile (an earlier suite's) instead of calibrating")
    p.add_argument("--rest-of", type=Path, metavar="DIR", help="an earlier suite's --out: run only the rows it "
                   "did not measure, with its profile (a second call on the same, still warm machine)")
    args = p.parse_args(argv)
    dry = args.dry_run
    args.prewarm_jobs = (2 if dry else 4) if args.prewarm_jobs is None else args.prewarm_jobs
    args.prewarm_rows = (1 if dry else len(GPU_ROWS)) if args.prewarm_rows is None else args.prewarm_rows
    args.calibrate_rounds = (1 if dry else 5) if args.calibrate_rounds is None else args.calibrate_rounds
    args.done = set()
    if args.rest_of:
        import json

        try:
            earlier = json.loads((args.rest_of / "results.json").read_text())
        except (OSError, ValueError) as exc:
            p.error(f"--rest-of {args.rest_of}: no readable results.json ({exc})")
        args.done = {e["id"] for e in earlier["rows"] if "result" in e}
        if args.hardware is None and (args.rest_of / "hardware-profile.json").exists():
            args.hardware = args.rest_of / "hardware-profile.json"
    return args


def selected_rows(args) -> list[Row]:
    rows = [r.cpu_twin() if args.dry_run else r for r in GPU_ROWS]
    if args.only:
        pats = [p.strip() for p in args.only.split(",") if p.strip()]

        def first_match(r: Row) -> int | None:
            return next((i for i, pat in enumerate(pats) if fnmatch.fnmatch(r.id, pat)), None)

        # in the order of the patterns (the budget cuts from the bottom), the suite's own order within one
        rows = sorted((r for r in rows if first_match(r) is not None), key=first_match)
    return [r for r in rows if r.id not in args.done]


class Suite:
    def __init__(self, args, machine: dict):
        self.args, self.machine, self.out = args, machine, args.out.resolve()
        self.start = STARTED
        self.device = "cpu" if args.dry_run else machine["device"]
        self.profile = self.out / "hardware-profile.json"
        self.child: subprocess.Popen | None = None
        self.entries: list[dict] = []
        self.by_id: dict[str, Row] = {}
        self.prewarmed: dict[str, str] = {}  # row id -> "ok" or why it is not warm
        self.prewarm_note = ""
        self.mem_plans: dict[tuple, float] = {}
        self.state = "running"
        self.log_file = (self.out / "suite.log").open("a")

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        line = f"[{self.elapsed():6.1f}s] {msg}"
        print(line, file=sys.stderr, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()

    def write(self) -> None:
        m = self.machine
        suite = {"state": self.state, "dry_run": self.args.dry_run, "device": m["name"],
                 "capability": m["capability"], "torch": m["torch"], "torchao": m["torchao"],
                 "triton": m["triton"], "paratrain": m["paratrain"], "peak_tflops": m["peak_tflops"],
                 "budget_s": self.args.budget_s, "elapsed_s": self.elapsed(), "prewarm": self.prewarm_note,
                 "hardware_profile": self.profile.name if self.profile.exists() else None,
                 "command": " ".join(sys.argv)}
        write_outputs(self.out, {"suite": suite, "rows": self.entries})

    def env(self) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
        if self.profile.exists():
            env["PARATRAIN_HARDWARE"] = str(self.profile)  # doctor's own prediction uses the calibrated profile
        return env

    def row_dir(self, row: Row) -> Path:
        d = self.out / "rows" / row.id
        d.mkdir(parents=True, exist_ok=True)
        return d

    def argv(self, row: Row, prewarm: bool = False) -> list[str]:
        d = self.row_dir(row)
        toml = config_toml(row)
        config = None
        if toml:
            config = d / "config.toml"
            config.write_text(toml)
        return command(row, d, self.device, self.profile, config, prewarm, self.args.calibrate_rounds)

    def entry(self, row: Row, gpu: Row, **fields) -> dict:
        e = {"id": row.id, "kind": row.kind, "model": gpu.model_label, "dtype": gpu.dtype, "mode": gpu.mode,
             "micro_batch": gpu.micro_batch, "seq_len": gpu.seq_len, "pair": row.pair,
             "flags": [flag_of(f) for f in gpu.flags], "baseline": row.baseline, **fields}
        if self.args.dry_run:
            e["dry_run_as"] = {"model": row.model, "shape": dict(row.shape), "dtype": row.dtype,
                               "compile": row.compile, "seq_len": row.seq_len, "micro_batch": row.micro_batch}
        self.entries.append(e)
        self.write()
        return e

    # -- children ---------------------------------------------------------------------------------------------
    def spawn(self, argv: list[str], stdout, stderr) -> subprocess.Popen:
        # own session: a timeout ends the child and everything it started (compile workers) by process group
        return subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=self.env(), cwd=str(self.out),
                                start_new_session=True)

    @staticmethod
    def stop(proc: subprocess.Popen) -> None:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            if proc.poll() is not None:
                return
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass

    def run_child(self, row: Row, argv: list[str], timeout: float) -> tuple[int | None, str, str]:
        """(exit code or None on timeout, stdout, stderr) of one row's child; its output stays in its folder."""
        d = self.row_dir(row)
        (d / "command.txt").write_text(" ".join(argv) + "\n")
        with (d / "stdout.json").open("w+") as out, (d / "stderr.log").open("w+") as err:
            self.child = self.spawn(argv, out, err)
            try:
                rc = self.child.wait(timeout)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                self.stop(self.child)
                self.child = None
            out.seek(0)
            err.seek(0)
            return rc, out.read(), err.read()

    # -- prewarm: fill the compile caches of the compiled rows, several at once -------------------------------
    def prewarm(self, rows: list[tuple[Row, Row]]) -> None:
        jobs = self.args.prewarm_jobs
        chosen = self.worth_prewarming(rows, jobs)[: self.args.prewarm_rows]
        todo = [(row, gpu) for row, gpu, _ in chosen]
        if jobs <= 0 or not todo:
            self.prewarm_note = "off" if jobs <= 0 else "nothing to compile"
            return
        # by default until the budget keeps just what measuring the rows up to the last one warmed takes
        deadline = min(self.args.budget_s - chosen[-1][2] if self.args.prewarm_s is None else self.args.prewarm_s,
                       self.args.budget_s)
        cap = self.mem_cap()
        need = {r.id: self.planned_mem(r) for r, _ in todo} if cap else {}
        running: dict[str, tuple[subprocess.Popen, object]] = {}
        self.log(f"prewarm: {len(todo)} compiled row(s), {jobs} at a time, at most {deadline:.0f} s")
        pending = list(todo)
        try:
            while (pending or running) and self.elapsed() < deadline:
                for rid, (proc, log) in list(running.items()):
                    if proc.poll() is not None:
                        log.close()
                        why = last_line(self.out / "prewarm" / f"{rid}.log")
                        self.prewarmed[rid] = "ok" if proc.returncode == 0 else \
                            f"prewarm exited {proc.returncode}: {why}"
                        self.log(f"prewarm {rid}: {self.prewarmed[rid]}")
                        del running[rid]
                used = sum(need.get(rid, 0.0) for rid in running)
                while pending and len(running) < jobs and (
                        not running or not cap or used + need[pending[0][0].id] <= cap):
                    row = pending.pop(0)[0]
                    (self.out / "prewarm").mkdir(exist_ok=True)
                    log = (self.out / "prewarm" / f"{row.id}.log").open("w")
                    running[row.id] = (self.spawn(self.argv(row, prewarm=True), log, subprocess.STDOUT), log)
                    used += need.get(row.id, 0.0)
                time.sleep(0.2)
        finally:
            for rid, (proc, log) in running.items():
                self.stop(proc)
                log.close()
                self.prewarmed[rid] = "cut off at the prewarm's time limit"
        warm = sum(v == "ok" for v in self.prewarmed.values())
        self.prewarm_note = (f"{warm} of {len(todo)} compiled rows warmed in {self.elapsed():.0f} s, "
                             f"{jobs} at a time")
        self.log(f"prewarm: {self.prewarm_note}")

    def worth_prewarming(self, rows: list[tuple[Row, Row]], jobs: int) -> list[tuple[Row, Row, float]]:
        """The compiled rows among those the budget should reach, each with the seconds measuring the rows up to it
        takes: in order, while the measured rows' warm estimates plus the prewarm's own (cold estimates over the
        prewarms the GPU's memory lets run at once, at most `jobs`) fit the budget."""
        chosen, measured, warming = [], 0.0, 0.0
        cap = self.mem_cap()
        for row, gpu in rows:
            compiled = gpu.compile and row.kind in ("train", "plain")
            measured += row.warm_s if compiled else row.cold_s
            at_once = max(1, min(jobs, int(cap // self.planned_mem(row)) if cap and compiled else jobs))
            warming += row.cold_s / at_once if compiled else 0.0
            if measured + warming > self.args.budget_s:
                break
            if compiled:
                chosen.append((row, gpu, measured))
        return chosen

    def mem_cap(self) -> float | None:
        """GiB the prewarm's processes may plan to use together (None: no GPU memory to bound)."""
        return self.machine["mem_gib"] * 0.85 if self.machine["mem_gib"] else None

    def planned_mem(self, row: Row) -> float:
        """The planner's memory for the row (catalog profile): the prewarm keeps the sum under the GPU's. The
        speed flags are not in the planner's model, so rows that differ only in them share one prediction."""
        key = (row.model, row.dtype, row.compile, row.micro_batch, row.seq_len, row.shape)
        if key not in self.mem_plans:
            from gpu_suite_report import predict

            p = predict(row, None, self.device, None)
            self.mem_plans[key] = p["mem_gib"] if p else self.machine["mem_gib"] / max(self.args.prewarm_jobs, 1)
        return self.mem_plans[key]

    # -- the measured rows, one at a time ---------------------------------------------------------------------
    def run_row(self, row: Row, gpu: Row) -> None:
        warm = self.prewarmed.get(row.id) == "ok"
        est = row.warm_s if warm else row.cold_s
        left = self.left()
        if est > left:
            self.log(f"skip {row.id}: would not fit the budget (needs ~{est:.0f} s, {max(left, 0):.0f} s left)")
            self.entry(row, gpu, skipped=f"budget: needs ~{est:.0f} s, {max(left, 0):.0f} s of "
                                         f"{self.args.budget_s:.0f} s left (--budget-s, --only)")
            return
        timeout = min(left, max(3 * est, 90.0))
        self.log(f"run {row.id} ({'warm' if warm else 'cold'}, ~{est:.0f} s, timeout {timeout:.0f} s)")
        t0 = time.monotonic()
        try:
            rc, out, err = self.run_child(row, self.argv(row), timeout)
        except Interrupted as exc:
            self.entry(row, gpu, skipped=f"cut off ({exc}) after {time.monotonic() - t0:.0f} s")
            raise
        wall = time.monotonic() - t0
        fields = {"wall_s": round(wall, 1), "warm": warm}
        if rc is None:
            fields["skipped"] = f"timed out after {wall:.0f} s"
        elif rc != 0 and not (row.kind == "verify" and rc == 1 and out.strip()):
            fields["error"] = f"exit {rc}: {last_line_of(err)}"
        else:
            try:
                fields["result"] = read_row(row, self.row_dir(row), out)
                if "mfu" in fields["result"]:
                    fields["result"]["mfu_bf16_equivalent"] = bf16_equivalent_mfu(
                        fields["result"]["mfu"], gpu.dtype, self.machine["peak_tflops"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                fields["error"] = (f"unreadable output ({type(exc).__name__}: {exc}); "
                                   f"stderr: {last_line_of(err)}")
        if row.id in self.prewarmed and not warm:
            fields["prewarm"] = self.prewarmed[row.id]
        e = self.entry(row, gpu, **fields)
        if row.kind == "calibrate" and "result" in e:
            self.install_profile()
            for other in self.entries:  # now every measured row also gets the calibrated prediction
                add_predictions(other, self.by_id[other["id"]], self.device, self.profile)
        add_predictions(e, row, self.device, self.profile if self.profile.exists() else None)
        self.write()
        self.log(f"{row.id}: {summary(e)}")

    def install_profile(self) -> None:
        """Also where `plan` and `train --strategy auto` look by default, unless a profile is already there
        (never over a multi-GPU calibration; never from a --dry-run)."""
        if self.args.dry_run:
            return
        from paratrain.costs.hardware import default_profile_path

        dest = default_profile_path()
        if dest.exists():
            self.log(f"calibration: kept the profile already at {dest}; this one is {self.profile}")
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(self.profile.read_text())
        self.log(f"calibration: saved {self.profile} and {dest}")

    def run(self, rows: list[Row]) -> None:
        seen: dict[tuple, str] = {}
        runnable: list[tuple[Row, Row]] = []
        gpu_of = {r.id: r for r in GPU_ROWS}
        for row in rows:
            gpu = gpu_of[row.id]
            self.by_id[row.id] = row
            why = skip_reason(row, self.machine, self.args.dry_run)
            if why is None and row.kind == "calibrate" and self.args.hardware:
                why = f"profile given (--hardware {self.args.hardware})"
            if why is None and self.args.dry_run:
                key = code_path(row)
                if key in seen:
                    why = f"dry-run: runs the same suite code as {seen[key]} (tiny model, eager, on CPU)"
                seen.setdefault(key, row.id)
            if why:
                self.log(f"skip {row.id}: {why}")
                self.entry(row, gpu, skipped=why)
            else:
                runnable.append((row, gpu))
        self.prewarm(runnable)
        self.write()
        for row, gpu in runnable:
            self.run_row(row, gpu)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for r in selected_rows(args):
            print(f"{r.id:<52} ~{r.cold_s:4.0f} s cold, ~{r.warm_s:4.0f} s warm")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    machine = probe_machine(args.dry_run)
    suite = Suite(args, machine)
    if args.hardware:
        try:
            suite.profile.write_text(args.hardware.read_text())
        except OSError as exc:
            sys.stderr.write(f"error: cannot read --hardware {args.hardware}: {exc.strerror or exc}\n")
            return 2

    def interrupted(signum, _frame):
        for sig in (signal.SIGTERM, signal.SIGINT):  # one is enough: let the clean-up below finish
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    suite.log(f"gpu suite: {machine['name']} (torch {machine['torch']}, "
              f"torchao {machine['torchao'] or 'absent'}), "
              f"budget {args.budget_s:.0f} s, out {suite.out}{' (DRY RUN)' if args.dry_run else ''}")
    code = 0
    try:
        suite.run(selected_rows(args))
        suite.state = "complete"
    except Interrupted as exc:
        suite.state = f"interrupted ({exc}) after {suite.elapsed():.0f} s"
        code = 143
    finally:
        if suite.child is not None:
            suite.stop(suite.child)
        if suite.state == "running":
            suite.state = "failed"
        suite.write()
        suite.log(f"wrote {suite.out / 'results.json'} and {suite.out / 'table.md'} ({suite.state})")
    sys.stdout.write((suite.out / "table.md").read_text())
    return code


if __name__ == "__main__":
    sys.exit(main())
