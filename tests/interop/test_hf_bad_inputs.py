"""Bad inputs to export and --init-from: exit 2 with one line naming the file and the tensor."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from paratrain.convert.hf_export import export_checkpoint


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("hf-bad")
    export_checkpoint(tiny_checkpoint, root / "hf")
    return root


def one_line_error(res) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_export_of_a_directory_that_is_not_a_checkpoint(cli_inproc, tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    line = one_line_error(cli_inproc("export", "junk", "-o", "out"))
    assert "junk is not a paratrain checkpoint" in line
    assert not (tmp_path / "out").exists()


def test_init_from_a_file_with_a_missing_tensor(cli_inproc, tmp_path, exported):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text((exported / "hf" / "config.json").read_text())
    tensors = load_file(str(exported / "hf" / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(hf / "model.safetensors"))
    line = one_line_error(cli_inproc("train", "--strategy", "single", "--steps", "1", "--init-from", str(hf)))
    assert "model.safetensors" in line and "model.layers.1.mlp.up_proj.weight is missing" in line


def test_init_from_a_misshaped_tensor(cli_inproc, tmp_path, exported):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text((exported / "hf" / "config.json").read_text())
    tensors = load_file(str(exported / "hf" / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(hf / "model.safetensors"))
    line = one_line_error(cli_inproc("train", "--strategy", "single", "--steps", "1", "--init-from", str(hf)))
    assert "model.safetensors: tensor model.layers.0.self_attn.k_proj.weight has shape [64, 64], expected [32, 64]" in line


def test_init_from_a_config_for_another_model(cli_inproc, exported):
    line = one_line_error(cli_inproc("train", "--model", "tiny4", "--strategy", "single", "--steps", "1", "--init-from",
                              str(exported / "hf")))
    assert "config.json has n_layers 2, but model tiny4 has 4" in line


def test_init_from_a_directory_without_weights(cli_inproc, tmp_path):
    (tmp_path / "empty").mkdir()
    line = one_line_error(cli_inproc("train", "--strategy", "single", "--steps", "1", "--init-from", "empty"))
    assert "empty holds neither model.safetensors nor model.safetensors.index.json" in line


def test_missing_extra_is_named(cli_inproc, monkeypatch, tiny_checkpoint):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed: importing it raises
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    line = one_line_error(cli_inproc("export", str(tiny_checkpoint), "-o", "o"))
    assert line == "error: paratrain export needs the optional 'hf' extra (safetensors is not installed): " \
                   "pip install 'paratrain[hf]'"
