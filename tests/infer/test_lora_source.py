"""eval and generate on a LoRA checkpoint (infer/source_loader.py): the adapters its manifest records are attached
again before the checkpoint is read, so the model run is the one trained. References: the training run's val_loss
at the saved step, and the merged `paratrain export` of the same checkpoint (W + alpha/r B A) run as hf:DIR."""

from __future__ import annotations

import json

import pytest
import torch

from reliability.inproc import one_rank

RUN = ("--global-batch", "4", "--seq-len", "32", "--val-batches", "2")
ONE = ("--strategy", "single", "--nproc", "1", "--device", "cpu")
PROMPTS = [{"ids": [1, 2, 3, 4]}, {"ids": [200, 100, 50, 25, 12]}]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(step directory, the run's val_loss there): tiny4 with rank-4 adapters on every attention and MLP linear, at a
    learning rate high enough for 3 steps to move the model well away from its base."""
    from paratrain.config import TrainConfig
    from paratrain.train.trainer import Trainer

    root = tmp_path_factory.mktemp("lora-ck")
    cfg = TrainConfig(model="tiny4", strategy="single", nproc=1, device="cpu", steps=3, global_batch=4, seq_len=32,
                      val_batches=2, eval_every=3, ckpt_every=3, ckpt_dir=str(root), resume="never", metrics=False,
                      lora_r=4, lora_alpha=16.0, lora_targets="wq,wv,wo,w2", lr=0.05)
    with one_rank() as rt:
        summary = Trainer(cfg, rt, quiet=True).fit()
    return root / "step-3", summary["val_loss"]


def test_eval_gives_the_runs_val_loss(cli_here, trained):
    from paratrain.verify.compare import Tolerance

    step_dir, val_loss = trained
    res = cli_here("eval", str(step_dir), *RUN, "--json")
    assert res.returncode == 0, res.stderr
    loss, tol = json.loads(res.stdout)["loss"], Tolerance()
    assert abs(loss - val_loss) <= tol.loss_atol + tol.loss_rtol * abs(val_loss), (loss, val_loss)


def test_loaded_adapters_are_the_trained_ones(trained):
    """The adapters are there with their trained values (B starts at zero) and change the logits."""
    from paratrain.infer.source_loader import load_for_inference, resolve_source

    step_dir, _ = trained
    cfg = resolve_source(str(step_dir), {"strategy": "single", "nproc": 1, "device": "cpu"})
    with one_rank() as rt:
        (model,) = load_for_inference(cfg, rt).model_parts
        tokens = torch.tensor([PROMPTS[1]["ids"]])
        with torch.no_grad():
            adapted = model(tokens)
            bs = [m.lora_B.weight for m in model.modules() if hasattr(m, "lora_B")]
            assert len(bs) == 4 * 4 and all(b.abs().max() > 0 for b in bs)
            for b in bs:
                b.zero_()
            base = model(tokens)
    assert (adapted - base).abs().max() > 1e-2


def test_generate_equals_the_merged_export(cli_here, trained, tmp_path):
    step_dir, _ = trained
    assert cli_here("export", str(step_dir), "-o", str(tmp_path / "merged")).returncode == 0
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    outputs = []
    for source in (str(step_dir), f"hf:{tmp_path / 'merged'}"):
        res = cli_here("generate", source, *ONE, "--prompts", str(prompts), "--max-new-tokens", "6", "--json")
        assert res.returncode == 0, res.stderr
        outputs.append(json.loads(res.stdout)["outputs"])
    ours, merged = outputs
    assert [o["tokens"] for o in ours] == [o["tokens"] for o in merged]
    for a, b in zip(ours, merged):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)
