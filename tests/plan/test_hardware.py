"""GPU catalog, custom hardware, hardware profiles and detection."""

from __future__ import annotations

import pytest

from paratrain import gpu_catalog as cat
from paratrain.costs import hardware as hw
from paratrain.errors import UserError

# the dense bf16 figures, each checked against the datasheet named in the catalog entry
DENSE_BF16 = {"a100-40": 312, "a100-80": 312, "h100-sxm": 989, "h100-pcie": 756, "h200": 989, "a6000": 154.8,
              "rtx4090": 165.2}
REQUIRED = ("a100-40", "a100-80", "h100-sxm", "h100-pcie", "h200", "a6000", "rtx4090", "l4", "l40s", "cpu")


def test_catalog_has_every_gpu_with_a_source():
    for name in REQUIRED:
        spec = cat.get_gpu(name)
        assert spec.source, name
        assert spec.mem_gib > 0 and spec.mem_bw_gbs > 0 and spec.intra_node_gbs > 0 and spec.inter_node_gbs > 0


@pytest.mark.parametrize("name,tflops", sorted(DENSE_BF16.items()))
def test_dense_bf16_peaks(name, tflops):
    assert cat.get_gpu(name).peak("bf16") == tflops


def test_cluster_defaults_follow_dgx_shape():
    assert cat.get_gpu("a100-80").inter_node_gbs == 25 and cat.get_gpu("h100-sxm").inter_node_gbs == 50
    assert cat.get_gpu("h200").gpus_per_node == 8 and "NIC" in cat.get_gpu("h100-sxm").assumptions


def test_unknown_gpu_lists_known_names():
    with pytest.raises(UserError) as err:
        cat.get_gpu("v100")
    assert all(name in str(err.value) for name in REQUIRED)


def test_unknown_dtype_is_an_error_not_a_fallback():
    spec = cat.custom_gpu(100, 40, 100, 10, dtype="bf16")
    assert spec.peak("bf16") == 100
    with pytest.raises(UserError):
        spec.peak("fp32")


def test_custom_hardware_needs_every_figure():
    with pytest.raises(UserError):
        cat.custom_gpu(100, None, 100, 10, dtype="bf16")


def test_profile_round_trip(tmp_path):
    prof = hw.profile_from_spec(cat.get_gpu("h100-sxm"))
    path = prof.save(tmp_path / "p.json")
    back = hw.load_profile(path)
    assert back.gpu == prof.gpu and back.dtype_tflops == prof.dtype_tflops and back.link_gbs == prof.link_gbs


def test_bad_profile_is_a_user_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(UserError):
        hw.load_profile(bad)


def test_detect_describes_this_machine():
    info = hw.detect()
    assert info["device"] in ("cpu", "cuda") and info["gpus"] >= 1


def test_no_peak_for_an_unknown_device():
    assert cat.device_peak_tflops("cpu", "bf16") is None
    assert cat.catalog_name_for("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert cat.catalog_name_for("Some Future GPU") is None
