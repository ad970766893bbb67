"""Every key that DeepSpeed 0.19 reads from its config, at each level, and what tiny_zero does with it.

Per level: {key: READ (tiny_zero/config.py reads it), ("no effect", why),
("refused", is_off(value), why), or ("alias", the name tiny_zero reads it under)}.
A refused key whose value is_off (its default: the feature switched off) is
accepted, as it changes nothing. tests/test_deepspeed_config.py takes
DeepSpeed's own list (its DeepSpeedConfig and pydantic models) and checks that
each of its keys is here.
"""
READ = "read"


def enabled_off(v):
    return not v or not v.get("enabled", False)


def removed(why, is_off=enabled_off):
    """A key DeepSpeed 0.19 no longer takes (it refuses it too); at its off value it changes nothing."""
    return ("refused", is_off, why + "; DeepSpeed 0.19 has removed it too: delete the key")


MONITOR = ("no effect", "DeepSpeed's monitor; log from the training script")
TOP = {
    "train_batch_size": READ, "train_micro_batch_size_per_gpu": READ, "gradient_accumulation_steps": READ,
    "optimizer": READ, "scheduler": READ, "gradient_clipping": READ, "fp16": READ, "bf16": READ,
    "bfloat16": ("alias", "bf16"),  # DeepSpeed's older name, read when "bf16" is absent
    "zero_optimization": READ, "communication_data_type": READ, "dataloader_drop_last": READ,
    "steps_per_print": ("no effect", "DeepSpeed's progress log; the training script prints what it wants"),
    "wall_clock_breakdown": ("no effect", "DeepSpeed's timers; tiny_zero's are --trace (tiny_zero.measure.trace)"),
    "timers": ("no effect", "DeepSpeed's timers; tiny_zero's are --trace (tiny_zero.measure.trace)"),
    "memory_breakdown": ("no effect", "DeepSpeed's memory log; tiny_zero's is tiny_zero.measure.memory"),
    "dump_state": ("no effect", "DeepSpeed's printout of its own state"),
    "log_level": ("no effect", "DeepSpeed's logger; tiny_zero logs to logging.getLogger('tiny_zero')"),
    "flops_profiler": ("no effect", "a DeepSpeed profiler"),
    "autotuning": ("no effect", "DeepSpeed's autotuner, which its launcher runs"),
    "tensorboard": MONITOR, "wandb": MONITOR, "csv_monitor": MONITOR, "comet": MONITOR,
    "comms_logger": ("no effect", "DeepSpeed's comm log; tiny_zero.comm counts every collective"),
    "zero_allow_untested_optimizer": ("no effect", "tiny_zero steps its own AdamW only"),
    "zero_force_ds_cpu_optimizer": ("no effect", "offload steps tiny_zero's AdamW on the host, whatever this says"),
    "checkpoint": ("no effect", "how DeepSpeed writes checkpoints; tiny_zero's are sharded and reshard on load"),
    "datastates_ckpt": ("no effect", "a DeepSpeed checkpoint engine; tiny_zero writes its own sharded checkpoints"),
    "activation_checkpointing": ("no effect", "configures deepspeed.checkpointing, which a model calls itself"),
    "aio": ("no effect", "NVMe transfers, which tiny_zero does not use"),
    "disable_python_gc": ("no effect", "when DeepSpeed runs Python's garbage collector"),
    "disable_allgather": ("no effect", "DeepSpeed then broadcasts the updated shards: the same values"),
    "vocabulary_size": ("no effect", "DeepSpeed only warns when it is not a multiple of 8"),
    "use_data_before_expert_parallelism": ("no effect", "the order of MoE's process groups; no MoE here"),
    "seq_parallel_communication_data_type": ("no effect", "the dtype of sequence parallelism's sends; "
                                                          "sequence_parallel_size above 1 is refused"),
    "hybrid_engine": ("no effect", "DeepSpeed-Chat's inference kernels for generate(); the training steps are "
                                   "the same, and engine.module.generate runs the module's own forward"),
    "managed_gradient_accumulation": ("refused", lambda v: v is True, "the script, not the engine, marks the "
                                                                      "accumulation boundary"),
    "gradient_allreduce_op": ("refused", lambda v: v == "mean", "grads summed over the ranks, not averaged"),
    "sequence_parallel_size": ("refused", lambda v: v == 1, "Ulysses sequence parallelism"),
    "tensor_parallel": ("refused", lambda v: not v or v.get("autotp_size", 0) <= 1,
                        "DeepSpeed's AutoTP (tiny_zero.tensor is its own, outside initialize)"),
    "expert_parallel": ("refused", enabled_off, "DeepSpeed's AutoEP (mixture of experts)"),
    "torch_autocast": ("refused", enabled_off, "torch.autocast around the forward; use bf16 or fp16"),
    "compile": ("refused", lambda v: not v.get("deepcompile", False), "DeepCompile"),
    "weight_quantization": ("refused", enabled_off, "quantized weights"),
    "prescale_gradients": ("refused", lambda v: v is False, "grads divided before the all-reduce: rounding differs"),
    "gradient_predivide_factor": ("refused", lambda v: v == 1.0, "a split of the average around the all-reduce"),
    "data_types": ("refused", lambda v: all(v.get(k) in (None, "fp32", "auto") for k in ("grad_accum_dtype",
                                                                                            "param_dtype")),
                   "grads accumulated, or parameters kept, in a dtype of their own"),
    "data_efficiency": ("refused", enabled_off, "curriculum learning, data routing"),
    "pipeline": ("refused", lambda v: not v, "DeepSpeed's pipeline engine (tiny_zero.pipeline is its own)"),
    "moe": ("refused", lambda v: not v, "mixture of experts"),  # older DeepSpeed's
    "amp": removed("NVIDIA Apex AMP; use bf16 or fp16"),
    "sparse_gradients": removed("sparse embedding grads", lambda v: v is False),
    "compression_training": removed("quantization and pruning during training", lambda v: not v),
    "curriculum_learning": removed("curriculum learning"),
    "elasticity": removed("elastic batch sizes"),
    "nebula": removed("Nebula checkpoints"),
    "quantize_training": removed("quantization during training"),
    "eigenvalue": removed("eigenvalue-based quantization"),
    "sparse_attention": removed("sparse attention kernels", lambda v: not v),
    "graph_harvesting": removed("graph harvesting", lambda v: v is False),
    "progressive_layer_drop": removed("progressive layer dropping"),
}
OPTIMIZER = {"type": READ, "params": READ, "legacy_fusion": ("no effect", "an old switch of DeepSpeed's fused Adam")}
ADAM = {
    "lr": READ, "betas": READ, "eps": READ, "weight_decay": READ, "adam_w_mode": READ, "torch_adam": READ,
    "bias_correction": ("refused", lambda v: v is True, "Adam without bias correction"),
    "amsgrad": ("refused", lambda v: v is False, "AMSGrad"),
    "foreach": ("no effect", "how torch.optim loops over tensors"),
    "fused": ("no effect", "how torch.optim loops over tensors"),
    "fp32_optimizer_states": ("refused", lambda v: v is True, "optimizer state in a low precision"),
    "maximize": ("refused", lambda v: v is False, "the objective maximised"),
    "decoupled_weight_decay": ("refused", lambda v: v is False, "torch's Adam made AdamW: use type AdamW"),
    "set_grad_none": ("no effect", "tiny_zero's zero_grad sets the grads to None, as torch's"),
    "capturable": ("no effect", "torch.optim's CUDA-graph switch"),
    "differentiable": ("no effect", "torch.optim's autograd through the step"),
}
SCHEDULER = {"type": READ, "params": READ}
SCHEDULER_PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "last_batch_iteration"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"),
}
FP16 = {  # with fp16 off, each key but "enabled" has no effect (tiny_zero/config.py: sort_keys)
    "enabled": READ, "loss_scale": READ, "initial_scale_power": READ, "loss_scale_window": READ,
    "hysteresis": READ, "min_loss_scale": READ,
    "auto_cast": ("refused", lambda v: v is False, "inputs cast to fp16 by the engine"),
    "consecutive_hysteresis": ("refused", lambda v: v is False, "hysteresis restored after each good step"),
    "fp16_master_weights_and_grads": ("refused", lambda v: v is False, "fp16 master weights"),
}
BF16 = {
    "enabled": READ,
    "immediate_grad_update": ("no effect", "when DeepSpeed adds grads into its fp32 copy; tiny_zero reduces in "
                                           "the parameters' dtype and steps fp32 masters, as DeepSpeed's default"),
    "check_grad_overflow": ("no effect", "bf16 has fp32's range: tiny_zero never checks"),
    "bf16_master_weights_and_grads": ("refused", lambda v: v is False, "bf16 master weights"),
    "bf16_optimizer_states": ("refused", lambda v: v is False, "optimizer state in bf16"),
}
WHY_OVERLAP = "tiny_zero always overlaps: each bucket is sent as its last grad is ready"
FREED = "fsdp frees each unit after use"
SAME = "a way to send the same values, for speed"
ZERO = {
    "stage": READ, "offload_optimizer": READ, "offload_param": READ, "reduce_bucket_size": READ,
    "cpu_offload": READ,  # the old name of offload_optimizer.device "cpu"
    "cpu_offload_param": READ,  # the old name of offload_param.device "cpu"
    "cpu_offload_use_pin_memory": ("no effect", "tiny_zero's host buffers are pinned when CUDA is there"),
    "allgather_bucket_size": ("no effect", "tiny_zero all-gathers the same buckets reduce_bucket_size cuts"),
    "overlap_comm": ("no effect", WHY_OVERLAP),
    "contiguous_gradients": ("no effect", "tiny_zero's grads always live in flat buckets"),
    "reduce_scatter": ("no effect", "tiny_zero reduce-scatters always; an all-reduce would give the same average"),
    "allgather_partitions": ("no effect", "tiny_zero all-gathers the updated shards always"),
    "round_robin_gradients": ("no effect", "an order of copies for speed"),
    "load_from_fp32_weights": ("no effect", "tiny_zero's checkpoints hold the fp32 masters and load them"),
    "elastic_checkpoint": ("no effect", "tiny_zero's checkpoints load at any world size"),
    "ignore_unused_parameters": ("no effect", "unused parameters get no step, as torch DDP's "
                                              "find_unused_parameters=True"),
    "use_multi_rank_bucket_allreduce": ("no effect", "an all-reduce schedule"),
    "stage3_prefetch_bucket_size": ("no effect", "fsdp prefetches the next unit (a block)"),
    "prefetch_bucket_size": ("alias", "stage3_prefetch_bucket_size"),
    "stage3_max_live_parameters": ("no effect", FREED), "max_live_parameters": ("alias", "stage3_max_live_parameters"),
    "stage3_max_reuse_distance": ("no effect", FREED), "max_reuse_distance": ("alias", "stage3_max_reuse_distance"),
    "stage3_param_persistence_threshold": ("no effect", "fsdp slices every tensor; keeping small ones whole "
                                                        "gives the same numbers"),
    "param_persistence_threshold": ("alias", "stage3_param_persistence_threshold"),
    "stage3_model_persistence_threshold": ("no effect", "as stage3_param_persistence_threshold"),
    "model_persistence_threshold": ("alias", "stage3_model_persistence_threshold"),
    "stage3_gather_16bit_weights_on_model_save": ("no effect", "engine.save_16bit_model gathers the whole weights "
                                                               "at any stage"),
    "gather_16bit_weights_on_model_save": ("alias", "stage3_gather_16bit_weights_on_model_save"),
    "stage3_gather_fp16_weights_on_model_save": ("alias", "stage3_gather_16bit_weights_on_model_save"),
    "stage3_module_granularity_threshold": ("no effect", "fsdp gathers a unit (a block) whole anyway"),
    "module_granularity_threshold": ("alias", "stage3_module_granularity_threshold"),
    "stage3_use_all_reduce_for_fetch_params": ("no effect", SAME),
    "use_all_reduce_for_fetch_params": ("alias", "stage3_use_all_reduce_for_fetch_params"),
    "stage3_allgather_sequential": ("no effect", SAME),
    "allgather_sequential": ("alias", "stage3_allgather_sequential"),
    "leaf_module": ("no effect", "fsdp gathers a unit (a block) whole anyway"),
    "sub_group_size": ("no effect", "the size of DeepSpeed's optimizer steps"),
    "memory_efficient_linear": ("no effect", "fsdp's layers free what they gathered anyway"),
    "zero_hpz_partition_size": ("no effect", "a second copy of the parameters within a node, for speed"),
    "parameter_alignment": ("no effect", "padding of DeepSpeed's flat buffers"),
    "pipeline_loading_checkpoint": ("no effect", "a DeepSpeed pipeline-engine detail"),
    "override_module_apply": ("no effect", "how DeepSpeed's zero.Init patches module.apply"),
    "log_trace_cache_warnings": ("no effect", "a DeepSpeed log"),
    "enable_sanity_checks": ("no effect", "DeepSpeed's own checks"),
    "save_muon_momentum_buffer_in_memory": ("no effect", "for DeepSpeed's Muon optimizer, which tiny_zero refuses"),
    "compute_grad_norm": ("refused", lambda v: v is True, "no grad norm computed"),
    "zenflow": ("refused", lambda v: not v, "ZenFlow's delayed updates"),
    "zero_quantized_weights": ("refused", lambda v: v is False, "quantized weights (ZeRO++)"),
    "zero_quantized_nontrainable_weights": ("refused", lambda v: v is False, "quantized weights (ZeRO++)"),
    "zero_quantized_gradients": ("refused", lambda v: v is False, "quantized gradients (ZeRO++)"),
    "legacy_stage1": ("refused", lambda v: v is False, "DeepSpeed's old stage 1"),
    "mics_shard_size": removed("MiCS sharding groups", lambda v: v in (-1, None)),
    "mics_hierarchical_params_gather": removed("MiCS sharding groups", lambda v: v is False),
    "zeropp_loco_param": removed("LoCo-ZeRO++", lambda v: not v),
}
OFFLOAD = {  # offload_optimizer
    "device": READ,
    "pin_memory": ("no effect", "tiny_zero's host buffers are pinned when CUDA is there"),
    "buffer_count": ("no effect", "DeepSpeed's NVMe buffers"),
    "fast_init": ("no effect", "DeepSpeed's NVMe start"),
    "pipeline_read": ("no effect", "DeepSpeed's NVMe transfers"), "pipeline_write": ("no effect", "as pipeline_read"),
    "cpuadam_cores_perc": ("no effect", "the cores DeepSpeed's CPU Adam uses"),
    "ratio": ("refused", lambda v: v == 1.0, "a part of the optimizer offloaded"),
    "super_offload": ("refused", lambda v: v is False, "SuperOffload's speculative steps"),
    "nvme_path": ("refused", lambda v: v is None, "NVMe offload"),
}
OFFLOAD_PARAM = {
    "device": READ,
    "pin_memory": ("no effect", "tiny_zero's host buffers are pinned when CUDA is there"),
    "buffer_count": ("no effect", "DeepSpeed's NVMe buffers"), "buffer_size": ("no effect", "DeepSpeed's NVMe buffers"),
    "max_in_cpu": ("no effect", "DeepSpeed's NVMe buffers"),
    "nvme_path": ("refused", lambda v: v is None, "NVMe offload"),
}
