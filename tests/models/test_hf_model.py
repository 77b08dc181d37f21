"""--model hf:PATH: building a transformers model from a config.json, its loss convention, and what is refused.

In-process and single-device (no process group): the multi-rank parity lives in test_hf_verify.py.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from paratrain.errors import UserError
from paratrain.train.step import lm_loss

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hf_configs import CONFIGS, write_config  # noqa: E402

from paratrain.models.hf_model import build_hf_model, hf_config_object  # noqa: E402


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_our_loss_equals_the_models_own_labels_loss(tmp_path, kind):
    """Ours: cross entropy of logits[:, t] against token t+1, targets shifted by the data loader. The model's own:
    labels=input_ids, shifted inside the model. Same numbers, so either convention trains the same model."""
    model = build_hf_model(f"hf:{write_config(tmp_path, kind)}", seed=3)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = lm_loss(model(tokens)[:, :-1], tokens[:, 1:])
    theirs = model.hf(input_ids=tokens, labels=tokens).loss
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0), (float(ours), float(theirs))


def test_seeded_init_is_reproducible_and_weights_load_from_safetensors(tmp_path):
    from safetensors.torch import save_file

    folder = write_config(tmp_path, "qwen2")
    a, b, c = (build_hf_model(f"hf:{folder}", seed=s) for s in (0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.hf.lm_head.weight, c.hf.lm_head.weight)
    save_file({k: v.contiguous() for k, v in c.hf.state_dict().items()}, str(folder / "model.safetensors"))
    loaded = build_hf_model(f"hf:{folder}", seed=0)  # the files win over the seed
    assert all(torch.equal(x, y) for x, y in zip(loaded.state_dict().values(), c.state_dict().values()))
    save_file({"model.embed_tokens.weight": torch.zeros(256, 64)}, str(folder / "model.safetensors"))
    with pytest.raises(UserError, match="do not match the config"):
        build_hf_model(f"hf:{folder}")


def test_decoder_layers_come_from_no_split_modules(tmp_path):
    gpt2 = build_hf_model(f"hf:{write_config(tmp_path, 'gpt2')}")
    assert len(gpt2.layers) == 2 and type(gpt2.layers[0]).__name__ == "GPT2Block" and gpt2.tied
    # the blocks keep one name: the property registers no second path to them
    assert not any(name.startswith("layers.") for name, _ in gpt2.named_parameters())


@pytest.mark.parametrize("doc, message", [
    ({"model_type": "bert"}, "not a decoder-only causal LM"),
    ({"model_type": "t5"}, "not a decoder-only causal LM"),
    ({"model_type": "no-such-model"}, "not a model transformers"),
    ({"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "x.Y"}}, "remote code"),
    ({"hidden_size": 8}, "model_type"),
])
def test_bad_configs_are_one_line(tmp_path, doc, message):
    from paratrain.models.hf_shape import hf_model_args

    (tmp_path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match=message):
        hf_model_args(f"hf:{tmp_path}")
    with pytest.raises(UserError, match="no such directory"):
        hf_model_args(f"hf:{tmp_path / 'missing'}")


def test_model_args_read_the_shape(tmp_path):
    from paratrain.models.hf_shape import hf_model_args

    mistral = hf_model_args(f"hf:{write_config(tmp_path, 'mistral')}")
    assert (mistral.dim, mistral.n_layers, mistral.n_heads, mistral.kv_heads, mistral.ffn_dim, mistral.family) == \
        (64, 2, 4, 2, 128, "llama")
    gpt2 = hf_model_args(f"hf:{write_config(tmp_path, 'gpt2')}")
    assert (gpt2.family, gpt2.ffn_dim, gpt2.tie_embeddings) == ("gpt2", 256, True)
    assert hf_config_object(CONFIGS["qwen2"]).model_type == "qwen2"


def test_refusals_tp_without_a_plan_and_pp_with_tp_and_a_tied_model_accepted(tmp_path):
    from paratrain.config import TrainConfig
    from paratrain.models.hf_pipeline import pipeline_view
    from paratrain.models.hf_shape import hf_model_args
    from paratrain.models.hf_tp_plan import hf_tp_plan
    from paratrain.parallel.strategies import resolve_layout
    from paratrain.train.hf_run_checks import check_hf_run

    spec = f"hf:{write_config(tmp_path, 'gpt2')}"
    gpt2 = build_hf_model(spec)
    with pytest.raises(UserError, match="no tensor-parallel plan"):
        hf_tp_plan(gpt2, tp=2)
    with pytest.raises(UserError, match="pp plan is embed_tokens -> layers -> norm"):  # learned positions, no rotary
        pipeline_view(gpt2, hf_model_args(spec))
    tied = f"hf:{write_config(tmp_path, 'llama', tie_word_embeddings=True)}"
    assert pipeline_view(build_hf_model(tied), hf_model_args(tied)).output is not None
    cfg = TrainConfig(model=tied, nproc=4, device="cpu", pp=2, tp=2)
    with pytest.raises(UserError, match="pp\\) with tp or cp"):
        check_hf_run(resolve_layout(cfg, 4), cfg, hf_model_args(tied))
    for fields in ({"strategy": "tp-sp"}, {"strategy": "pp"}):  # a tied head: the table shared, or copied and summed
        cfg = TrainConfig(model=tied, nproc=4, device="cpu", **fields)
        check_hf_run(resolve_layout(cfg, 4), cfg, hf_model_args(tied))
    cfg = TrainConfig(model=spec, nproc=2, device="cpu", strategy="tp")
    with pytest.raises(UserError, match="no tensor-parallel plan"):  # before any model is built
        check_hf_run(resolve_layout(cfg, 2), cfg, hf_model_args(spec))


def test_translated_tp_plan_places_every_parameter(tmp_path):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from paratrain.models.hf_tp_plan import GatherSequenceInput, hf_tp_plan
    from paratrain.models.tp_styles import ReplicateParallel

    model = build_hf_model(f"hf:{write_config(tmp_path, 'llama')}")
    plan = hf_tp_plan(model, tp=2)
    assert isinstance(plan["hf.model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["hf.model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert isinstance(plan["hf.model.layers.*.input_layernorm"], ReplicateParallel)
    assert isinstance(plan["hf.model.embed_tokens"], RowwiseParallel) and "hf.lm_head" in plan
    sp = hf_tp_plan(model, tp=2, sp=True, loss_parallel=True)
    assert isinstance(sp["hf.model.layers.*.self_attn"], GatherSequenceInput)
    assert sp["hf.model.layers.*.self_attn.o_proj"].output_layouts[0].is_shard(1)


def test_without_the_extra_one_line_names_it(monkeypatch, tmp_path):
    from paratrain.models.hf_model import require_transformers

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(UserError, match=r"optional 'hf' extra .* pip install 'paratrain\[hf\]'"):
        require_transformers()
    with pytest.raises(UserError, match="optional 'hf' extra"):
        build_hf_model(f"hf:{write_config(tmp_path, 'llama')}")


def test_cli_bad_hf_paths_exit_2_with_one_line(tmp_path):
    from reliability.inproc import run_cli_inproc

    for argv, message in ((["train", "--model", f"hf:{tmp_path / 'nowhere'}"], "no such directory"),
                          (["verify", "--model", f"hf:{tmp_path}", "--nproc", "1"], "holds no config.json"),
                          (["train", "--model", f"hf:{write_config(tmp_path, 'gpt2')}", "--vocab-size", "32"], "edit that"),
                          (["train", "--model", f"hf:{tmp_path / 'gpt2'}", "--seq-len", "512"], "learned positions")):
        code, _, err = run_cli_inproc(argv, cwd=tmp_path)
        assert code == 2 and message in err and "Traceback" not in err, err
        assert len([line for line in err.splitlines() if line.strip()]) == 1, err


def test_doctor_and_bench_take_an_hf_model(tmp_path):
    from reliability.inproc import run_cli_inproc

    model = f"hf:{write_config(tmp_path, 'qwen2')}"
    small = ["--nproc", "1", "--steps", "2", "--seq-len", "16", "--global-batch", "4"]
    code, out, err = run_cli_inproc(["doctor", "--model", model, "--warmup", "1", *small, "--json"], cwd=tmp_path)
    assert code == 0, err
    assert sum(json.loads(out)["breakdown"].values()) == pytest.approx(1.0, abs=0.02)
    code, out, err = run_cli_inproc(["bench", "--model", model, "--strategies", "ddp", "--nproc", "1", "--steps", "2",
                                     "--seq-len", "16", "--global-batch", "4", "--json"], cwd=tmp_path)
    assert code == 0, err
    run = json.loads(out)["runs"][0]
    assert run["strategy"] == "ddp" and run["peak_mem_gib"] > 0 and run["predicted_step_time_s"] > 0
