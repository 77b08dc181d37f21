"""LoRA's exports (convert/lora_export.py): `export --adapter-only` is a PEFT adapter directory that
`peft.PeftModel.from_pretrained` loads onto the base, and gives the logits of the merged `export` (W + alpha/r B A)
within 1e-5, which transformers loads as an ordinary model. Reference: PEFT's own LoRA forward."""

from __future__ import annotations

import json

import peft  # the test extra's: these tests never skip
import torch
import transformers

from models.hf_configs import CONFIGS
from paratrain.config import TrainConfig
from paratrain.train.trainer import Trainer
from reliability.inproc import one_rank

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))


def train_lora(tmp_path, model: str, **fields):
    """A 3-step LoRA run of `model` on one rank; returns its checkpoint."""
    cfg = TrainConfig(model=model, strategy="single", nproc=1, device="cpu", steps=3, ckpt_every=3, seq_len=32,
                      global_batch=4, metrics=False, resume="never", ckpt_dir=str(tmp_path / "ck"), lora_r=4,
                      lora_alpha=8.0, lr=0.02, **fields)
    with one_rank() as rt:
        Trainer(cfg, rt, quiet=True).fit()
    return tmp_path / "ck" / "step-3"


def export(cli_inproc, ckpt, out, *extra):
    result = cli_inproc("export", str(ckpt), "-o", str(out), "--json", *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def test_hf_adapter_loads_in_peft_and_matches_the_merged_export(tmp_path, cli_inproc):
    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    config = transformers.LlamaConfig(**{k: v for k, v in CONFIGS["llama"].items() if k != "model_type"})
    transformers.LlamaForCausalLM(config).save_pretrained(base_dir)
    ckpt = train_lora(tmp_path, f"hf:{base_dir}")
    adapter = export(cli_inproc, ckpt, tmp_path / "adapter", "--adapter-only")
    assert adapter["files"] == ["adapter_model.safetensors", "adapter_config.json"]
    doc = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (doc["peft_type"], doc["task_type"], doc["r"], doc["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8.0)
    assert doc["target_modules"] == ["q_proj", "v_proj"] and doc["base_model_name_or_path"] == str(base_dir)
    export(cli_inproc, ckpt, tmp_path / "merged")

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    before = logits(base)
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    got, want = logits(with_adapter), logits(merged)
    assert (got - want).abs().max() <= 1e-5
    assert (want - before).abs().max() > 1e-3  # the adapters trained: the merged model is not the base


def test_preset_adapter_keeps_hf_rotary_layout(tmp_path, cli_inproc):
    """A preset's q rows are reordered for HF's rotary layout on export: B's rows are reordered alike."""
    from paratrain.convert.export_plan import checkpoint_tensors
    from paratrain.convert.hf_export import read_tensors
    from paratrain.interop.hf_format import hf_tensors
    from paratrain.models.presets import model_args_for

    ckpt = train_lora(tmp_path, "tiny")
    export(cli_inproc, ckpt, tmp_path / "adapter", "--adapter-only")
    export(cli_inproc, ckpt, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    # the base in HF's format: the merged model with the checkpoint's frozen base weights put back
    stored = checkpoint_tensors(ckpt)
    specs = [s for s in hf_tensors(model_args_for(TrainConfig(model="tiny"))) if s.name.endswith(("q_proj.weight",
                                                                                                    "v_proj.weight"))]
    loaded = read_tensors(ckpt, stored, [s.sources[0] for s in specs])
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    state = base.state_dict()
    with torch.no_grad():
        for spec in specs:
            state[spec.name].copy_(spec.build(loaded[spec.sources[0]]))
    assert (logits(base) - logits(merged)).abs().max() > 1e-3
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert (logits(with_adapter) - logits(merged)).abs().max() <= 1e-5


def test_adapter_only_refuses_a_run_without_adapters(tmp_path, cli_inproc):
    from interop.conftest import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path)
    result = cli_inproc("export", str(ckpt), "-o", str(tmp_path / "out"), "--adapter-only")
    assert result.returncode == 2 and "was not trained with --lora-r" in result.stderr
