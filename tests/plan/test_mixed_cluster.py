"""`plan` on mixed clusters (--gpu TYPE:COUNT,... and --cluster FILE): devices priced one by one, uneven data-
parallel batch and pipeline block splits, the bottleneck named; a homogeneous list plans exactly as a plain
--gpu does; bad input exits 2. In this process (a plan starts no worker). The measured check that an uneven
split beats the even one is tests/plan/test_throttled_rank.py."""

from __future__ import annotations

import json

import pytest

from paratrain.plan.costing.uneven_cost import water_fill

CONTRACT = ("strategy", "dims", "pp_schedule", "microbatches", "micro_batch", "activation_checkpointing",
            "memory_gib", "step_time_s", "tokens_per_s_per_device", "mfu", "comm_bytes_per_step",
            "bubble_fraction", "feasible", "reasons")  # plan --json's contract (docs/planner.md)

TINY = ("--model", "tiny", "--seq-len", "64", "--global-batch", "16", "--dtype", "fp32", "--json")


def cluster_file(tmp_path, doc, name="cluster.json") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def plan(cli_inproc, *args):
    res = cli_inproc("plan", *args)
    assert res.returncode == 0, res.stderr
    return res.json(), res.stderr


def test_a_slower_rank_takes_less_of_the_batch(cli_inproc, tmp_path):
    path = cluster_file(tmp_path, {"nodes": [{"gpu": "cpu", "count": 2, "speed": [1.0, 0.5]}]})
    doc, err = plan(cli_inproc, *TINY, "--cluster", path, "--strategy", "ddp", "--top", "2")
    assert doc["cluster"]["mixed"] and [d["speed"] for d in doc["cluster"]["devices"]] == [1.0, 0.5]
    best = doc["candidates"][0]
    assert all(k in best for k in CONTRACT)  # every plan --json field stays
    fast, slow = best["dp_batch_split"]
    assert fast > slow  # more sequences to the faster rank
    assert f"--dp-batch-split {fast}:{slow}" in best["command"]
    assert best["step_time_s"] < best["step_time_even_s"]
    # even split: the slow rank (twice the compute) finishes last and names the bottleneck
    even = {d["rank"]: d["busy_s"] for d in best["per_device_even"]}
    assert even[1] > even[0]
    uneven = {d["rank"]: d for d in best["per_device"]}
    assert uneven[0]["batch"] + uneven[1]["batch"] == 16 and uneven[0]["batch"] > uneven[1]["batch"]
    assert max(d["busy_s"] for d in uneven.values()) == pytest.approx(best["step_time_s"])
    assert best["bottleneck"]["rank"] in (0, 1) and best["bottleneck"]["why"].startswith("bottleneck:")
    assert any("batch split" in r for r in best["reasons"])
    assert "per device (#0, uneven split" in err and "--dp-batch-split" in err


def test_a_slower_pipeline_stage_holds_fewer_blocks(cli_inproc, tmp_path):
    path = cluster_file(tmp_path, {"nodes": [{"gpu": "cpu", "count": 1}, {"gpu": "cpu", "count": 1, "speed": 0.3}],
                                   "inter_node_gbs": 5})
    doc, _ = plan(cli_inproc, "--model", "tiny4", "--seq-len", "64", "--global-batch", "8", "--dtype", "fp32",
                  "--json", "--cluster", path, "--pp", "2", "--pp-schedule", "1f1b", "--top", "1")
    best = doc["candidates"][0]
    layers = best["pp_layers"]
    assert sum(layers) == 4 and layers[0] > layers[1]  # the stage at 0.3x speed keeps fewer blocks
    assert "--pp-layers " + ":".join(map(str, layers)) in best["command"]
    assert best["step_time_s"] < best["step_time_even_s"]
    assert [d["layers"] for d in best["per_device"]] == layers


