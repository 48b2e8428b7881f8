"""Pre-training loop on megatron-core's own parts: parallel_state, GPTModel, DDP (optionally
with the distributed optimizer), get_megatron_optimizer with the IWD rules, the pipeline
schedules, OptimizerParamScheduler and dist_checkpointing.

``main(argv)`` runs in-process (tests call it on forked gloo ranks) or under ``torchrun``; with
no process group and no torchrun environment it starts a one-rank group itself. No GPU: the CPU
compatibility layer is switched on and the backend is gloo.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import signal
import sys
import time

import torch

from megatron_scalevec.compat.cpu import enable_cpu_compat
from megatron_scalevec.training import faults, report, summary
from megatron_scalevec.training.arguments import ArgumentError, parse_args
from megatron_scalevec.training.build import (
    build_model,
    datasets,
    scheduler,
    transformer_config,
)


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
        dist.init_process_group(
            backend, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
        return True
    # one process: an in-process store, no port (a free port picked, released and bound
    # again can be taken in between by another process on a busy machine)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


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


class NothingToTrain(Exception):
    """The checkpoint to resume is already at --train-iters: say so, write nothing, exit 0."""


class Trainer:
    """Holds model, optimizer, scheduler and data position; ``train()`` runs the loop."""

    def __init__(self, args):
        from megatron.core import parallel_state as ps  # noqa: PLC0415
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa

        from megatron_scalevec.training import checkpointing  # noqa: PLC0415
        from megatron_scalevec.training.monitor import MetricsLog  # noqa: PLC0415

        self.args = a = args
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=a.tensor_model_parallel_size,
            pipeline_model_parallel_size=a.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=a.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=a.expert_model_parallel_size,
            expert_tensor_parallel_size=a.expert_tensor_parallel_size,
            distributed_timeout_minutes=a.distributed_timeout_minutes)
        torch.manual_seed(a.seed)
        model_parallel_cuda_manual_seed(a.seed)
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.train_ds, self.valid_ds, vocab, self.make_iter = datasets(a)
        self.vocab_size = vocab
        self.iteration, self.consumed = 0, 0
        self.meta = dict(spec=a.spec, num_layers=a.num_layers, hidden_size=a.hidden_size,
                         num_attention_heads=a.num_attention_heads,
                         num_query_groups=a.num_query_groups, vocab_size=vocab,
                         num_experts=a.num_experts, kv_channels=a.kv_channels,
                         ffn_hidden_size=a.ffn_hidden_size,
                         moe_ffn_hidden_size=a.moe_ffn_hidden_size if a.num_experts else None,
                         untie_embeddings_and_output_weights=a.untie_embeddings_and_output_weights,
                         normalization=a.normalization, qk_layernorm=a.qk_layernorm,
                         expert_vectors=a.expert_vectors if a.num_experts else None,
                         norm_epsilon=a.norm_epsilon, rotary_base=a.rotary_base,
                         moe_router_pre_softmax=bool(a.moe_router_pre_softmax))
        # Everything that can refuse this run is checked before anything is written.
        found, use_ckpt_schedule, schedule_line = self._check_start(checkpointing)
        self.log = MetricsLog(a.run_dir, a.tensorboard_dir, a.quiet,
                              append=found is not None)
        try:
            self._build(a, found, use_ckpt_schedule, schedule_line)
        except BaseException:
            self.log.discard()  # a refusal (or any failure) before training leaves nothing
            raise
        if found is not None:
            dropped = self.log.drop_after(self.iteration)
            if dropped:
                self.log.print(f"metrics.jsonl: {dropped} row(s) past iteration "
                               f"{self.iteration} (the stopped run's) dropped; this run "
                               f"writes them again")

    def _check_start(self, checkpointing):
        """The checkpoint to resume and the schedule rule (checkpointing.py), or the weights to
        start from (pretrained.py): refused in one line before anything is created."""
        from megatron_scalevec.training.build import scheduler_values  # noqa: PLC0415

        a = self.args
        found = None
        if a.load and not a.finetune and os.path.isdir(a.load):  # before the build: cheap
            found = checkpointing.inspect_checkpoint(
                a.load, a.scalevec_config.to_string(), self.meta,
                verify=not a.no_verify_checkpoint)
        if found is None:
            from megatron_scalevec.training.pretrained import check_source  # noqa: PLC0415

            self.pretrained_src = check_source(a, self.vocab_size)
            return None, True, None
        iteration = found[2].get("iteration", 0)
        end = min(a.train_iters, a.exit_interval or a.train_iters)
        if iteration >= end:
            if a.exit_interval and iteration < a.train_iters:
                how = f"drop --exit-interval {a.exit_interval} to continue"
            else:
                how = ("pass a larger --train-iters with --override-opt_param-scheduler (an LR "
                       "schedule over the new length) or --use-checkpoint-opt_param-scheduler "
                       "(the checkpoint's) to continue")
            stop = f", --exit-interval {a.exit_interval}" if a.exit_interval else ""
            raise NothingToTrain(f"nothing to train: {found[0]} is at iteration {iteration}, "
                                 f"--train-iters {a.train_iters}{stop} ({how})")
        if a.no_load_optim:
            return found, True, None
        checkpointing.check_vector_lr(found[0], found[2], a.scalevec_config.vector_lr_mult)
        use, line = checkpointing.schedule_on_resume(
            found[0], found[2].get("opt_param_scheduler"), scheduler_values(a),
            a.override_opt_param_scheduler, a.use_checkpoint_opt_param_scheduler)
        return found, use, line

    def _build(self, a, found, use_ckpt_schedule, schedule_line):
        from megatron.core.distributed import finalize_model_grads  # noqa: PLC0415
        from megatron.core.optimizer import OptimizerConfig  # noqa: PLC0415

        from megatron_scalevec.optim import build_optimizer  # noqa: PLC0415
        from megatron_scalevec.training import checkpointing  # noqa: PLC0415
        from megatron_scalevec.training.monitor import vector_sites  # noqa: PLC0415

        vocab = self.vocab_size
        self.log.write_config(a)
        self.config = transformer_config(a, vocab)
        self.model = build_model(a, self.config, vocab)
        self.log.write_json("vectors.json", vector_sites(self.model))  # where each acts: plots
        opt_cfg = OptimizerConfig(
            optimizer="adam" if a.optimizer == "muon" else a.optimizer, lr=a.lr, min_lr=a.min_lr,
            weight_decay=a.weight_decay, adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2,
            adam_eps=a.adam_eps, clip_grad=a.clip_grad, bf16=a.bf16,
            params_dtype=self.config.params_dtype,
            use_distributed_optimizer=a.use_distributed_optimizer)
        self.optimizer = build_optimizer(opt_cfg, self.model, a.scalevec_config,
                                         use_muon=a.optimizer == "muon", log=self.log.print)
        self.scheduler = scheduler(a, self.optimizer, use_checkpoint=use_ckpt_schedule)
        cfg = self.config
        # megatron-core's micro-batch calculator, as Megatron-LM sets it up: the folded linears
        # read it to map their gradient once per step (layers/fold.py StepMap)
        from megatron.core import num_microbatches_calculator as calc  # noqa: PLC0415
        from megatron.core import parallel_state as ps  # noqa: PLC0415

        calc.unset_num_microbatches_calculator()
        calc.init_num_microbatches_calculator(
            ps.get_data_parallel_rank(), None, a.global_batch_size, a.micro_batch_size,
            ps.get_data_parallel_world_size())
        cfg.finalize_model_grads_func = finalize_model_grads
        cfg.grad_scale_func = self.optimizer.scale_loss
        no_sync = [m.no_sync for m in self.model]
        cfg.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if a.align_param_gather:  # as Megatron-LM: the schedule dispatches the all-gathers
            syncs = [m.start_param_sync for m in self.model]
            cfg.param_sync_func = syncs[0] if len(syncs) == 1 else syncs
        if a.load and found is None and a.pretrained_checkpoint is None and not a.finetune:
            self.log.print(f"no checkpoint in {a.load}: training from scratch")
        elif found is not None:
            self.iteration, self.consumed = checkpointing.load_checkpoint(
                found, self.model, self.optimizer, self.scheduler,
                a.scalevec_config.to_string(), self.meta, load_optim=not a.no_load_optim)
            verified = ("not verified (no manifest)" if found[1] is None else
                        "sizes verified" if a.no_verify_checkpoint else "checksums verified")
            self.log.print(f"resumed from {found[0]} at iteration {self.iteration} "
                           f"({self.consumed} samples consumed; {verified})")
            if schedule_line:
                self.log.print(schedule_line)
        if found is None:  # --pretrained-checkpoint / --finetune: training/pretrained.py
            from megatron_scalevec.training.pretrained import start_from_weights  # noqa

            line = start_from_weights(a, self.model, self.optimizer, vocab,
                                      self.pretrained_src)
            if line:
                self.log.print(line)

    def print_summary(self, folded_warnings) -> None:
        note = summary.backend_note(folded_warnings)
        if note:
            self.log.print(note)
        self.log.print(summary.arguments_block(self.args))
        self.log.print(summary.layout_line(self.args))
        self.log.print(summary.parameter_line(*summary.parameter_counts(self.model,
                                                                        self.device)))
        from megatron_scalevec.invariance import invariant_magnitudes, summary_line  # noqa

        a, sv = self.args, self.args.scalevec_config
        wd = (a.scale_vector_weight_decay if a.scale_vector_weight_decay is not None
              else a.weight_decay) if sv.iwd else 0.0
        names = [n for m in self.model for n in invariant_magnitudes(m)]
        line = summary_line(names, a.lr * sv.vector_lr_mult, wd,  # they learn at the vectors' LR
                            self.config.layernorm_epsilon, a.train_iters)
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
        """One step; with --check-for-nan-in-loss-and-grad a non-finite loss or gradient on
        any rank raises DivergenceError before the optimizer touches the parameters."""
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._run(iterator, forward_only=False)
        loss = _mean_loss(losses, self.device)
        if self.args.check_for_nan_in_loss_and_grad:
            faults.check_step(self.model, loss, self.iteration + 1, self.device)
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        return loss, float(grad_norm or 0.0)

    @contextlib.contextmanager
    def params_synced(self):
        """With --overlap-param-gather the parameters are gathered by forward pre-hooks of
        the next training forward: finish the gather now and keep the hooks off inside (an
        evaluation, a checkpoint), as Megatron-LM does."""
        if not self.args.overlap_param_gather:
            yield
            return
        for m in self.model:
            m.disable_forward_pre_hook()  # with a synchronous all-gather
        try:
            yield
        finally:
            for m in self.model:
                m.enable_forward_pre_hook()

    @torch.no_grad()
    def evaluate(self):
        if self.valid_ds is None:
            return None
        with self.params_synced():
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

        with self.params_synced():
            if not faults.params_finite(self.model, self.device):
                raise faults.DivergenceError(
                    f"parameters are non-finite at iteration {self.iteration}: not writing a "
                    f"checkpoint to {self.args.save}; 'latest' still points to the last good "
                    f"one")
            with faults.interrupts_held():  # Ctrl-C: after the save is published
                save_checkpoint(self.args.save, self.iteration, self.model, self.optimizer,
                                self.scheduler, self.consumed,
                                self.args.scalevec_config.to_string(), self.meta,
                                extra_files=checkpoint_files(self),
                                optim_meta=dict(
                                    vector_lr_mult=self.args.scalevec_config.vector_lr_mult))
        self.log.print(f"saved checkpoint iteration {self.iteration} to {self.args.save}")

    def _record(self, loss, gnorm, window, speed, evaluate):
        a = self.args
        rec = dict(iteration=self.iteration, train_iters=a.train_iters,
                   loss=sum(window) / len(window), loss_last=loss,
                   lr=self.scheduler.get_lr(self.optimizer.param_groups[0]),
                   grad_norm=gnorm, consumed_samples=self.consumed,
                   **speed.update(self.iteration))
        if evaluate and self.valid_ds is not None:
            rec["val_loss"] = self.evaluate()
        return rec

    def train(self) -> list:
        """Run to --train-iters (or --exit-interval); returns the per-iteration losses."""
        from megatron_scalevec.training.monitor import scale_vector_stats  # noqa: PLC0415

        a = self.args
        end = min(a.train_iters, a.exit_interval or a.train_iters)
        it = self._iters(self.train_ds, self.consumed)
        speed = summary.Throughput(a.global_batch_size * a.seq_length, a.train_iters,
                                   self.iteration)
        losses, window = [], []
        for m in self.model:
            m.train()
        while self.iteration < end:
            try:
                loss, gnorm = self.train_step(it)
            except faults.DivergenceError as e:
                nan = float("nan")
                self.log.write(dict(iteration=self.iteration + 1, train_iters=a.train_iters,
                                    loss=getattr(e, "loss", nan), diverged=str(e),
                                    grad_norm=nan if not getattr(e, "grads_finite", 1) else 0.0))
                raise
            self.iteration += 1
            self.consumed += a.global_batch_size
            losses.append(loss)
            window.append(loss)
            last = self.iteration == end
            evaluate = bool(a.eval_interval) and (self.iteration % a.eval_interval == 0 or last)
            if evaluate or last or self.iteration % a.log_interval == 0 or self.iteration == 1:
                rec = self._record(loss, gnorm, window, speed, evaluate)
                window = []
                with self.params_synced():
                    rec.update(scale_vector_stats(self.model))
                self.log.write(rec)
                self.log.print(summary.format_line(rec))
            if a.save and ((a.save_interval and self.iteration % a.save_interval == 0)
                           or last):
                self.save()
        return losses


def _parse_once(argv, world_size: int):
    """parse_args; on one node every rank reads the same flags and files and fails alike, so
    rank 0 alone prints the refusal (``collective``)."""
    try:
        return parse_args(argv, world_size=world_size)
    except ArgumentError as e:
        e.collective = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
        raise


def main(argv=None) -> list:
    """Entry point (console script ``megatron-scalevec-pretrain``). Returns the losses."""
    with summary.library_deprecations_silenced():
        return _main(argv)


def _main(argv) -> list:
    from megatron_scalevec.training.ckpt_guard import CheckpointError  # noqa: PLC0415
    from megatron_scalevec.training.pretrained import PretrainedError  # noqa: PLC0415

    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse_once(argv, _world_size_hint())  # raises before any output
    faults.kill_children_with_parent()  # checkpoint writer processes die with us
    folded = []
    with summary.folded_backend_warnings(folded):
        enable_cpu_compat()
    import torch.distributed as dist  # noqa: PLC0415

    started = time.time()
    created = _init_distributed(args)
    args = _parse_once(argv, dist.get_world_size())
    if args.fused_compile is not None:
        from megatron_scalevec import compile  # noqa: PLC0415

        compile.set_mode(args.fused_compile)
    trainer = None
    try:
        try:
            with summary.folded_backend_warnings(folded):
                trainer = Trainer(args)
        except NothingToTrain as e:
            if dist.get_rank() == 0:
                print(e, flush=True)
            return []
        trainer.print_summary(folded)
        losses = trainer.train()
        if dist.get_rank() == 0:
            report.plot(args, trainer.log)
        trainer.log.print(report.end_summary(
            args, argv, trainer.log, trainer.iteration, losses[-1] if losses else None,
            time.time() - started,
            "stock" if args.spec == "baseline" else args.scalevec_config.to_string()))
        return losses
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: no traceback either
        raise report.interrupted(args, argv, trainer, trainer and trainer.log) from None
    except (faults.DivergenceError, ArgumentError, CheckpointError, PretrainedError):
        raise
    except RuntimeError as e:
        if faults.is_lost_rank(e):
            raise faults.LostRankError(
                f"rank {dist.get_rank()} lost contact with another rank (a node or process "
                f"died, or the network failed): {faults.first_line(e)}") from e
        raise
    finally:
        if trainer is not None:
            trainer.log.close()
        if created:
            from megatron.core import parallel_state as ps  # noqa: PLC0415

            with contextlib.suppress(Exception):
                ps.destroy_model_parallel()
                dist.destroy_process_group()


def cli() -> None:
    """The script: known failures print one line on stderr and exit 2 (bad input, bad
    checkpoint, bad data) or 3 (divergence, a lost rank); nothing else is caught."""
    from megatron_scalevec.training.ckpt_guard import CheckpointError  # noqa: PLC0415
    from megatron_scalevec.training.corpus import DataPathError  # noqa: PLC0415
    from megatron_scalevec.training.pretrained import PretrainedError  # noqa: PLC0415

    try:
        main()
    except (ArgumentError, CheckpointError, DataPathError, PretrainedError) as e:
        _fail(e, 2)
    except (faults.DivergenceError, faults.LostRankError) as e:
        _fail(e, 3)
    except report.Interrupted as e:
        _fail(e, 130, prefix="")
    except KeyboardInterrupt:  # before the run started (imports, flags): nothing written
        _fail(report.Interrupted("interrupted before the first iteration: nothing trained, "
                                 "no checkpoint kept"), 130, prefix="")


def _fail(e: BaseException, code: int, prefix: str = "error: ") -> None:
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 or not getattr(e, "collective", False):
        who = f"[rank {rank}] " if "RANK" in os.environ and rank != 0 else ""
        print(f"{who}{prefix}{e}", file=sys.stderr, flush=True)
    elif "RANK" in os.environ:
        time.sleep(10.0)  # rank 0 prints the same line and exits; torchrun then stops us
    sys.stdout.flush()
    os._exit(code)  # no atexit work: a dead peer must not hang the exit in a collective


if __name__ == "__main__":
    cli()
