"""Pre-training loop on megatron-core's own parts: parallel_state, GPTModel, DDP (optionally
with the distributed optimizer), get_megatron_optimizer with the IWD rules, the pipeline
schedules, OptimizerParamScheduler and dist_checkpointing.

``main(argv)`` runs in-process (tests call it on forked gloo ranks) or under ``torchrun``; with
no process group and no torchrun environment it starts a one-rank group itself. No GPU: the CPU
compatibility layer is switched on and the backend is gloo.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import sys
import time

import torch

from megatron_scalevec.compat.cpu import enable_cpu_compat
from megatron_scalevec.training.arguments import ArgumentError, parse_args


def _world_size_hint() -> int:
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _init_distributed(args) -> bool:
    """Join (or start) the default process group. Returns True if we created it."""
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_initialized():
        return False
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" in os.environ:  # torchrun
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
        return True
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    return True


def _transformer_config(args, vocab_size):
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    moe = {}
    if args.num_experts:
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                   moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                   moe_layer_freq=args.moe_layer_freq,
                   moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                   moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                   moe_router_load_balancing_type="aux_loss", moe_grouped_gemm=False)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel, normalization=args.normalization,
        qk_layernorm=args.qk_layernorm, init_method_std=args.init_method_std,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=args.bf16, params_dtype=dtype,
        pipeline_dtype=dtype, use_cpu_initialization=not torch.cuda.is_available(),
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, calculate_per_token_loss=False,
        transformer_impl=args.transformer_impl, fp8=args.fp8_format, **moe)


def _layer_spec(args):
    """megatron-core's own spec for ``baseline``; otherwise the same lazy block ModuleSpec that
    Megatron-LM's ``--spec megatron_scalevec.specs scalevec_moe`` imports (sized inside
    ``specs.building``)."""
    if args.spec == "baseline":
        from megatron.core.models.gpt import gpt_layer_specs  # noqa: PLC0415

        if args.transformer_impl == "transformer_engine":
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=args.num_experts, moe_grouped_gemm=False,
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

    vpp = args.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for i in range(vpp):
        vp_stage = i if vpp > 1 else None
        with building(config, vp_stage):
            m = GPTModel(config, _layer_spec(args), vocab_size=vocab_size,
                         max_sequence_length=args.max_position_embeddings,
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False,
                                                                vp_stage=vp_stage),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False,
                                                                vp_stage=vp_stage),
                         share_embeddings_and_output_weights=not
                         args.untie_embeddings_and_output_weights,
                         position_embedding_type="rope", vp_stage=vp_stage)
        if torch.cuda.is_available():
            m.cuda(torch.cuda.current_device())
        if args.bf16:
            m = Float16Module(config, m)
        chunks.append(m)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer, check_for_nan_in_grad=False)
    return [DistributedDataParallel(config, ddp_config, m,
                                    disable_bucketing=(i > 0)) for i, m in enumerate(chunks)]


def _scheduler(args, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: PLC0415

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters, wd_incr_style="constant",
        wsd_decay_steps=args.lr_wsd_decay_iters, lr_wsd_decay_style=args.lr_wsd_decay_style)


def _data(args):
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
            split=args.split, cache_dir=args.data_cache_path)
    return train, valid, tok.vocab_size, data.make_batch_iterator


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    dev = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    tokens, labels = batch["tokens"].to(dev), batch["labels"].to(dev)
    mask = batch["loss_mask"].to(dev).float()
    output = model(tokens, batch["position_ids"].to(dev), None, labels=labels)
    return output, functools.partial(_loss_func, mask)


def _loss_func(mask, output):
    loss = (output.float().view(-1) * mask.view(-1)).sum() / mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides loss in place


def _mean_loss(losses, device) -> float:
    """Average the last stage's micro-batch losses over the data-parallel replicas."""
    import torch.distributed as dist  # noqa: PLC0415
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    buf = torch.zeros(2, dtype=torch.float64, device=device)
    if losses and ps.get_tensor_model_parallel_rank() == 0:
        buf[0] = float(torch.stack([d["lm loss"] for d in losses]).float().mean())
        buf[1] = 1.0
    dist.all_reduce(buf)
    return float(buf[0] / buf[1])


