"""--deepspeed FILE.json (issue 52, interop/deepspeed_config.py): six configs in the style of DeepSpeed's and
transformers' documented examples resolve to the expected paratrain configs; what has no equivalent is named in
one warning; unknown keys, duplicate keys and batch sizes that do not add up exit 2 in one line; a 20-step run
with the file writes the same metrics as the same run given as flags.

References: DeepSpeed's config reference (docs/_pages/config-json.md: the Adam, WarmupLR and OneCycle examples,
the ZeRO tutorials' zero_optimization sections) and transformers' ds_config_zero2.json / ds_config_zero3.json
("auto" values) for the files; the expected values are DeepSpeed's meaning of each key, written out here.
"""

from __future__ import annotations

import json
import logging

import pytest

from paratrain.config import load_config
from paratrain.errors import UserError
from paratrain.interop.commented_json import load_commented_json
from paratrain.interop.deepspeed_config import check_deepspeed_batch

GETTING_STARTED = """{
  "train_batch_size": 8,
  "gradient_accumulation_steps": 1,
  "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
  "fp16": {"enabled": true},
  "zero_optimization": true
}"""

ZERO2_ADAM_WARMUP = """{
  "train_batch_size": 16,
  "train_micro_batch_size_per_gpu": 2,
  "steps_per_print": 100,
  "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7,
                                           "adam_w_mode": false}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
  "gradient_clipping": 1.0,
  "bf16": {"enabled": true},
  "zero_optimization": {"stage": 2, "allgather_partitions": true, "allgather_bucket_size": 5e8, "overlap_comm": false,
                        "reduce_scatter": true, "reduce_bucket_size": 5e8, "contiguous_gradients": true},
  "wall_clock_breakdown": false
}"""

ZERO3_OFFLOAD = """{
  // ZeRO-3 with both offloads, as DeepSpeed's ZeRO-Offload tutorial writes it
  "train_batch_size": 16,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},  # pinned host memory
    "offload_param": {"device": "cpu", "pin_memory": true},
    "stage3_max_live_parameters": 1e9, /* prefetching: */ "stage3_prefetch_bucket_size": 5e8
  },
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500, "warmup_min_lr": 0,
                "warmup_max_lr": 3e-4, "warmup_num_steps": 50, "warmup_type": "linear"}},
  "bf16": {"enabled": true},
  "gradient_clipping": 1.0
}"""

# the keys transformers' ds_config_zero2.json and ds_config_zero3.json end with: its Trainer fills the "auto"s
TRANSFORMERS_AUTO = """  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "steps_per_print": 2000,
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "wall_clock_breakdown": false
}"""

HF_ZERO2 = """{
  "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
           "hysteresis": 2, "min_loss_scale": 1},
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                               "warmup_num_steps": "auto"}},
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true},
                        "allgather_partitions": true, "allgather_bucket_size": 2e8, "overlap_comm": true,
                        "reduce_scatter": true, "reduce_bucket_size": 2e8, "contiguous_gradients": true},
""" + TRANSFORMERS_AUTO

HF_ZERO3 = """{
  "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_min_lr": "auto",
                                                    "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
  "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true},
                        "offload_param": {"device": "cpu", "pin_memory": true}, "overlap_comm": true,
                        "contiguous_gradients": true, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                        "stage3_gather_16bit_weights_on_model_save": true},
""" + TRANSFORMERS_AUTO

ONE_CYCLE_SGD = """# hjson comments: '#', '//' and '/* */' (inside a string they are text)
{
  "train_batch_size": 32,
  "train_micro_batch_size_per_gpu": 8,
  "optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}},  // torch's, by name
  "scheduler": {"type": "OneCycle", "params": {
      "cycle_first_step_size": 1000, "cycle_first_stair_count": 500, "cycle_second_step_size": 1000,
      "cycle_second_stair_count": 500, "decay_step_size": 1000, "cycle_min_lr": 0.0001, "cycle_max_lr": 0.0010,
      "decay_lr_rate": 0.001, "cycle_min_mom": 0.85, "cycle_max_mom": 0.99, "decay_mom_rate": 0.0}},
  "communication_data_type": "fp16",
  "tensorboard": {"enabled": true, "output_path": "runs/#1//x", "job_name": "a /* not a comment */ b"}
}"""

