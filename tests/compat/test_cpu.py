"""The CPU layer: each patch on its own, then megatron-core GPTModel on CPU with gloo.

Model tests: forward+backward on one process; TP=2 == TP=1; PP=2 (4 micro-batches) == PP=1;
MoE alltoall EP=2 (and EP=2 x expert-TP=2, which needs the uneven all-gather) == EP=1;
dist_checkpointing sync save TP=2 -> load TP=1; the model-parallel RNG trap.
"""

import queue
import threading

import numpy as np
import pytest
import torch
from megatron.core import dist_checkpointing, jit, parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils

from megatron_scalevec.compat import mcore
from megatron_scalevec.compat.cpu import enable_cpu_compat, is_cpu_compat_enabled
from scalevec_testing import gather_full_tensor, init_model_parallel, run_on_ranks

VOCAB, SEQ, MBS = 128, 16, 2


def tiny_config(**overrides):
    kw = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt(config, spec=None):
    return GPTModel(
        config,
        spec or get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
    )


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tok = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        out.append(
            dict(
                tokens=tok[:, :-1],
                labels=tok[:, 1:],
                position_ids=torch.arange(SEQ).expand(MBS, SEQ),
            )
        )
    return out


def lm_loss(model, batch):
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()


def full_params(model):
    """Every parameter as a full tensor (TP shards gathered), keyed by name."""
    out = {}
    for name, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False) and getattr(p, "allreduce", True):
            group = parallel_state.get_tensor_model_parallel_group()
            out[name] = gather_full_tensor(p.data, p.partition_dim, group)
        else:
            out[name] = p.data.clone()
    return out


# ---------------------------------------------------------------- the patches, one by one


def test_enable_is_idempotent():
    assert enable_cpu_compat() is True
    assert enable_cpu_compat() is True
    assert is_cpu_compat_enabled()


def test_cuda_devices_map_to_cpu():
    x = torch.zeros(3, device="cuda")
    assert x.device.type == "cpu"
    assert x.cuda() is x
    assert x.to("cuda:0").device.type == "cpu"
    y = x.to(torch.device("cuda"), torch.float64)
    assert (y.device.type, y.dtype) == ("cpu", torch.float64)
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2, device=0).device.type == "cpu"
    assert torch.empty(2, pin_memory=True).device.type == "cpu"
    assert x.new_zeros(2, device="cuda").device.type == "cpu"
    assert torch.cuda.device_count() == 1
    torch.cuda.synchronize()
    torch.cuda.set_device(0)


def test_tensor_type_reports_cuda():
    x = torch.zeros(2)
    assert x.type() == "torch.cuda.FloatTensor"
    assert x.half().type() == "torch.cuda.HalfTensor"
    assert x.type(torch.cuda.HalfTensor).dtype == torch.float16
    assert x.type("torch.cuda.DoubleTensor").dtype == torch.float64
    assert x.type(torch.uint8).dtype == torch.uint8


def test_streams_and_events_are_noops():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        z = torch.ones(2) * 2
    event = side.record_event()
    event.synchronize()
    assert event.query() and torch.equal(z, torch.full((2,), 2.0))


def test_cuda_seed_drives_cpu_generator():
    torch.cuda.manual_seed(5)
    a = torch.rand(4)
    torch.cuda.manual_seed(5)
    b = torch.rand(4)
    torch.cuda.manual_seed(6)
    c = torch.rand(4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    state = mrandom._get_cuda_rng_state()
    assert torch.equal(state, torch.get_rng_state())
    d = torch.rand(4)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4), d)


def test_mode_is_per_thread_and_enable_enters_it():
    seen = {}

    def worker():
        try:
            torch.zeros(1, device="cuda")
            seen["before"] = "cpu"
        except (AssertionError, RuntimeError):
            seen["before"] = "refused"
        assert enable_cpu_compat()
        seen["after"] = torch.zeros(1, device="cuda").device.type

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"before": "refused", "after": "cpu"}


def test_megatron_module_patches():
    assert moe_utils.te_general_gemm is None

    def f(t):
        return t + 1

    assert jit.jit_fuser(f) is f
    splits = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]


# ---------------------------------------------------------------- GPTModel on one process


def _one_process_case(rank, world):
    # in a forked rank: a gloo group created in the pytest process would break later forks
    init_model_parallel()
    model = build_gpt(tiny_config())
    batch = batches(1)[0]
    loss = lm_loss(model, batch)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    return loss.item(), lm_loss(model, batch).item(), missing


def test_gpt_forward_backward_one_process():
    [(loss, loss_after_step, missing)] = run_on_ranks(_one_process_case, 1)
    assert 3.0 < loss < 7.0  # about ln(128) = 4.85 at init
    assert not missing
    assert loss_after_step < loss - 0.05


# ---------------------------------------------------------------- TP, PP, EP, checkpoint


def _tp_case(rank, world):
    out = {}
    for tp in (1, 2):
        init_model_parallel(tp=tp)
        model = build_gpt(tiny_config())
        loss = lm_loss(model, batches(1)[0])
        loss.backward()
        qkv = model.decoder.layers[1].self_attention.linear_qkv.weight
        group = parallel_state.get_tensor_model_parallel_group()
        out[tp] = (loss.item(), full_params(model), gather_full_tensor(qkv.grad, 0, group))
    return out