class Trainer:
    """Holds model, optimizer, scheduler and data position; ``train()`` runs the loop."""

    def __init__(self, args):
        from megatron.core import parallel_state as ps  # noqa: PLC0415
        from megatron.core.distributed import finalize_model_grads  # noqa: PLC0415
        from megatron.core.optimizer import OptimizerConfig  # noqa: PLC0415
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa

        from megatron_scalevec.optim import build_optimizer  # noqa: PLC0415
        from megatron_scalevec.training.monitor import MetricsLog  # noqa: PLC0415

        self.args = a = args
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=a.tensor_model_parallel_size,
            pipeline_model_parallel_size=a.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=a.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=a.expert_model_parallel_size,
            expert_tensor_parallel_size=a.expert_tensor_parallel_size)
        torch.manual_seed(a.seed)
        model_parallel_cuda_manual_seed(a.seed)
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.log = MetricsLog(a.run_dir, a.tensorboard_dir, a.quiet, append=a.load is not None)
        self.train_ds, self.valid_ds, vocab, self.make_iter = _data(a)
        self.vocab_size = vocab
        self.config = _transformer_config(a, vocab)
        self.model = build_model(a, self.config, vocab)
        opt_cfg = OptimizerConfig(
            optimizer="adam" if a.optimizer == "muon" else a.optimizer, lr=a.lr, min_lr=a.min_lr,
            weight_decay=a.weight_decay, adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2,
            adam_eps=a.adam_eps, clip_grad=a.clip_grad, bf16=a.bf16,
            params_dtype=self.config.params_dtype,
            use_distributed_optimizer=a.use_distributed_optimizer)
        self.optimizer = build_optimizer(opt_cfg, self.model, a.scalevec_config,
                                         use_muon=a.optimizer == "muon", log=self.log.print)
        self.scheduler = _scheduler(a, self.optimizer)
        cfg = self.config
        cfg.finalize_model_grads_func = finalize_model_grads
        cfg.grad_scale_func = self.optimizer.scale_loss
        no_sync = [m.no_sync for m in self.model]
        cfg.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        self.iteration, self.consumed = 0, 0
        self.meta = dict(spec=a.spec, num_layers=a.num_layers, hidden_size=a.hidden_size,
                         num_attention_heads=a.num_attention_heads,
                         num_query_groups=a.num_query_groups, vocab_size=vocab,
                         num_experts=a.num_experts)
        got = None
        if a.load and not a.finetune and os.path.isdir(a.load):
            from megatron_scalevec.training.checkpointing import load_checkpoint  # noqa

            got = load_checkpoint(a.load, self.model, self.optimizer, self.scheduler,
                                  a.scalevec_config.to_string(), self.meta,
                                  load_optim=not a.no_load_optim)
            if got is None and a.pretrained_checkpoint is None:
                self.log.print(f"no checkpoint in {a.load}: training from scratch")
            elif got is not None:
                self.iteration, self.consumed = got
                self.log.print(f"resumed from {a.load} at iteration {self.iteration} "
                               f"({self.consumed} samples consumed)")
        if got is None:  # --pretrained-checkpoint / --finetune: training/pretrained.py
            from megatron_scalevec.training.pretrained import start_from_weights  # noqa

            line = start_from_weights(a, self.model, self.optimizer, vocab)
            if line:
                self.log.print(line)

    def _iters(self, dataset, consumed):
        from megatron.core import parallel_state as ps  # noqa: PLC0415

        a = self.args
        mk = functools.partial(self.make_iter, dataset, a.micro_batch_size,
                               ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                               consumed, a.seed)
        its = [mk() for _ in self.model]
        return its[0] if len(its) == 1 else its

    def _run(self, iterator, forward_only):
        from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415

        a = self.args
        return get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iterator,
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=a.num_microbatches, seq_length=a.seq_length,
            micro_batch_size=a.micro_batch_size, forward_only=forward_only)

    def train_step(self, iterator):
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._run(iterator, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        return _mean_loss(losses, self.device), float(grad_norm or 0.0)

    @torch.no_grad()
    def evaluate(self):
        if self.valid_ds is None:
            return None
        for m in self.model:
            m.eval()
        it = self._iters(self.valid_ds, 0)
        vals = [_mean_loss(self._run(it, forward_only=True), self.device)
                for _ in range(self.args.eval_iters)]
        for m in self.model:
            m.train()
        return sum(vals) / len(vals)

    def save(self):
        from megatron_scalevec.training.checkpointing import save_checkpoint  # noqa: PLC0415
        from megatron_scalevec.training.pretrained import checkpoint_files  # noqa: PLC0415

        save_checkpoint(self.args.save, self.iteration, self.model, self.optimizer,
                        self.scheduler, self.consumed, self.args.scalevec_config.to_string(),
                        self.meta, extra_files=checkpoint_files(self))
        self.log.print(f"saved checkpoint iteration {self.iteration} to {self.args.save}")

    def train(self) -> list:
        """Run to --train-iters (or --exit-interval); returns the per-iteration losses."""
        from megatron_scalevec.training.monitor import (  # noqa: PLC0415
            Throughput,
            format_line,
            scale_vector_stats,
        )

        a = self.args
        end = min(a.train_iters, a.exit_interval or a.train_iters)
        it = self._iters(self.train_ds, self.consumed)
        tokens = a.global_batch_size * a.seq_length
        speed = Throughput(tokens, a.train_iters, self.iteration)
        losses, window = [], []
        for m in self.model:
            m.train()
        while self.iteration < end:
            loss, gnorm = self.train_step(it)
            self.iteration += 1
            self.consumed += a.global_batch_size
            losses.append(loss)
            window.append(loss)
            last = self.iteration == end
            evaluate = bool(a.eval_interval) and (self.iteration % a.eval_interval == 0 or last)
            rec = None
            if evaluate or last or self.iteration % a.log_interval == 0 or self.iteration == 1:
                rec = dict(iteration=self.iteration, train_iters=a.train_iters,
                           loss=sum(window) / len(window), loss_last=loss,
                           lr=self.scheduler.get_lr(self.optimizer.param_groups[0]),
                           grad_norm=gnorm, consumed_samples=self.consumed,
                           **speed.update(self.iteration))
                window = []
                if evaluate and self.valid_ds is not None:
                    rec["val_loss"] = self.evaluate()
            if rec is not None:
                rec.update(scale_vector_stats(self.model))
                self.log.write(rec)
                self.log.print(format_line(rec))
            if a.save and ((a.save_interval and self.iteration % a.save_interval == 0)
                           or last):
                self.save()
        return losses


def _plot(args, log):
    try:
        from megatron_scalevec.training.plotting import plot_runs  # noqa: PLC0415

        out = os.path.join(args.run_dir, "loss.png")
        plot_runs([args.run_dir], out)
        log.print(f"wrote {out}")
    except ImportError as e:
        log.print(f"no loss plot ({e}); metrics are in {log.path}")


def main(argv=None) -> list:
    """Entry point (console script ``megatron-scalevec-pretrain``). Returns the losses."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, world_size=_world_size_hint())  # raises before any output
    enable_cpu_compat()
    import torch.distributed as dist  # noqa: PLC0415

    started = time.time()
    created = _init_distributed(args)
    args = parse_args(argv, world_size=dist.get_world_size())
    try:
        trainer = Trainer(args)
        losses = trainer.train()
        if dist.get_rank() == 0 and not args.no_plot:
            _plot(args, trainer.log)
        trainer.log.print(f"done in {time.time() - started:.1f} s")
        trainer.log.close()
        return losses
    finally:
        if created:
            from megatron.core import parallel_state as ps  # noqa: PLC0415

            ps.destroy_model_parallel()
            dist.destroy_process_group()


def cli() -> None:
    try:
        main()
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