CASES = {
    "getting-started": (GETTING_STARTED, {}, {
        "strategy": "zero1", "global_batch": 8, "micro_batch": None, "dtype": "fp16", "optimizer": "adamw",
        "lr": 0.00015, "betas": "0.9,0.999", "eps": 1e-8, "weight_decay": 0.0, "grad_clip": 0.0,
        "loss_scale_init": 65536.0, "loss_scale_window": 1000, "cpu_offload": False, "lr_schedule": "cosine"},
        ["fp16.hysteresis 2"]),
    "zero2-adam-warmup": (ZERO2_ADAM_WARMUP, {}, {
        "strategy": "zero2", "global_batch": 16, "micro_batch": 2, "dtype": "bf16", "optimizer": "adam",
        "lr": 0.001, "betas": "0.8,0.999", "weight_decay": 3e-7, "lr_schedule": "warmup-log", "warmup_type": "log",
        "warmup_steps": 1000, "min_lr": 0.0, "grad_clip": 1.0},
        ["steps_per_print", "zero_optimization.allgather_bucket_size", "zero_optimization.reduce_bucket_size"]),
    "zero3-offload": (ZERO3_OFFLOAD, {}, {
        "strategy": "zero3", "cpu_offload": True, "global_batch": 16, "micro_batch": 4, "dtype": "bf16",
        "optimizer": "adamw", "lr": 3e-4, "betas": "0.9,0.95", "eps": 1e-8, "weight_decay": 0.1,
        "lr_schedule": "warmup-decay", "warmup_type": "linear", "warmup_steps": 50, "steps": 500, "min_lr": 0.0},
        ["zero_optimization.stage3_max_live_parameters", "zero_optimization.offload_param.pin_memory"]),
    "transformers-zero2": (HF_ZERO2, {"global_batch": 8, "lr": 1e-4, "dtype": "fp16"}, {
        "strategy": "zero2", "cpu_offload": True, "dtype": "fp16", "loss_scale_init": 65536.0,
        "loss_scale_window": 1000, "optimizer": "adamw", "lr": 1e-4, "betas": "0.9,0.95", "global_batch": 8,
        "micro_batch": None, "lr_schedule": "warmup-log", "warmup_steps": 5, "grad_clip": 1.0},
        ["fp16.min_loss_scale", "fp16.hysteresis 2", "zero_optimization.overlap_comm"]),
    "transformers-zero3": (HF_ZERO3, {"global_batch": 16, "micro_batch": 2, "steps": 40, "dtype": "bf16"}, {
        "strategy": "zero3", "cpu_offload": True, "dtype": "bf16", "lr_schedule": "warmup-decay",
        "warmup_type": "log", "steps": 40, "global_batch": 16, "micro_batch": 2, "lr": 3e-3},
        ["zero_optimization.stage3_gather_16bit_weights_on_model_save", "zero_optimization.sub_group_size"]),
    "one-cycle-sgd-commented": (ONE_CYCLE_SGD, {}, {
        "strategy": "ddp", "ddp_comm_hook": "fp16", "optimizer": "sgd", "momentum": 0.9, "weight_decay": 1e-4,
        "lr": 0.001, "min_lr": 0.0001, "lr_schedule": "one-cycle", "warmup_steps": 1000, "cooldown_steps": 1000,
        "decay_lr_rate": 0.001, "decay_step_size": 1000, "dtype": "fp32", "grad_clip": 0.0, "global_batch": 32,
        "micro_batch": 8},
        ["scheduler.params.cycle_first_stair_count", "scheduler.params.cycle_min_mom", "tensorboard"]),
}


