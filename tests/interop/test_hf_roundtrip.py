"""Export to a Hugging Face directory and back.

Reference: paratrain's own model with the checkpoint's weights (checkpoint.load_params). transformers'
`AutoModelForCausalLM.from_pretrained(DIR)` must give the same logits (fp32, max abs diff < 1e-5), and
`train --init-from DIR` must start from the same loss as the exported model on the same first batch.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers  # the [hf] extra is part of [test]

from paratrain.convert.hf_export import export_checkpoint  # noqa: E402
from paratrain.interop import hf_format  # noqa: E402
from paratrain.models.presets import PRESETS, build_model  # noqa: E402
from paratrain.train.data.indexed_sets import BatchSource, make_dataset  # noqa: E402
from paratrain.train.recovery.checkpoint import load_params  # noqa: E402
from reliability.inproc import run_cli_inproc

TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))


def paratrain_logits(step_dir, preset: str) -> torch.Tensor:
    model = build_model(PRESETS[preset], "cpu", seed=None)
    model.load_state_dict(load_params(step_dir))
    with torch.no_grad():
        return model.eval()(TOKENS)


def hf_model(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def first_batch_loss(model, seed: int = 0, global_batch: int = 16, seq_len: int = 64) -> float:
    source = BatchSource(make_dataset("synthetic", 256, seq_len, seed), global_batch, 0, 1, global_batch)
    batch = source.rank_batch(0)
    with torch.no_grad():
        logits = model(batch.inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()))


def metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(300)
def test_zero3_checkpoint_round_trips_through_transformers(cli_here, tmp_path):
    run = cli_here("train", "--strategy", "zero3", "--nproc", "2", "--steps", "5", "--ckpt-every", "5", "--ckpt-dir",
              "ck", "--out", "a")
    assert run.returncode == 0, run.stderr[-2000:]
    code, out, err = run_cli_inproc(["export", "ck", "-o", "hf", "--max-shard-size", "100KB", "--json"], cwd=tmp_path)
    assert code == 0, err[-2000:]  # in this process: export starts no worker
    doc = json.loads(out)
    assert doc["step"] == 5 and doc["architecture"] == "LlamaForCausalLM" and doc["shards"] > 1
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == doc["shards"]

    model = hf_model(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        theirs = model(TOKENS).logits
    ours = paratrain_logits(tmp_path / "ck" / "step-5", "tiny")
    assert (theirs - ours).abs().max().item() < 1e-5

    # import: the first training loss equals the exported model's loss on that first batch
    again = cli_here("train", "--strategy", "ddp", "--nproc", "2", "--steps", "1", "--init-from", "hf", "--out", "b",
                "--resume", "never")
    assert again.returncode == 0, again.stderr[-2000:]
    first = metrics(tmp_path / "b" / "metrics.jsonl")[0]["loss"]
    assert first == pytest.approx(first_batch_loss(model), rel=1e-5)
    assert first < metrics(tmp_path / "a" / "metrics.jsonl")[0]["loss"] - 0.01  # trained weights, not a fresh init


@pytest.mark.timeout(120)
def test_gpt2_family_exports_as_gpt2(cli_inproc, tmp_path, write_checkpoint):
    ck = write_checkpoint(tmp_path, "gpt2-tiny", steps=2)
    exp = cli_inproc("export", str(ck), "-o", "hf")
    assert exp.returncode == 0, exp.stderr[-2000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()  # small: one shard, no index
    model = hf_model(tmp_path / "hf")
    assert type(model).__name__ == "GPT2LMHeadModel"
    with torch.no_grad():
        theirs = model(TOKENS).logits
    assert (theirs - paratrain_logits(ck, "gpt2-tiny")).abs().max().item() < 1e-5
    # import (in process): the HF weights back into a fresh paratrain model give the same logits again
    from paratrain.interop.hf_import import load_hf_weights

    fresh = build_model(PRESETS["gpt2-tiny"], "cpu", seed=7)
    load_hf_weights(fresh, tmp_path / "hf", PRESETS["gpt2-tiny"])
    with torch.no_grad():
        assert (fresh.eval()(TOKENS) - theirs).abs().max().item() < 1e-5


def test_logit_check_catches_a_wrong_rope_layout(tmp_path, monkeypatch, tiny_checkpoint):
    """Fault injected: export q/k without the rotary permutation. The same comparison must fail."""
    ck = tiny_checkpoint
    monkeypatch.setattr(hf_format, "rope_to_half", lambda w, heads: w)
    export_checkpoint(ck, tmp_path / "hf")
    with torch.no_grad():
        theirs = hf_model(tmp_path / "hf")(TOKENS).logits
    assert (theirs - paratrain_logits(ck, "tiny")).abs().max().item() > 1e-4


def test_export_streams_one_shard_at_a_time(tmp_path, monkeypatch, tiny_checkpoint):
    from paratrain.convert import hf_export as export_mod

    ck = tiny_checkpoint
    loaded: list[int] = []
    real = export_mod.read_tensors

    def counting(step_dir, shapes, fqns):
        out = real(step_dir, shapes, fqns)
        loaded.append(sum(t.numel() * t.element_size() for t in out.values()))
        return out

    monkeypatch.setattr(export_mod, "read_tensors", counting)
    limit = 60_000
    doc = export_checkpoint(ck, tmp_path / "hf", max_shard_bytes=limit)
    largest = max(np.prod(s.shape) * 4 for s in hf_format.hf_tensors(PRESETS["tiny"]))
    assert len(loaded) == doc["shards"] > 3
    assert max(loaded) <= max(limit, largest)
    assert sum(loaded) == doc["bytes"]
