"""bench: strategies x world sizes, the JSON contract, the markdown table, the 3-panel PNG and the HTML page
(rendered in headless Chromium where it is installed, always in CI; tests/doctor/html_browser.py)."""

import pytest

from paratrain.bench.scaling import add_efficiency, markdown_table, parse_list
from paratrain.errors import UserError

RUN_FIELDS = {"strategy", "world_size", "step_time_s", "tokens_per_s", "scaling_efficiency", "predicted_step_time_s",
              "peak_mem_gib", "predicted_mem_gib", "comm_bytes_per_step"}


@pytest.mark.timeout(400)
def test_bench_ddp_zero2_zero3_on_1_and_2_ranks_writes_table_json_png_and_html(cli_here, tmp_path):
    res = cli_here("bench", "--strategies", "ddp,zero2,zero3", "--nproc", "1,2", "--json", "--plot", "out.png",
              "--html", "out.html",
              "--steps", "2", "--warmup", "2", "--seq-len", "32", "--micro-batch", "4", "--timeout-s", "120",
              timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = res.json()
    assert set(doc) >= {"runs", "plot"}
    runs = doc["runs"]
    assert [(r["strategy"], r["world_size"]) for r in runs] == [(s, n) for s in ("ddp", "zero2", "zero3") for n in (1, 2)]
    for r in runs:
        assert RUN_FIELDS <= set(r)
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0
        # weak scaling: 4 sequences per device
        assert r["global_batch"] == 4 * r["world_size"]
        if r["world_size"] == 1:
            assert r["scaling_efficiency"] == pytest.approx(1.0) and not r["comm_bytes_per_step"]
        else:
            assert r["scaling_efficiency"] > 0 and r["comm_bytes_per_step"] > 0
    by = {(r["strategy"], r["world_size"]): r for r in runs}
    # the same gradients travel in every strategy; ZeRO-3 also re-gathers parameters for backward
    assert by[("zero3", 2)]["comm_bytes_per_step"] > by[("ddp", 2)]["comm_bytes_per_step"]
    assert by[("zero3", 2)]["model_state_gib"]["params"] < by[("ddp", 2)]["model_state_gib"]["params"]
    assert "| strategy | N |" in res.stderr and "| zero3 | 2 |" in res.stderr

    from PIL import Image

    png = tmp_path / "out.png"
    assert doc["plot"] == "out.png" and png.exists()
    with Image.open(png) as image:
        image.load()  # decodes the pixels, not only the header
        assert image.format == "PNG" and image.size == (1500, 480)
    check_bench_html(doc, tmp_path)


def test_bench_rejects_bad_lists_and_unknown_strategies(cli_inproc):
    for args in (("--strategies", "ddp,nope"), ("--strategies", "single", "--nproc", "1,2")):
        res = cli_inproc("bench", *args, "--steps", "1")
        assert res.returncode == 2 and "error:" in res.stderr, (args, res.stderr[-500:])


def test_efficiency_and_table_from_measured_rows():
    runs = [{"strategy": "ddp", "world_size": n, "tokens_per_s": t, "step_time_s": 0.1, "predicted_step_time_s": None,
             "peak_mem_gib": 0.5, "predicted_mem_gib": None, "comm_bytes_per_step": 0}
            for n, t in ((1, 100.0), (2, 150.0), (4, 200.0))]
    add_efficiency(runs)
    assert [r["scaling_efficiency"] for r in runs] == pytest.approx([1.0, 0.75, 0.5])
    assert runs[2]["ideal_tokens_per_s"] == pytest.approx(400.0)
    table = markdown_table({"runs": runs})
    assert "| ddp | 4 | 100.0 | 200 | 50% | - |" in table
    assert parse_list("1, 2,4", "nproc", int) == [1, 2, 4]
    with pytest.raises(UserError):
        parse_list(",", "strategies")


def check_bench_html(doc, tmp_path):
    from doctor.html_browser import page_text

    page = tmp_path / "out.html"
    assert doc["html"] == "out.html"
    html = page.read_text()
    assert "http://" not in html and "https://" not in html and "<script" not in html  # self-contained
    text = page_text(page, tmp_path)  # rendered in headless Chromium where installed (always in CI)
    for r in doc["runs"]:
        assert f"{r['step_time_s'] * 1e3:.1f}" in text and f"{r['tokens_per_s']:.0f}" in text
    # a catalog placeholder prediction says so on the page, as in the table and the JSON
    assert doc["prediction_calibrated"] is ("placeholder" not in doc["prediction_hardware"])
    if not doc["prediction_calibrated"]:
        assert "UNCALIBRATED" in text


@pytest.mark.timeout(300)
def test_bench_ep_measures_the_exchange_the_planner_prices(cli_here):
    """`bench --strategies ep` on an MoE model: the bytes each collective kind moved, counted at the process-group
    level, against the planner's for the same layout. FSDP gathers and reduce-scatters only the dense part over
    dp_shard (each rank's half of the experts has no FSDP peer at ep = dp_shard = 2); the exchange sends a token
    once per rank its experts reach (the planner's r for a random top-2 of 4: 1.67 rows per token)."""
    res = cli_here("bench", "--model", "moe-tiny", "--strategies", "ep", "--nproc", "2", "--steps", "2",
                   "--warmup", "2", "--seq-len", "32", "--micro-batch", "4", "--timeout-s", "120", "--json",
                   timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = res.json()["runs"]
    assert (run["layout"]["ep"], run["layout"]["dp_shard"]) == (2, 2)
    measured = run["comm_bytes_by_op"]
    from paratrain.models.presets import get_preset
    from paratrain.parallel.layout import Layout
    from paratrain.plan.auto import auto_hardware
    from paratrain.plan.costing.time import estimate_time

    layout = Layout.from_dict(run["layout"])
    predicted = estimate_time(auto_hardware("cpu")[0], get_preset("moe-tiny"), layout, 32, "fp32", "cpu").comm_by_kind
    assert set(measured) - {"all_reduce"} == set(predicted), (measured, predicted)  # all_reduce: the counts
    for kind in ("all_gather", "reduce_scatter"):
        assert measured[kind] == pytest.approx(predicted[kind], rel=1e-3), kind
    # the router's own choices against the planner's random ones: within 5%
    assert measured["all_to_all"] == pytest.approx(predicted["all_to_all"], rel=0.05)
    assert run["predicted_comm_bytes_per_step"] == pytest.approx(run["comm_bytes_per_step"], rel=0.05)
