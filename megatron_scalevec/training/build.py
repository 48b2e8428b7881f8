"""Building what the trainer trains: the TransformerConfig from the flags, the layer spec,
the GPTModel chunks in megatron-core DDP, the LR scheduler and the datasets."""

from __future__ import annotations

import functools

import torch

from megatron_scalevec.convert.arch import STOCK, ModelArch


def run_arch(args, vocab_size: int) -> ModelArch:
    """The :class:`ModelArch` of the model :func:`build_model` builds from ``args`` (the one
    reading of the model flags; the config and the checkpoints' arch file both come from it)."""
    moe = {}
    if args.num_experts:
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                   moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                   moe_layer_freq=args.moe_layer_freq, expert_vectors=args.expert_vectors,
                   moe_router_pre_softmax=args.moe_router_pre_softmax)
    return ModelArch(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=vocab_size, max_sequence_length=args.max_position_embeddings,
        normalization=args.normalization, qk_layernorm=args.qk_layernorm,
        layernorm_epsilon=args.norm_epsilon, rotary_base=float(args.rotary_base),
        tie_embeddings=not args.untie_embeddings_and_output_weights,
        scalevec=STOCK if args.spec == "baseline" else args.scalevec_config.to_string(),
        layernorm_bias=args.scalevec_config.layernorm_bias, **moe)


def transformer_config(args, vocab_size):
    """The architecture from :func:`run_arch`; the rest (layout, dtype, fusions off, MoE
    dispatch and aux loss) from the training flags."""
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    moe = {}
    if args.num_experts:
        moe = dict(moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                   moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                   moe_router_load_balancing_type="aux_loss",
                   moe_grouped_gemm=args.moe_grouped_gemm)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        **run_arch(args, vocab_size).config_kwargs(),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        # As Megatron-LM under VPP: p2p unbatched. Batched, the interleaved schedule at PP2
        # sends an activation and a gradient to the one peer in one batch_isend_irecv, and
        # gloo matches the two same-shaped messages crosswise (tests/parity/test_layouts.py).
        batch_p2p_comm=not args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel, init_method_std=args.init_method_std,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=args.bf16, params_dtype=dtype,
        pipeline_dtype=dtype, use_cpu_initialization=not torch.cuda.is_available(),
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, calculate_per_token_loss=False,
        transformer_impl=args.transformer_impl, fp8=args.fp8_format, **_fp8(args), **moe)


def _fp8(args) -> dict:
    """Megatron-LM's FP8 flags as TransformerConfig fields (as Megatron-LM passes them)."""
    if not args.fp8_format:
        return {}
    return dict(fp8_recipe=args.fp8_recipe, fp8_margin=args.fp8_margin,
                fp8_amax_history_len=args.fp8_amax_history_len,
                fp8_amax_compute_algo=args.fp8_amax_compute_algo)


def _layer_spec(args):
    """megatron-core's own spec for ``baseline``; otherwise the same lazy block ModuleSpec that
    Megatron-LM's ``--spec megatron_scalevec.megatron_lm_spec scalevec_moe`` imports (sized in
    ``specs.building``)."""
    if args.spec == "baseline":
        from megatron.core.models.gpt import gpt_layer_specs  # noqa: PLC0415

        if args.transformer_impl == "transformer_engine":
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
                qk_layernorm=args.qk_layernorm)
        return gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=args.num_experts, moe_grouped_gemm=False,
            qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    from megatron_scalevec.specs import block_module_spec  # noqa: PLC0415

    return block_module_spec(args.scalevec_config)


def build_model(args, config, vocab_size):
    """GPTModel chunks (one per virtual pipeline stage), wrapped in megatron-core DDP."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415
    from megatron.core.distributed import (  # noqa: PLC0415
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: PLC0415
    from megatron.core.transformer.module import Float16Module  # noqa: PLC0415

    from megatron_scalevec.specs import building  # noqa: PLC0415

    arch = run_arch(args, vocab_size).model_kwargs()
    vpp = args.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for i in range(vpp):
        vp_stage = i if vpp > 1 else None
        with building(config, vp_stage):
            m = GPTModel(config, _layer_spec(args), **arch,
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False,
                                                                vp_stage=vp_stage),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False,
                                                                vp_stage=vp_stage),
                         vp_stage=vp_stage)
        if torch.cuda.is_available():
            m.cuda(torch.cuda.current_device())
        if args.bf16:
            m = Float16Module(config, m)
        chunks.append(m)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        align_param_gather=args.align_param_gather, bucket_size=args.ddp_bucket_size,
        use_distributed_optimizer=args.use_distributed_optimizer, check_for_nan_in_grad=False)
    return [DistributedDataParallel(config, ddp_config, m,
                                    disable_bucketing=(i > 0)) for i, m in enumerate(chunks)]


def scheduler_values(args) -> dict:
    """This run's schedule as megatron-core's ``OptimizerParamScheduler.state_dict()`` names
    it (without ``num_steps``), to compare with a checkpoint's before anything is built."""
    return dict(max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
                lr_decay_steps=args.lr_decay_iters, lr_decay_style=args.lr_decay_style,
                start_wd=args.weight_decay, end_wd=args.weight_decay,
                wd_incr_style="constant", wd_incr_steps=args.train_iters)


def scheduler(args, optimizer, use_checkpoint: bool = True):
    """megatron-core's scheduler; on a resume ``use_checkpoint`` keeps the checkpoint's values
    (Megatron-LM's --use-checkpoint-opt_param-scheduler) and --override-opt_param-scheduler
    replaces them with this run's (the trainer has checked which applies before the build)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: PLC0415

    override = bool(args.override_opt_param_scheduler)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters, wd_incr_style="constant",
        wsd_decay_steps=args.lr_wsd_decay_iters, lr_wsd_decay_style=args.lr_wsd_decay_style,
        use_checkpoint_opt_param_scheduler=use_checkpoint and not override,
        override_opt_param_scheduler=override)


def datasets(args):
    """(train_ds, valid_ds, vocab_size, make_iterator) from training/data.py, else megatron's
    MockGPTDataset behind the same call."""
    n_train = args.train_iters * args.global_batch_size
    n_valid = (args.train_iters // max(args.eval_interval, 1) + 2) * args.eval_iters * \
        args.global_batch_size
    try:
        from megatron_scalevec.training import data  # noqa: PLC0415
    except ImportError:
        data = None
    if data is None or args.mock_data:
        from megatron_scalevec.training import mock_data as data  # noqa: PLC0415

        train, valid, tok = data.build_datasets(
            None, None, args.seq_length, args.seed, n_train, n_valid, split=args.split,
            vocab_size=args.vocab_size or 512)
    else:
        train, valid, tok = data.build_datasets(
            args.data_path, args.tokenizer_model, args.seq_length, args.seed, n_train, n_valid,
            split=args.split, cache_dir=args.data_cache_path,
            log=None if args.quiet else functools.partial(print, flush=True))
    return train, valid, tok.vocab_size, data.make_batch_iterator
