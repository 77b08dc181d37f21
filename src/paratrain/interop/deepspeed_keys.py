"""Every DeepSpeed config key paratrain knows: those it maps (interop/deepspeed_config.py reads them) and those it
has no equivalent for (named in one warning). A key in neither is unknown: refused, as a misspelt key would
otherwise be dropped silently. From DeepSpeed's config reference (docs/_pages/config-json.md) and its config
classes (deepspeed/runtime/config.py, zero/config.py, zero/offload_config.py)."""

from __future__ import annotations

BATCH_TRIPLE = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# top-level keys read by the mapping
MAPPED = {*BATCH_TRIPLE, "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "gradient_clipping", "zero_optimization",
          "communication_data_type", "tensor_parallel"}

# top-level keys with no paratrain equivalent: logging, monitors, profilers, DeepSpeed's own features
NO_EQUIVALENT = {
    "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "prescale_gradients",
    "gradient_predivide_factor", "sparse_gradients", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "activation_checkpointing",
    "sparse_attention", "data_efficiency", "curriculum_learning", "compression_training", "checkpoint", "data_types",
    "elasticity", "autotuning", "aio", "pipeline", "amp", "eigenvalue", "progressive_layer_drop",
    "quantize_training", "weight_quantization", "hybrid_engine", "nebula", "dataloader_drop_last",
    "disable_allgather", "graph_harvesting", "seq_parallel_communication_data_type", "seq_parallel_comm_data_type",
    "use_data_before_expert_parallelism", "vocabulary_size", "timers", "compile", "gradient_accumulation_dtype",
    "memory_efficient_linear", "torch_autocast",
}

ZERO_MAPPED = {"stage", "offload_param", "offload_optimizer", "cpu_offload", "cpu_offload_param"}
ZERO_NO_EQUIVALENT = {
    "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint",
    "sub_group_size", "cpu_offload_use_pin_memory", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
    "param_persistence_threshold", "stage3_param_persistence_threshold", "model_persistence_threshold",
    "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters", "max_reuse_distance",
    "stage3_max_reuse_distance", "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "module_granularity_threshold",
    "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size", "mics_hierarchical_params_gather",
    "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
}
OFFLOAD_MAPPED = {"device"}
OFFLOAD_NO_EQUIVALENT = {"nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read",
                         "pipeline_write", "fast_init", "ratio"}

FP16_MAPPED = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis"}
FP16_NO_EQUIVALENT = {"auto_cast", "consecutive_hysteresis", "min_loss_scale",
                      "fp16_master_weights_and_grads"}
BF16_MAPPED = {"enabled"}
BF16_NO_EQUIVALENT = {"immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                      "bf16_optimizer_states"}

TENSOR_PARALLEL_MAPPED = {"autotp_size"}
TENSOR_PARALLEL_NO_EQUIVALENT = {"tp_size", "tp_grain_size", "tp", "tensor_parallel", "keep_module_on_host",
                                 "injection_policy_tuple", "replace_with_kernel_inject", "kernel_inject", "dtype"}

# optimizer "params" by paratrain optimizer; "torch_adam" and "fused" pick an implementation of the same update
ADAM_PARAMS_MAPPED = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "fused"}
ADAM_PARAMS_NO_EQUIVALENT = {"amsgrad", "bias_correction", "freeze_step", "cuda_aware", "comm_backend_name",
                             "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper",
                             "maximize", "capturable", "foreach", "differentiable", "set_grad_none"}
SGD_PARAMS_MAPPED = {"lr", "momentum", "weight_decay"}
SGD_PARAMS_NO_EQUIVALENT = {"dampening", "nesterov", "maximize", "foreach", "differentiable", "fused"}
# DeepSpeed's 1-bit Adams: Adam(W)'s update, their gradients compressed to 1 bit after a warm-up
ONE_BIT_ADAMS = {"onebitadam", "zerooneadam"}

SCHEDULER_PARAMS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"},
    "WarmupDecayLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
                      "last_batch_iteration"},
    "WarmupCosineLR": {"warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "total_num_steps",
                       "last_batch_iteration"},
    "OneCycle": {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                 "decay_step_size", "last_batch_iteration"},
}
# OneCycle's stair counts (DeepSpeed stores them and never reads them) and its momentum cycling
ONE_CYCLE_NO_EQUIVALENT = {"cycle_first_stair_count", "cycle_second_stair_count", "cycle_momentum", "cycle_min_mom",
                           "cycle_max_mom", "decay_mom_rate"}
