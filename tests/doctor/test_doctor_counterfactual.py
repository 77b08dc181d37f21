"""Communication's cost by counterfactual: a large DDP model with a tiny micro-batch, as in issue #20.

The doctor's communication cost where its alone probe runs (each rank runs the step with no collective while its
peer waits: the gradient sync plus the contention two ranks cause on shared cores) is checked against the plain
measurement: the same per-rank step on two ranks minus on one rank, within a quarter of it (issue #20).
Both are measured side by side, round by round, in one launch (counterfactual_worker.py), so the machine's
changing load hits them alike, for as many rounds as the rounds' own spread needs to decide the bound (a busy
machine's step varies by half from round to round), with glibc's allocator pinned (GLIBC_PIN) so that the
one-rank reference does not page-fault a varying number of fresh gradient pages per step (docs/doctor.md). Then
the CLI: the doctor's communication finding carries the cost and is ranked by it, and its HTML report shows the
key numbers (rendered in headless Chromium where it is installed, always in CI: tests/doctor/html_browser.py).
"""

import json
import os
import statistics
import subprocess
import sys

import pytest

from doctor.html_browser import page_text
from helpers import cli_env

# what these tests measure is a share of a step's time: under -n no other test runs beside them (conftest.py)
pytestmark = pytest.mark.alone

HERE = os.path.dirname(os.path.abspath(__file__))
# Freed blocks up to 32 MiB (the largest gradient here is 16 MiB) stay in the heap and the heap is never trimmed,
# so a step reuses the pages the previous one freed. Unpinned, the one-rank step took 8k, 12k or 16k minor page
# faults per step (46, 52 or 57 ms), held for a whole launch in 2 of 10: the reference, not the probe, moved.
GLIBC_PIN = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**32)}
# at least 16 rounds (a quiet machine decides in 16 to 19), at most 96 (beside two busy processes: 29 to 53)
MIN_ROUNDS, MAX_ROUNDS, TOLERANCE = 16, 96, 0.25
LARGE_DDP = 'model = "tiny"\nvocab_size = 16384\ndim = 256\nffn_dim = 512\nn_layers = 1\nseq_len = 16\n'


@pytest.mark.timeout(450)
def test_sync_probe_matches_two_ranks_minus_one_side_by_side():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, "counterfactual_worker.py"), str(MIN_ROUNDS), str(MAX_ROUNDS), str(TOLERANCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=430, env=cli_env(GLIBC_PIN),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # means over the rounds, the estimator whose standard error decided how many rounds ran (each timed step
    # follows an untimed one of its kind: no separate warm-up round)
    two, one, cf, no_sync, alone, sync, broken = (statistics.fmean(got[k]) for k in
                                                  ("two_s", "one_s", "cf_s", "no_sync_s", "alone_s", "sync_s",
                                                   "broken_s"))
    measured = two - one
    assert measured > 0, got
    ratio, error = got["agreement"]
    detail = (f"{len(got['two_s'])} rounds: two ranks {two:.4f} s - one rank {one:.4f} s = {measured:.4f} s; probe "
              f"{cf:.4f} s (ratio {ratio:.3f} +- {error:.3f}; sync {sync:.4f} s, no_sync step {no_sync:.4f} s, alone "
              f"step {alone:.4f} s); broken probe {broken:.4f} s; {got}")
    # Issue #20's quarter. Means of this worker's rounds on the quiet 2-vCPU machine: 0.91-0.95 in 4 launches
    # (16-19 rounds); beside two busy processes 0.94-1.00 in 6 (29-53 rounds). Fixed 16 rounds beside them, as
    # before, ranged 0.74-1.08 and once failed (docs/doctor.md)
    assert 0.75 * measured <= cf <= 1.25 * measured, detail
    # the fault: an alone probe that skips nothing attributes little (0.06-0.19 of the difference in those
    # launches), and the same bound rejects it
    assert broken < 0.75 * measured, detail


@pytest.mark.timeout(300)
def test_doctor_ranks_by_the_communication_cost_and_its_html_renders(cli_here, tmp_path):
    (tmp_path / "run.toml").write_text(LARGE_DDP)
    res = cli_here("doctor", "--config", str(tmp_path / "run.toml"), "--strategy", "ddp", "--nproc", "2",
              "--global-batch", "2", "--warmup", "2", "--steps", "4", "--json", "--timeout-s", "120",
              # 2 rounds: each now times the second of two steps per variant, about what 3 single steps cost
              "--probe-rounds", "2",
              "--html", "report.html", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = res.json()
    comm = next(f for f in report["findings"] if f["cause"] == "communication")
    assert comm["numbers"]["counterfactual_ms"] > 0 and "no_sync" in comm["evidence"]
    assert comm["score"] >= comm["numbers"]["counterfactual_fraction"] - 1e-4  # score is rounded to 4 places
    assert comm["score"] >= comm["numbers"]["exposed_fraction"] - 1e-4
    assert report["counterfactual"]["probes"]["rounds"] == 2
    assert report["findings"][0]["cause"] == "communication", [f["cause"] for f in report["findings"]]
    # the peak is read before the profiler starts, so it stays the run's own figure (CPU: peak RSS)
    assert report["peak_mem_gib"] == pytest.approx(report["peak_rss_gib"])

    page = tmp_path / "report.html"
    assert report["html"] == "report.html" and page.exists()
    html = page.read_text()
    assert "http://" not in html and "https://" not in html and "<script" not in html  # self-contained
    text = page_text(page, tmp_path)  # rendered in headless Chromium where installed (always in CI)
    for figure in (f"{report['step_time_s'] * 1e3:.1f} ms per step", f"{comm['numbers']['counterfactual_ms']:.1f} ms",
                   f"{report['peak_mem_gib']:.3f} GiB", "rank 0", "rank 1", comm["fix"][:40]):
        assert figure in text, (figure, text[:2000])