def test_a_homogeneous_list_plans_as_the_plain_gpu_does(cli_inproc):
    for fixed in (("--strategy", "ddp"), ("--pp", "2", "--pp-schedule", "1f1b")):
        listed, _ = plan(cli_inproc, *TINY, "--gpu", "cpu:2", *fixed, "--top", "1")
        plain, _ = plan(cli_inproc, *TINY, "--gpu", "cpu", "--gpus", "2", *fixed, "--top", "1")
        a, b = listed["candidates"][0], plain["candidates"][0]
        assert a["dims"] == b["dims"] and a["micro_batch"] == b["micro_batch"]
        # the per-device pricing (uneven.py, its own pipeline composition included) agrees with plan/costing/time.py
        assert a["step_time_s"] == pytest.approx(b["step_time_s"], rel=1e-9)
        assert a["dp_batch_split"] is None and a["pp_layers"] is None and "--dp-batch-split" not in a["command"]


def test_two_gpu_types_split_toward_the_faster(cli_inproc):
    doc, _ = plan(cli_inproc, "--model", "tiny", "--seq-len", "256", "--global-batch", "64", "--dtype", "bf16",
                  "--json", "--gpu", "h100-sxm:2,a6000:2", "--strategy", "ddp", "--top", "1")
    c = doc["cluster"]
    assert c["gpu"] == "h100-sxm:2,a6000:2" and c["gpus"] == 4 and c["nodes"] == 2
    best = doc["candidates"][0]
    split = best["dp_batch_split"]
    assert split[0] == split[1] > split[2] == split[3]  # H100s: ~6x the A6000's bf16 peak
    assert [d["gpu"] for d in best["per_device"]] == ["h100-sxm"] * 2 + ["a6000"] * 2


@pytest.mark.parametrize("args, message", [
    (("--gpu", "h100-sxm:8,b200:8"), "unknown GPU type 'b200'"),
    (("--gpu", "h100-sxm:8,a100-80:8", "--gpus", "8"), "describes 16 device(s) but --gpus is 8"),
    (("--gpu", "h100-sxm:x"), "not an integer"),
    (("--gpu", "h100-sxm:0,cpu"), "must be >= 1"),
    (("--gpu", "cpu:1,cpu:1", "--nodes", "2"), "drop --nodes"),
])
def test_bad_gpu_lists_exit_2(cli_inproc, args, message):
    res = cli_inproc("plan", "--model", "tiny", *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1


@pytest.mark.parametrize("doc, message", [
    ("{not json", "is not valid JSON"),
    ({"nodes": []}, "non-empty \"nodes\" list"),
    ({"nodes": [{"gpu": "cpu", "count": 2, "speed": [1]}]}, "speed lists 1 device(s) but count is 2"),
    ({"nodes": [{"gpu": "cpu", "count": 1, "speed": -1}]}, "speed must be a positive number"),
    ({"nodes": [{"gpu": "cpu", "count": 1, "colour": "red"}]}, "unknown key(s) colour"),
    ({"nodes": [{"gpu": "tpu", "count": 1}]}, "unknown GPU type 'tpu'"),
    ({"nodes": [{"gpu": "cpu", "count": 1.5}]}, "count must be an integer"),
])
def test_bad_cluster_files_exit_2(cli_inproc, tmp_path, doc, message):
    res = cli_inproc("plan", "--model", "tiny", "--cluster", cluster_file(tmp_path, doc))
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_a_missing_cluster_file_and_both_forms_exit_2(cli_inproc, tmp_path):
    res = cli_inproc("plan", "--model", "tiny", "--cluster", str(tmp_path / "none.json"))
    assert res.returncode == 2 and "cannot read cluster file" in res.stderr
    path = cluster_file(tmp_path, {"nodes": [{"gpu": "cpu", "count": 2}]})
    res = cli_inproc("plan", "--model", "tiny", "--cluster", path, "--gpu", "cpu:2")
    assert res.returncode == 2 and "not both" in res.stderr


def test_water_fill_is_min_max_and_respects_caps():
    # bin 0 costs 1 per item, bin 1 costs 3: 8 items -> 6 and 2 (max 6), not 4 and 4 (max 12)
    assert water_fill(2, 8, lambda i, k: k * (1, 3)[i], lambda i: 8) == [6, 2]
    # memory caps bin 0 at 3 items: the rest go to bin 1 though it is slower
    assert water_fill(2, 8, lambda i, k: k * (1, 3)[i], lambda i: (3, 8)[i]) == [3, 5]
    assert water_fill(2, 8, lambda i, k: k, lambda i: 2) is None  # 8 items cannot fit 2 + 2
    assert water_fill(3, 2, lambda i, k: k, lambda i: 5) is None  # every bin needs one