def test_tp2_matches_tp1():
    for out in run_on_ranks(_tp_case, 2):
        (loss1, w1, g1), (loss2, w2, g2) = out[1], out[2]
        # use_cpu_initialization draws the same master weights whatever the TP size
        assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
        assert loss1 == pytest.approx(loss2, abs=1e-6)
        assert torch.allclose(g1, g2, atol=1e-6) and g1.abs().sum() > 0


def _schedule(model, micro_batches):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=False,
    )


def _pp_case(rank, world):
    init_model_parallel(pp=1)
    ref = build_gpt(tiny_config())
    ref_losses = [r["lm loss"].item() for r in _schedule(ref, batches(4))]
    ref_weights = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

    init_model_parallel(pp=2)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    model = build_gpt(tiny_config())
    names = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + stage)  # one layer per stage
            names[name] = ".".join(parts)
            p.copy_(ref_weights[names[name]])
    losses = [r["lm loss"].item() for r in _schedule(model, batches(4))]
    grads_match = all(
        torch.allclose(p.grad, ref_grads[names[n]], atol=1e-6) for n, p in model.named_parameters()
    )
    return stage, ref_losses, losses, grads_match, len(names)


def test_pp2_four_microbatches_matches_pp1():
    results = run_on_ranks(_pp_case, 2)
    assert [r[0] for r in results] == [0, 1]
    ref_losses, losses = results[1][1], results[1][2]
    assert len(losses) == 4 and results[0][2] == []  # only the last stage reports losses
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    assert all(r[3] for r in results) and all(r[4] > 0 for r in results)


def _moe_config(ep, etp):
    return tiny_config(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def _moe_case(rank, world, ep, etp):
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    batch = batches(1, seed=rank)[0]  # different tokens per rank: uneven expert splits
    init_model_parallel(ep=1, etp=1)
    ref = build_gpt(_moe_config(1, 1), spec)
    ref_loss = lm_loss(ref, batch)
    ref_loss.backward()
    ref_weights = {n: p.detach() for n, p in ref.named_parameters()}

    init_model_parallel(ep=ep, etp=etp)
    model = build_gpt(_moe_config(ep, etp), spec)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".local_experts." in name:
                head, tail = name.split(".local_experts.")
                index, rest = tail.split(".", 1)
                index = int(index) + ep_rank * (4 // ep)  # local -> global expert
                full = ref_weights[f"{head}.local_experts.{index}.{rest}"]
                if getattr(p, "tensor_model_parallel", False):
                    full = full.chunk(etp, dim=p.partition_dim)[etp_rank]
                p.copy_(full)
            else:
                p.copy_(ref_weights[name])
    loss = lm_loss(model, batch)
    loss.backward()
    router = model.decoder.layers[0].mlp.router.weight
    ref_router = ref.decoder.layers[0].mlp.router.weight
    return ref_loss.item(), loss.item(), torch.allclose(router.grad, ref_router.grad, atol=1e-6)


@pytest.mark.parametrize("world,ep,etp", [(2, 2, 1), (4, 2, 2)], ids=["ep2", "ep2xetp2"])
def test_moe_alltoall_matches_ep1(world, ep, etp):
    for ref_loss, loss, router_grad_ok in run_on_ranks(_moe_case, world, ep, etp):
        assert loss == pytest.approx(ref_loss, abs=1e-5)
        assert router_grad_ok


def _ckpt_case(rank, world, ckpt_dir):
    queues = []

    def spy(orig):
        def results_queue(*args, **kwargs):
            q = orig(*args, **kwargs)
            queues.append(type(q))
            return q

        return results_queue

    mcore.patch_results_queue(spy)
    init_model_parallel(tp=2)
    model = build_gpt(tiny_config())
    expected = full_params(model)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)

    init_model_parallel(tp=1)
    fresh = build_gpt(tiny_config())
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt_dir))
    same = all(torch.equal(expected[n], p) for n, p in fresh.named_parameters())
    return queues, same


def test_dist_checkpoint_sync_save_tp2_load_tp1(tmp_path):
    for queues, same in run_on_ranks(_ckpt_case, 2, str(tmp_path)):
        assert queues and all(q is queue.Queue for q in queues)
        assert same


# ---------------------------------------------------------------- the RNG trap


def _rng_case(rank, world):
    init_model_parallel(tp=2, seed=1234)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        model_parallel = torch.rand(8)
    default = torch.rand(8)
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
        model_parallel,
        default,
    )


def test_model_parallel_rng_differs_across_tp_ranks_only():
    results = {(tp, dp): (mp, default) for tp, dp, mp, default in run_on_ranks(_rng_case, 4)}
    assert set(results) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    for dp in (0, 1):  # TP ranks: different model-parallel streams
        assert not torch.equal(results[(0, dp)][0], results[(1, dp)][0])
    for tp in (0, 1):  # DP ranks: the same model-parallel stream
        assert torch.equal(results[(tp, 0)][0], results[(tp, 1)][0])
    defaults = [v[1] for v in results.values()]  # the default stream is shared by all
    assert all(torch.equal(d, defaults[0]) for d in defaults)
    assert not torch.equal(defaults[0], results[(0, 0)][0])
