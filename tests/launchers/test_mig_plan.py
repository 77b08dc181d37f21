"""Issue 37: planning for MIG slices (`plan --gpu h100-sxm --mig 3g.40gb`), one transformation of the catalog's
GPU (gpu_catalog.mig_slice) that `plan --mig` and `launch --mig` both reach."""

from __future__ import annotations

import json

import pytest

from paratrain.gpu_catalog import get_gpu, mig_profile_names, mig_slice
from reliability.inproc import run_cli_inproc


def test_a_slice_has_its_share_of_compute_and_bandwidth_and_the_profiles_memory():
    h100 = get_gpu("h100-sxm")
    half = mig_slice(h100, "3g.40gb")
    assert half.mem_gib == 40
    assert half.peak_tflops["bf16"] == pytest.approx(989 * 3 / 7)
    assert half.mem_bw_gbs == pytest.approx(3350 * 4 / 8)
    assert half.gpus_per_node == 16  # two 3g.40gb slices per GPU, 8 GPUs per node
    assert half.intra_node_gbs < h100.intra_node_gbs  # no NVLink between slices
    small = mig_slice(get_gpu("h200"), "1g.18gb")
    assert small.mem_gib == 18 and small.gpus_per_node == 56
    assert small.peak_tflops["fp8"] == pytest.approx(1979 / 7)
    whole = mig_slice(get_gpu("a100-40"), "7g.40gb")
    assert whole.peak_tflops == get_gpu("a100-40").peak_tflops and whole.mem_gib == 40


def plan_json(*args: str) -> dict:
    code, out, err = run_cli_inproc(["plan", "--model", "llama-162m", "--gpus", "4", "--top", "3", "--json", *args])
    assert code == 0, err
    return json.loads(out)


def test_plan_on_slices_is_slower_and_has_less_memory_than_on_whole_gpus():
    whole = plan_json("--gpu", "h100-sxm")
    sliced = plan_json("--gpu", "h100-sxm", "--mig", "3g.40gb")
    assert sliced["cluster"]["gpu"] == "h100-sxm/mig-3g.40gb"
    assert sliced["cluster"]["gpus_per_node"] == 16 and sliced["cluster"]["mem_gib"] == 40
    best_whole, best_sliced = whole["candidates"][0], sliced["candidates"][0]
    assert best_sliced["step_time_s"] > best_whole["step_time_s"]
    assert "3/7 of the SMs" in json.dumps(sliced)


@pytest.mark.parametrize("args,message", [
    (["--gpu", "h100-sxm", "--mig", "3g.20gb"], "unknown MIG profile '3g.20gb' on h100-sxm; valid: 1g.10gb, 1g.20gb, "
                                                "2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb"),
    (["--gpu", "l40s", "--mig", "1g.10gb"], "l40s has no MIG"),
    (["--peak-tflops", "100", "--mem-gib", "40", "--intra-node-gbs", "100", "--inter-node-gbs", "10",
      "--mig", "1g.10gb"], "--mig slices a catalog GPU"),
])
def test_a_bad_profile_is_one_line_exit_2(args, message):
    code, out, err = run_cli_inproc(["plan", "--model", "small", "--gpus", "2", *args])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_profile_names_are_listed_in_order():
    names = mig_profile_names()
    assert names[:3] == ["1g.5gb", "1g.10gb", "1g.18gb"] and names[-1] == "7g.141gb"
