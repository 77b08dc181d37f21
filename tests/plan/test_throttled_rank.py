"""A mixed cluster measured: on 2 CPU ranks with rank 1 throttled (tests/support/throttle.py, loaded into the
workers as a PARATRAIN_PLUGINS plugin: its compute takes FACTOR x as long) and described to the planner as that much slower (a cluster file with speed
1 / FACTOR), the planner's uneven batch split trains measurably faster than the even split, by about the
margin it predicts. Both layouts run in one process group (bench's measure_cells), interleaved by nothing
but order; the step time is the median over measured steps of the slowest rank's.

The band, measured ratio (uneven / even step time) against the predicted one: at least 0.75 x the predicted
ratio, and below 1 (the uneven split faster). Why these ends:
- lower: the planner prices this machine with the catalog's cpu placeholder (tests run without a calibrated
  profile) and divides everything it counts as compute by the speed (the optimizer step too), while the
  throttle stretches forward + backward only; the fixed share of a tiny-model step (optimizer, all-reduce,
  Python) is therefore mis-priced by tens of percent, which can make the real gain larger than predicted by
  up to ~25%, not more: the predicted ratio is already the compute-bound limit for this split;
- upper: the throttle sleeps (FACTOR - 1) x the rank's thread CPU time, so on a loaded machine, where a
  thread gets a fraction of a core, the rank is slowed by less than FACTOR in wall time (1 + (FACTOR - 1) x
  CPU / wall), which the planner cannot know: the measured gain shrinks toward none as the load grows. Only
  "faster" is asserted on that side. While this test was written (load average 9 to 16 on 2 cores: the
  ranking benchmark and two other engineers' tests) it measured 0.79, 0.81, 0.81 and 0.93 against a
  predicted 0.52 (split 13:3); on a quiet core the ratio approaches the predicted one.
"""

from __future__ import annotations

import json
import statistics

import pytest

from helpers import plugin_env

FACTOR = 3.0
LOWER = 0.75
ROUNDS = 2


@pytest.mark.timeout(240)
def test_the_planners_uneven_split_beats_the_even_split_on_a_throttled_rank(tmp_path, monkeypatch):
    from paratrain.bench.probe_layouts import probe_config
    from paratrain.bench.scaling import run_cells, slowest_rank_step_times
    from paratrain.config import TrainConfig
    from paratrain.plan.plan_cli import build_plan_inputs
    from paratrain.plan.plan_report import plan_document

    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"nodes": [{"gpu": "cpu", "count": 2, "speed": [1.0, 1 / FACTOR]}]}))
    job, hw, fixed, mixed = build_plan_inputs({"model": "tiny", "seq_len": 64, "global_batch": 16, "dtype": "fp32",
                                               "cluster": str(cluster), "strategy": "ddp"})
    best = plan_document(job, hw, fixed, top=1, cluster=mixed)["candidates"][0]
    assert best["dp_batch_split"] and best["dp_batch_split"][0] > best["dp_batch_split"][1]
    predicted = best["step_time_s"] / best["step_time_even_s"]

    for key, value in plugin_env("support.throttle:plugin", PARATRAIN_TEST_RANK_SLOWDOWN=f"1:{FACTOR:g}").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the throttle measures this thread's CPU time
    from paratrain.parallel.layout import Layout

    base = TrainConfig(model="tiny", seq_len=64, global_batch=16, nproc=2, device="cpu", dtype="fp32", timeout_s=60.0)
    even = Layout(dp_replicate=2, micro_batch=8, microbatches=1, dtype="fp32")
    m = best["microbatches"]
    uneven = Layout(dp_replicate=2, micro_batch=max(best["dp_batch_split"]), microbatches=m, dtype="fp32",
                    dp_micro_batches=tuple(best["dp_batch_split"]))
    # even, uneven, even, uneven, ...: a shared machine's changing load falls on both alike
    cells = run_cells([probe_config(base, lay, 2, 4) for _ in range(ROUNDS) for lay in (even, uneven)], 2, 2, 4)
    assert cells[1]["layout"]["dp_micro_batches"] == best["dp_batch_split"]  # the split the planner chose ran
    t_even, t_uneven = (statistics.median(t for c in cells[k::2] for t in slowest_rank_step_times(c)) for k in (0, 1))
    measured = t_uneven / t_even
    print(f"split {best['dp_batch_split']} x {m}: measured {t_uneven * 1e3:.1f} vs {t_even * 1e3:.1f} ms "
          f"(ratio {measured:.2f}), predicted ratio {predicted:.2f}")
    assert t_uneven < t_even
    assert measured >= LOWER * predicted, (measured, predicted)
