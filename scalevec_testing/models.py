"""Tiny GPT models and the layout-equality harness the tests and benchmarks share.

The harness answers "does layout L compute the same thing as one process?" without any
hand-written resharding: reference weights are saved once with ``dist_checkpointing`` at
TP=PP=1 and loaded at layout L (megatron-core does the slicing); gradients or updated weights
are saved the same way and read back as full tensors with ``load_plain_tensors``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_scalevec.specs import get_scalevec_block_spec

VOCAB = 64
SEQ = 16


def tiny_config(**overrides) -> TransformerConfig:
    """A 2-layer GQA SwiGLU RMSNorm model at the current parallel layout (virtual pipeline
    stages included), fusions off.

    Under VPP p2p is unbatched, the trainer's rule (training/build.py, as Megatron-LM):
    batched, interleaved PP2 sends an activation and a gradient to the one peer (prev == next)
    in one ``batch_isend_irecv``, and gloo matches the two messages (same tag, same shape) in
    the other order, silently swapping them. The unbatched path puts the two directions on
    two process groups."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    kw = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, batch_p2p_comm=not vpp,
        use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        transformer_impl="local",
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt(config: TransformerConfig, strategy: Optional[str], seed: int = 7,
              vp_stage: Optional[int] = None) -> GPTModel:
    """``strategy=None`` builds megatron-core's own local spec (the stock baseline);
    ``vp_stage``: the virtual pipeline stage this chunk is (see :func:`build_gpt_chunks`)."""
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    if strategy is None:
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                         normalization=config.normalization,
                                         qk_layernorm=config.qk_layernorm)
    else:
        spec = get_scalevec_block_spec(config, strategy, vp_stage)
    virtual = vp_stage is not None
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope",
                    pre_process=parallel_state.is_pipeline_first_stage(
                        ignore_virtual=not virtual, vp_stage=vp_stage),
                    post_process=parallel_state.is_pipeline_last_stage(
                        ignore_virtual=not virtual, vp_stage=vp_stage),
                    vp_stage=vp_stage)