def write(tmp_path, text: str, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", list(CASES))
def test_a_documented_style_config_resolves_to_the_expected_paratrain_config(case, tmp_path, caplog):
    text, flags, want, unmapped = CASES[case]
    with caplog.at_level(logging.WARNING, logger="paratrain"):
        cfg = load_config(None, {"deepspeed": write(tmp_path, text), **flags})
    assert {k: getattr(cfg, k) for k in want} == want
    named = [r.getMessage() for r in caplog.records if "no paratrain equivalent" in r.getMessage()]
    assert len(named) == 1 and all(key in named[0] for key in unmapped), named
    assert "wall_clock_breakdown" not in named[0]  # switched off: nothing is lost


def test_comments_are_blanked_outside_strings_only():
    text = '{"a": "x // y # z /* w */ \\" q", // one\n "b": 2 # two\n /* three\n */ }'
    assert load_commented_json(text, "t") == {"a": 'x // y # z /* w */ " q', "b": 2}


def test_flags_given_beside_the_file_win_and_are_named(tmp_path, caplog):
    path = write(tmp_path, ZERO3_OFFLOAD)
    with caplog.at_level(logging.WARNING, logger="paratrain"):
        cfg = load_config(None, {"deepspeed": path, "lr": 0.002, "strategy": "zero2", "steps": 20})
    assert (cfg.lr, cfg.strategy, cfg.steps, cfg.warmup_steps) == (0.002, "zero2", 20, 50)
    won = [r.getMessage() for r in caplog.records if "flags given beside it win" in r.getMessage()]
    assert won and "--lr 0.002 over scheduler.params.warmup_max_lr" in won[0] and "--steps 20" in won[0]


@pytest.mark.parametrize(("text", "flags", "message"), [
    ('{"train_batch_size": 8, "zero_optimisation": {"stage": 2}}', {}, "unknown key 'zero_optimisation'"),
    ('{"train_batch_size": 8, "zero_optimization": {"stage": 2, "stage3_prefetch": 5}}', {},
     "unknown key 'zero_optimization.stage3_prefetch'"),
    ('{"train_batch_size": 8, "bf16": {"enabled": true}, "train_batch_size": 16}', {},
     "gives the key 'train_batch_size' twice"),
    ('{"train_batch_size": "auto"}', {}, 'train_batch_size is "auto": give --global-batch N'),
    ('{"train_micro_batch_size_per_gpu": 2}', {}, "train_batch_size is not set: give --global-batch N"),
    ('{"train_batch_size": 8, "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": "auto"}', {},
     "give --micro-batch N"),
    ('{"train_batch_size": 8, "fp16": {"enabled": true}, "bf16": {"enabled": true}}', {}, "both enabled"),
    ('{"train_batch_size": 8, "optimizer": {"type": "Lamb", "params": {"lr": 0.1}}}', {}, "'Lamb' has no paratrain"),
    ('{"train_batch_size": 8, "scheduler": {"type": "LRRangeTest", "params": {}}}', {}, "'LRRangeTest' has no"),
    ('{"train_batch_size": 8, "zero_optimization": {"stage": 4}}', {}, "zero_optimization.stage must be 0..3"),
    ('{"train_batch_size": 8 /* open', {}, "not valid JSON"),
    ('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}', {},
     "offload_optimizer at stage 1: paratrain offloads through FSDP2"),
])
def test_a_bad_file_is_refused_in_one_line(text, flags, message, tmp_path):
    with pytest.raises(UserError, match=None) as err:
        load_config(None, {"deepspeed": write(tmp_path, text), **flags})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_auto_batch_sizes_take_the_flags(tmp_path):
    cfg = load_config(None, {"deepspeed": write(tmp_path, HF_ZERO3), "global_batch": 12, "micro_batch": 3})
    assert (cfg.global_batch, cfg.micro_batch) == (12, 3)


def test_the_batch_sizes_are_checked_against_the_data_parallel_size(tmp_path):
    path = write(tmp_path, '{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, '
                           '"gradient_accumulation_steps": 2}')
    check_deepspeed_batch(path, 16, 4, 2)  # 4 x 2 x 2 ranks
    with pytest.raises(UserError, match=r"train_batch_size 16 must be train_micro_batch_size_per_gpu 4 x "
                                        r"gradient_accumulation_steps 2 x 4"):
        check_deepspeed_batch(path, 16, 4, 4)


def test_an_inconsistent_triple_exits_2_before_training(cli_inproc, tmp_path):
    path = write(tmp_path, '{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, '
                           '"gradient_accumulation_steps": 4}')
    res = cli_inproc("train", "--deepspeed", path, "--nproc", "2", "--device", "cpu", "--model", "tiny")
    assert res.returncode == 2
    assert "do not add up on 2 data-parallel rank(s)" in res.stderr and "\n" not in res.stderr.strip()


def test_print_config_shows_what_the_file_became(cli_inproc, tmp_path):
    res = cli_inproc("train", "--deepspeed", write(tmp_path, ZERO3_OFFLOAD), "--print-config")
    assert res.returncode == 0, res.stderr
    for line in ('strategy = "zero3"', "cpu_offload = true", 'lr_schedule = "warmup-decay"', "steps = 500",
                 'warmup_type = "linear"', "micro_batch = 4", 'dtype = "bf16"', 'deepspeed = "'):
        assert line in res.stdout, line


RUN_FILE = """{
  // ZeRO-0 data parallelism, AdamW and DeepSpeed's decaying warm-up, clipped: every mapped kind of key
  "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
  "zero_optimization": {"stage": 0},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.004, "betas": [0.85, 0.99], "eps": 1e-7, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_min_lr": 0.0004,
                "warmup_max_lr": 0.004, "warmup_num_steps": 6}},
  "gradient_clipping": 0.3,
  "steps_per_print": 10
}"""
SAME_AS_FLAGS = ["--strategy", "ddp", "--global-batch", "4", "--micro-batch", "2", "--optimizer", "adamw",
                 "--lr", "0.004", "--betas", "0.85,0.99", "--eps", "1e-7", "--weight-decay", "0.01",
                 "--lr-schedule", "warmup-decay", "--steps", "20", "--min-lr", "0.0004", "--warmup-steps", "6",
                 "--grad-clip", "0.3", "--dtype", "fp32"]


def test_twenty_steps_with_the_file_log_the_metrics_of_the_same_run_given_as_flags(cli_here, tmp_path):
    common = ["train", "--model", "tiny", "--nproc", "1", "--device", "cpu", "--seq-len", "32", "--seed", "3"]
    path = write(tmp_path, RUN_FILE)
    runs = {}
    for name, extra in (("file", ["--deepspeed", path]), ("flags", SAME_AS_FLAGS)):
        res = cli_here(*common, *extra, "--out", str(tmp_path / name))
        assert res.returncode == 0, res.stderr
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [{k: json.loads(line)[k] for k in ("step", "loss", "lr", "grad_norm")} for line in lines]
    assert len(runs["file"]) == 20 and runs["file"] == runs["flags"]
    assert runs["file"][0]["lr"] == 0.0004 and runs["file"][6]["lr"] == pytest.approx(0.004)  # DeepSpeed's offset
