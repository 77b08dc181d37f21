"""What a newcomer reads (issue 35): parameter counts in words people use, singular and plural, a warning when
--seq-len runs a RoPE model past its trained positions, and errors that name only settings that exist."""

import json
import logging

import pytest
import torch

from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.models.presets import count_params, get_preset, model_args_for
from paratrain.parallel.strategies import resolve_layout
from paratrain.train.readable_numbers import plural, readable_count
from paratrain.train.runtime import Runtime
from paratrain.train.trainer import Trainer
from paratrain.train.validate import validate_run

QWEN = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
        "use_sliding_window": False, "attention_dropout": 0.0}
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 128}


def hf_dir(tmp_path, doc) -> str:
    folder = tmp_path / doc["model_type"]
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(doc))
    return f"hf:{folder}"


def test_counts_read_as_people_say_them():
    assert readable_count(2_912_384) == "2.91 M" and readable_count(124_439_808) == "124 M"
    assert readable_count(8_030_261_248) == "8.03 B" and readable_count(131_072) == "131 K"
    assert readable_count(512) == "512"
    assert plural(1, "document") == "1 document" and plural(3012, "document") == "3,012 documents"


def test_trainer_counts_the_whole_model_before_any_strategy_shards_it():
    cfg = TrainConfig(model="tiny", strategy="single", nproc=1, device="cpu", steps=2, metrics=False)
    rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    trainer = Trainer(cfg, rt, quiet=True, layout=resolve_layout(cfg, 1))
    assert trainer.param_count == sum(p.numel() for p in trainer.params) == count_params(get_preset("tiny"))


def test_seq_len_past_a_rope_models_positions_warns_once(tmp_path, caplog):
    model = hf_dir(tmp_path, QWEN)
    with caplog.at_level(logging.WARNING, logger="paratrain"):
        validate_run(TrainConfig(model=model, strategy="single", nproc=1, device="cpu", seq_len=256), 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--seq-len 256" in warnings[0] and "128 positions" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="paratrain"):
        validate_run(TrainConfig(model=model, strategy="single", nproc=1, device="cpu", seq_len=128), 1)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_seq_len_past_a_learned_position_table_is_refused(tmp_path):
    with pytest.raises(UserError, match="128 learned positions"):
        validate_run(TrainConfig(model=hf_dir(tmp_path, GPT2), strategy="single", nproc=1, device="cpu",
                                 seq_len=256), 1)


def test_shape_keys_on_an_hf_model_name_no_flag_that_does_not_exist(tmp_path):
    model = hf_dir(tmp_path, QWEN)
    with pytest.raises(UserError) as err:
        model_args_for(TrainConfig(model=model, ffn_dim=384))
    assert "--ffn-dim" not in str(err.value) and "ffn_dim in the --config TOML" in str(err.value)
    assert "config.json" in str(err.value)
    with pytest.raises(UserError, match="--vocab-size"):
        model_args_for(TrainConfig(model=model, vocab_size=512))


def test_plan_counts_a_tied_head_once_as_the_built_model_does(tmp_path):
    from paratrain.models.hf_model import build_hf_model
    from paratrain.models.hf_shape import hf_model_args

    for tied in (True, False):
        model = hf_dir(tmp_path / str(tied), {**QWEN, "tie_word_embeddings": tied})
        built = sum(p.numel() for p in build_hf_model(model, 0).parameters())
        assert count_params(hf_model_args(model)) == pytest.approx(built, rel=0.01)  # less qwen2's q/k/v biases