def build_gpt_chunks(config: TransformerConfig, strategy: Optional[str],
                     seed: int = 7) -> list:
    """This rank's model chunks, one GPTModel per virtual pipeline stage, the list
    megatron-core's interleaved schedule takes (``[build_gpt(...)]`` without VPP). Each chunk
    is built with its ``vp_stage``: it holds that stage's layers (at its layer offset) and only
    the first stage's first chunk embeds, only the last stage's last chunk has the output
    layer. Chunk i is seeded ``seed + i`` so the chunks' layers differ."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is None:
        return [build_gpt(config, strategy, seed)]
    return [build_gpt(config, strategy, seed + i, vp_stage=i) for i in range(vpp)]


def _seed_of(name: str) -> int:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)


@torch.no_grad()
def perturb_vectors(model: torch.nn.Module, scale: float = 0.2) -> int:
    """Move every scale-vector parameter away from its init (by name, so layout-free at
    TP=PP=1). Returns how many tensors were changed."""
    n = 0
    for name, p in model.named_parameters():
        if hasattr(p, "scalevec_part"):
            g = torch.Generator().manual_seed(_seed_of(name))
            p.add_(scale * torch.randn(p.shape, generator=g))
            n += 1
    return n


def batches(num: int, micro_batch: int, seed: int = 3) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        tokens = torch.randint(0, VOCAB, (micro_batch, SEQ + 1), generator=g)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "position_ids": torch.arange(SEQ).expand(micro_batch, SEQ)})
    return out


def wrap_ddp(model, config, distributed_optimizer: bool = False,
             overlap_grad_reduce: bool = False, **ddp_options):
    """megatron-core DDP around ``model``; a list of chunks gets one DDP per chunk (a list
    back), bucketing only in the first, as Megatron-LM wraps virtual pipeline chunks.
    ``ddp_options``: more DistributedDataParallelConfig fields (``overlap_param_gather``,
    ``align_param_gather``, ``bucket_size``, ``grad_reduce_in_fp32``: default True)."""
    ddp_options.setdefault("grad_reduce_in_fp32", True)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, overlap_grad_reduce=overlap_grad_reduce,
        **ddp_options)
    if isinstance(model, list):
        return [DistributedDataParallel(config, ddp_config, m, disable_bucketing=i > 0)
                for i, m in enumerate(model)]
    return DistributedDataParallel(config, ddp_config, model)


LINEAR_ADAM_EPS = 1e4


def make_optimizer(ddp_model, distributed_optimizer: bool = False, lr: float = 1e-2,
                   optimizer: str = "adam", clip_grad: float = 0.0, bf16: bool = False):
    """megatron-core's optimizer. Layout checks use ``optimizer="sgd"`` (no momentum): its
    update is linear in the gradient, so a wrong gradient scale shows (Adam hides it).
    ``ddp_model``: one DDP model or a list of chunks (:func:`wrap_ddp`).
    megatron-core's distributed optimizer takes Adam only; there "sgd" is Adam with
    ``beta1 = 0`` and ``eps`` far above every ``|g|``: ``lr g / (|g| + eps) = (lr / eps) g``
    to a relative 1e-4 / eps, i.e. SGD at ``lr``. ``bf16``: bf16 parameters with fp32 master
    weights (megatron-core's mixed-precision optimizer)."""
    kw = dict(optimizer=optimizer, sgd_momentum=0.0)
    if optimizer == "sgd" and distributed_optimizer:
        kw = dict(optimizer="adam", adam_beta1=0.0, adam_eps=LINEAR_ADAM_EPS)
        lr = lr * LINEAR_ADAM_EPS
    cfg = OptimizerConfig(lr=lr, weight_decay=0.0, bf16=bf16, fp16=False,
                          use_distributed_optimizer=distributed_optimizer, clip_grad=clip_grad,
                          **kw)
    chunks = ddp_model if isinstance(ddp_model, list) else [ddp_model]
    return get_megatron_optimizer(cfg, chunks)


def te_fused_wgrad_accumulation(model) -> int:
    """Transformer Engine's linears accumulate their weight gradient into ``main_grad`` (as
    ``gradient_accumulation_fusion`` configures them; megatron-core's own output layer would
    need APEX's CUDA kernel for it); returns how many."""
    n = 0
    for m in model.modules():
        if type(m).__module__.startswith(("transformer_engine", "megatron.core.extensions",
                                          "megatron_scalevec.layers.te")) and \
                hasattr(m, "fuse_wgrad_accumulation"):
            m.fuse_wgrad_accumulation = True
            if hasattr(m, "_fused_accumulation"):
                m._fused_accumulation = True
            n += 1
    return n


def set_microbatches(n: Optional[int], micro_batch_size: int = 1) -> None:
    """megatron-core's micro-batch calculator at ``n`` micro-batches per step on each
    data-parallel rank (as Megatron-LM sets it up; the fold maps once per step,
    layers/fold.py ``StepMap``), or unset (``None``: the fold maps every micro-batch)."""
    from megatron.core import num_microbatches_calculator as calc

    calc.unset_num_microbatches_calculator()
    if n is not None:
        dp = parallel_state.get_data_parallel_world_size()
        calc.init_num_microbatches_calculator(1, None, n * micro_batch_size * dp,
                                              micro_batch_size, dp)


def train_steps(ddp_model, config, data: list, steps: int, optimizer=None,
                grad_norms: Optional[list] = None, forward_context=None,
                per_step_map: bool = True) -> list:
    """Run ``steps`` iterations over this data-parallel rank's share of ``data``
    (micro-batches); returns the loss of each step averaged over all ranks' micro-batches.
    ``grad_norms`` collects the norm each ``optimizer.step()`` returns. ``ddp_model``: one DDP
    model or a list of virtual pipeline chunks (the interleaved schedule then reads one data
    iterator per chunk, each over the same micro-batches). ``forward_context``: a context
    manager factory around each forward-backward (not the optimizer step), e.g.
    ``te_stub.cuda_claimed``. ``per_step_map``: megatron-core's micro-batch calculator set
    up, as Megatron-LM does (the fold's gradient map then runs once per step), else unset."""
    chunks = ddp_model if isinstance(ddp_model, list) else [ddp_model]
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = data[dp_rank::dp]
    set_microbatches(len(mine) if per_step_map else None, mine[0]["tokens"].shape[0])
    fwd_bwd = get_forward_backward_func()
    config.finalize_model_grads_func = finalize_model_grads
    if chunks[0].ddp_config.align_param_gather:  # as Megatron-LM: the schedule dispatches
        syncs = [c.start_param_sync for c in chunks]
        config.param_sync_func = syncs[0] if len(syncs) == 1 else syncs
    losses = []
    for _ in range(steps):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        if optimizer is not None:
            optimizer.zero_grad()
        its = [iter(mine) for _ in chunks]

        def step(data_iterator, model):
            b = next(data_iterator)
            out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            return out, lambda t: (t.float().mean(), {"loss": t.float().mean().detach()})

        with forward_context() if forward_context is not None else contextlib.nullcontext():
            res = fwd_bwd(forward_step_func=step,
                          data_iterator=its if len(its) > 1 else its[0], model=chunks,
                          num_microbatches=len(mine), seq_length=SEQ,
                          micro_batch_size=mine[0]["tokens"].shape[0], forward_only=False)
        loss = torch.tensor(0.0)
        if parallel_state.is_pipeline_last_stage():
            loss = torch.stack([r["loss"] for r in res]).mean()
        torch.distributed.all_reduce(loss)  # loss lives on the last stage; mean over DP
        losses.append(float(loss) / (dp * parallel_state.get_tensor_model_parallel_world_size()))
        if optimizer is not None:
            _, norm, _ = optimizer.step()
            if grad_norms is not None:
                grad_norms.append(float(norm))
    return losses


def sync_params(ddp_model) -> None:
    """Finish any overlapped parameter all-gather (``overlap_param_gather``), so the model's
    parameters hold the last optimizer step's values, as Megatron-LM does before it evaluates
    or saves (the forward pre-hooks do it during training)."""
    for chunk in ddp_model if isinstance(ddp_model, list) else [ddp_model]:
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def run_case(config, strategy, *, dist_opt: bool = False, steps: int = 0,
             ref_dir: Optional[str] = None, load_dir: Optional[str] = None,
             out_dir: Optional[str] = None, check=None, clip_grad: float = 0.0,
             only_vectors: bool = False, lr: float = 1e-2) -> dict:
    """One layout of the equality harness, on the current parallel layout.

    Without ``load_dir`` this is the reference: vectors are perturbed and the weights saved to
    ``ref_dir``. Otherwise the reference weights are loaded. Then ``steps`` plain-SGD steps
    (clipped at ``clip_grad`` when > 0), or one forward-backward when 0, over the same global
    batch; the gradients (steps == 0) or the updated weights are saved to ``out_dir``.
    ``only_vectors`` freezes everything but the scale vectors (so the grad norm is theirs).
    ``check(model)`` may assert on the built model. Returns ``losses`` and ``grad_norms``.
    """
    model = build_gpt(config, strategy)
    if check is not None:
        check(model)
    if load_dir is None:
        perturb_vectors(model)
        save_model(model, ref_dir)
    else:
        load_model(model, load_dir)
    if only_vectors:
        for p in model.parameters():
            p.requires_grad_(hasattr(p, "scalevec_part"))
    ddp = wrap_ddp(model, config, dist_opt)
    opt = make_optimizer(ddp, dist_opt, lr=lr, optimizer="sgd", clip_grad=clip_grad) \
        if steps else None
    norms: list = []
    losses = train_steps(ddp, config, batches(4, 2), max(steps, 1), opt, norms)
    if out_dir:
        (save_model if steps else save_grads)(model, out_dir)
    return {"losses": losses, "grad_norms": norms}


@torch.no_grad()
def zero_grad_step_factors(ddp_model, optimizer) -> dict:
    """One optimizer step with zero gradients: Adam's update is then 0 and ``p -> p (1 - lr wd)``,
    so the returned factor per parameter name shows exactly which decay it got. Values are made
    nonzero first so any shrink is visible."""
    named = list(ddp_model.named_parameters())
    for _, p in named:
        p.copy_(p.abs() + 0.5)
    before = {n: p.detach().clone() for n, p in named}
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    optimizer.step()
    return {n: (p.detach() / before[n]).mean().item() for n, p in named}


def _sharded(model):
    """A model's sharded state dict; of a list of chunks, one dict keyed by chunk (the
    checkpoint keys are global, so any chunking loads any other)."""
    if isinstance(model, list):
        return {f"chunk{i}": m.sharded_state_dict() for i, m in enumerate(model)}
    return model.sharded_state_dict()


# a TE model's fused Pre-Norm gammas (``shared``) -> the local spec's norms
TE_FUSED_NORMS = {".self_attention.linear_qkv.layer_norm_": ".input_layernorm.",
                  ".mlp.linear_fc1.layer_norm_": ".pre_mlp_layernorm."}


def te_as_local_keys(sharded: dict) -> dict:
    """A TE model's sharded tensors under the local spec's checkpoint keys (``shared``'s fused
    Pre-Norm gammas are the local spec's input / pre-MLP norms; the rest is key for key),
    without TE's ``_extra_state`` (FP8 metadata) objects, which have no local counterpart."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject  # noqa: PLC0415

    sharded = {k: v for k, v in sharded.items() if not isinstance(v, ShardedObject)}
    for sh in sharded.values():
        for te_part, local_part in TE_FUSED_NORMS.items():
            if hasattr(sh, "key") and te_part in sh.key:
                sh.key = sh.key.replace(te_part, local_part)
    return sharded


def save_model(model, directory: str) -> None:
    """``model``: one model or a list of chunks (:func:`build_gpt_chunks`)."""
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(_sharded(model), directory)


def load_model(model, directory: str, te_extra_state: bool = False) -> None:
    """``model``: one model or a list of chunks (:func:`build_gpt_chunks`).
    ``te_extra_state``: a Transformer Engine model from a local model's checkpoint
    (:func:`te_as_local_keys`): only TE's FP8 metadata (``_extra_state``) is left unloaded."""
    if te_extra_state:
        sharded = te_as_local_keys(model.sharded_state_dict())
        missing, unexpected = model.load_state_dict(
            dist_checkpointing.load(sharded, directory), strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise AssertionError(f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        return
    state = dist_checkpointing.load(_sharded(model), directory)
    if isinstance(model, list):
        for i, m in enumerate(model):
            m.load_state_dict(state[f"chunk{i}"])
    else:
        model.load_state_dict(state)


@torch.no_grad()
def save_grads(model, directory: str) -> None:
    """Save ``main_grad`` (after finalize) in the weights' checkpoint layout."""
    saved = {}
    for name, p in model.named_parameters():
        grad = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        if grad is None and not p.requires_grad:  # frozen (TE's identity norms): as it is
            continue
        saved[name] = p.data.clone()
        p.data.copy_(grad)
    save_model(model, directory)
    for name, p in model.named_parameters():
        if name in saved:
            p.data.copy_(saved[name])


def plain_tensors(directory: str) -> dict:
    """Full tensors of a checkpoint by key (no model needed)."""
    sd = dist_checkpointing.load_plain_tensors(directory)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def max_differences(a: dict, b: dict) -> dict:
    """Per-key max |a - b|; a key present in one only is an error."""
    if set(a) != set(b):
        raise AssertionError(f"checkpoint keys differ: {sorted(set(a) ^ set(b))[:10]}")
    return {k: float((a[k].float() - b[k].float()).abs().max()) for k in a}


def relative_mismatches(ref: dict, other: dict, *, rtol: float, tiny: float = 2e-8,
                        base: Optional[dict] = None) -> list:
    """Keys where ``max|other - ref| > rtol * max|ref - base| + tiny`` (``base`` absent: 0),
    i.e. a tolerance relative to each tensor's own scale, so small tensors (OR magnitudes,
    ER logits: gradients of 1e-6) are checked as strictly as large ones. With ``base`` the
    weights before the optimizer steps, the updates are compared, not the weights.
    ``tiny``: an OR magnitude's gradient is a sum that cancels (5e-7 out of terms of 1e-5),
    so its float32 rounding across layouts reaches ~5e-9 whatever its own size."""
    if set(ref) != set(other):
        raise AssertionError(f"checkpoint keys differ: {sorted(set(ref) ^ set(other))[:10]}")
    bad = []
    for k in sorted(ref):
        r = ref[k].double()
        scale = float((r - base[k].double()).abs().max() if base is not None else r.abs().max())
        diff = float((other[k].double() - r).abs().max())
        if diff > rtol * scale + tiny:
            bad.append(f"{k}: max|diff| {diff:.3e} vs scale {scale:.3e}")
    return bad


def saved_mismatches(rank, world, ref_dir, out_dir, base_dir, rtol) -> tuple:
    """Rank function (``run_on_ranks(saved_mismatches, 1, ...)``, shared by the layout tests of
    dense and MoE models): :func:`relative_mismatches` of the tensors saved in ``out_dir``
    against ``ref_dir`` (of the updates from ``base_dir`` when given), and the reference's keys."""
    base = plain_tensors(base_dir) if base_dir else None
    ref, out = plain_tensors(ref_dir), plain_tensors(out_dir)
    return relative_mismatches(ref, out, rtol=rtol, base=base), sorted(ref)


def magnitude_siblings() -> dict:
    """{".<magnitude part>": ".<its vector part>"} of every registered parameterization with a
    magnitude (OR: magnitude -> direction, ER: alpha -> logit)."""
    from megatron_scalevec import parameterizations

    out = {}
    for name in parameterizations.names():
        p = parameterizations.get(name)
        vector = [q.name for q in p.parts if not q.scalar]
        if p.magnitude is not None and vector:
            out[f".{p.magnitude}"] = f".{vector[0]}"
    return out


def relative_differences(ref: dict, other: dict) -> dict:
    """Per key ``max|other - ref| / max|ref|``. OR's magnitude / ER's alpha gradient is a sum
    with heavy cancellation (its value can be 1e-3 of its terms): it is measured against the
    scale of its own vector's gradient (direction / logit), the size of the terms it sums."""
    out = {}
    siblings = magnitude_siblings()
    for k in ref:
        scale = float(ref[k].float().abs().max())
        for end, sibling in siblings.items():
            if k.endswith(end) and k[:-len(end)] + sibling in ref:
                scale = max(scale, float(ref[k[:-len(end)] + sibling].float().abs().max()))
        diff = float((ref[k].float() - other[k].float()).abs().max())
        out[k] = diff / max(scale, 1e-30)
    return out
