"""megatron_scalevec/layers/attention.py on its own: one ScaleVecSelfAttention, built directly
under megatron's parallel state in forked gloo ranks, against an attention written here in
plain torch.

The reference: ``mixed = x W_qkv^T`` split per query group into q heads, k, v; DNP's
``a * N_head(.)`` (``F.rms_norm`` / ``F.layer_norm`` over ``head_dim``, ``a`` in R^head_dim
shared by the heads) on q, k, v, or on q and k only (QK-norm); RoPE ``t cos + J t sin`` with
cos and sin times YaRN's concentration factor (mscale, written out here from the config's
``yarn_*`` fields), on the first ``rot`` channels; causal GQA softmax attention; ``W_proj``.
Checked: output and the gradients of the input, both weights and every norm vector, with and
without RoPE, partial rotary, LayerNorm, mscale; at TP=2 (heads split; the replicated vectors'
gradient summed over TP) against the whole reference; the refusals and the vectors' shapes.
"""

import functools
import math

import pytest
import torch

from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.layers import ScaleVecColumnParallelLinear, ScaleVecSelfAttention
from scalevec_testing import gather_full_tensor, init_model_parallel, oracles, run_on_ranks
from scalevec_testing import models as M
from scalevec_testing.compare import rand as _rand
from scalevec_testing.compare import rel as _rel

HEADS, GROUPS, HD = 4, 2, 8  # M.tiny_config(): hidden 32
SEQ, BATCH = 6, 2
EPS = 1e-5
REL = 1e-5


def _build(strategy, stock_norms=None, **overrides):
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    yarn = overrides.pop("yarn", None)
    cfg = M.tiny_config(layernorm_epsilon=EPS, **overrides)
    for name, value in (yarn or {}).items():  # a config carrying YaRN's fields (as MLA's)
        setattr(cfg, name, value)
    scalevec = ScaleVecConfig.from_string(strategy)
    sub = SelfAttentionSubmodules(
        linear_qkv=functools.partial(ScaleVecColumnParallelLinear, scalevec=scalevec,
                                     branches="qkv"),
        core_attention=DotProductAttention, linear_proj=RowParallelLinear,
        **({"q_layernorm": stock_norms, "k_layernorm": stock_norms} if stock_norms else {}))
    att = ScaleVecSelfAttention(cfg, sub, 1, attn_mask_type=AttnMaskType.causal,
                                scalevec=scalevec)
    with torch.no_grad():  # the norm vectors (and biases) away from init, alike on every rank
        for i, (name, p) in enumerate(sorted(att.named_parameters())):
            if "_norm." in name or "_layernorm." in name:
                p.add_(0.3 * _rand(*p.shape, seed=50 + i))
    return att


def _norm_prefix(att, b):
    """Where branch ``b``'s per-head norm lives: DNP's ``<b>_norm``, or (``qk_layernorm``
    without DNP) megatron-core's own ``<b>_layernorm`` slot."""
    from megatron_scalevec.norms import ScaleVecNorm

    if getattr(att, f"{b}_norm", None) is not None:
        return f"{b}_norm."
    if isinstance(getattr(att, f"{b}_layernorm", None), ScaleVecNorm):
        return f"{b}_layernorm."
    return None


def _gamma(leaves, prefix):
    """SPEC.md's gamma of one norm's vector from leaf copies of its parameters; None without."""
    p = {n[len(prefix):]: t for n, t in leaves.items() if n.startswith(prefix) and
         not n.endswith(".bias")}
    return oracles.gamma(p) if p else None


def _mscale(yarn):
    """YaRN's concentration factor, written out: m(s, k) = 0.1 k ln(s) + 1 (s > 1)."""
    if not yarn:
        return 1.0
    s = yarn["yarn_rotary_scaling_factor"]
    return (0.1 * yarn["yarn_mscale"] * math.log(s) + 1) / \
        (0.1 * yarn["yarn_mscale_all_dim"] * math.log(s) + 1)


def _freqs(rot):
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    f = torch.outer(torch.arange(SEQ).float(), inv)
    return torch.cat([f, f], -1)[:, None, None, :]  # [s, 1, 1, rot], halves (not interleaved)


def _rope(t, freqs, mscale):
    rot = freqs.shape[-1]
    head, tail = t[..., :rot], t[..., rot:]
    x1, x2 = head.chunk(2, -1)
    turned = torch.cat([-x2, x1], -1)
    head = head * (freqs.cos() * mscale) + turned * (freqs.sin() * mscale)
    return torch.cat([head, tail], -1)


def _n(t, normalization):
    return oracles.normalize(t, normalization, EPS)


def _reference(x, w_qkv, w_proj, vectors, freqs, mscale, normalization):
    """Causal GQA attention with the per-head norms (``vectors``: {branch: a or None})."""
    s, b, _ = x.shape
    hpg = HEADS // GROUPS
    mixed = (x @ w_qkv.t()).view(s, b, GROUPS, (hpg + 2) * HD)
    q = mixed[..., :hpg * HD].reshape(s, b, HEADS, HD)
    k, v = mixed[..., hpg * HD:(hpg + 1) * HD], mixed[..., (hpg + 1) * HD:]
    out = {"q": q, "k": k, "v": v}
    for name, (a, beta) in vectors.items():
        normed = _n(out[name], normalization)
        normed = normed if a is None else normed * a
        out[name] = normed if beta is None else normed + beta
    q, k, v = out["q"], out["k"], out["v"]
    if freqs is not None:
        q, k = _rope(q, freqs, mscale), _rope(k, freqs, mscale)
    k, v = k.repeat_interleave(hpg, dim=2), v.repeat_interleave(hpg, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(HD)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(s, b, HEADS * HD) @ w_proj.t()


def _run(rank, world, strategy, rot, normalization, yarn, overrides):
    """Errors of the module's output and gradients against the reference (whole weights)."""
    from megatron.core import parallel_state

    init_model_parallel(tp=world)
    tp = parallel_state.get_tensor_model_parallel_group()
    att = _build(strategy, normalization=normalization, yarn=yarn, **overrides)
    params = dict(att.named_parameters())
    full = {"linear_qkv.weight": gather_full_tensor(params["linear_qkv.weight"], 0, tp),
            "linear_proj.weight": gather_full_tensor(params["linear_proj.weight"], 1, tp)}
    leaves = {n: full.get(n, p.detach()).clone().requires_grad_() for n, p in params.items()}
    prefixes = {b: _norm_prefix(att, b) for b in "qkv" if _norm_prefix(att, b)}
    vectors = {b: (_gamma(leaves, pre), leaves.get(pre + "bias")) for b, pre in prefixes.items()}
    x = _rand(SEQ, BATCH, HEADS * HD, seed=1).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    freqs = _freqs(rot) if rot else None
    y, bias = att(x, None, rotary_pos_emb=freqs)
    ref = _reference(ref_x, leaves["linear_qkv.weight"], leaves["linear_proj.weight"],
                     vectors, freqs, _mscale(yarn), normalization)
    assert bias is None
    up = _rand(*ref.shape, seed=2)
    (y * up).sum().backward()
    (ref * up).sum().backward()
    for name, p in params.items():  # what finalize_model_grads does for stock's QK-norm slots
        if "_layernorm." in name and world > 1:
            torch.distributed.all_reduce(p.grad, group=tp)
    errs = {"out": _rel(y, ref), "dx": _rel(x.grad, ref_x.grad)}
    for name, p in params.items():
        ref_grad = leaves[name].grad
        if name == "linear_qkv.weight":
            ref_grad = ref_grad.chunk(world, 0)[rank]
        elif name == "linear_proj.weight":
            ref_grad = ref_grad.chunk(world, 1)[rank]
        errs[name] = _rel(p.grad, ref_grad)
    return sorted(vectors), errs


YARN = {"yarn_rotary_scaling_factor": 4.0, "yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.5}
CASES = {  # name: (strategy, rot, normalization, yarn, config overrides, normalized branches)
    "dnp_rope": ("dnp", HD, "RMSNorm", None, {}, "qkv"),
    "dnp_layernorm_yarn_mscale": ("dnp", HD, "LayerNorm", YARN, {}, "qkv"),
    "dnp_partial_rotary": ("dnp+er", HD // 2, "RMSNorm", None, {}, "qkv"),
    "dnp_no_rope": ("dnp", None, "RMSNorm", None, {}, "qkv"),
    "qk_layernorm_only": ("shared", HD, "RMSNorm", YARN, {"qk_layernorm": True}, "qk"),
    "qk_layernorm_bias": ("shared+or", HD, "LayerNorm", None, {"qk_layernorm": True}, "qk"),
    "qk_norm_without_vectors": ("none", HD, "RMSNorm", None, {"qk_layernorm": True}, "qk"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_plain_torch_attention(case):
    strategy, rot, normalization, yarn, overrides, normed = CASES[case]
    (branches, errs), = run_on_ranks(_run, 1, strategy, rot, normalization, yarn, overrides)
    assert branches == sorted(normed)
    assert max(errs.values()) < REL, errs


@pytest.mark.parametrize("strategy, normalization, overrides, normed", [
    ("dnp+or", "RMSNorm", {}, "kqv"), ("shared", "LayerNorm", {"qk_layernorm": True}, "kq")])
def test_tensor_parallel_two_ranks_match_the_whole_attention(strategy, normalization, overrides,
                                                             normed):
    """Each rank holds one query group; the vectors in R^head_dim are replicated and their
    gradient summed over TP (DNP's here, stock's QK-norm slots by finalize_model_grads, done by
    hand in _run): equal to the one-process reference's."""
    for branches, errs in run_on_ranks(_run, 2, strategy, HD, normalization, YARN, overrides):
        assert branches == sorted(normed) and max(errs.values()) < REL, errs


def _structure(rank, world):
    from megatron.core.transformer.identity_op import IdentityOp

    init_model_parallel()
    att = _build("unified")
    shapes = {n: tuple(p.shape) for n, p in att.named_parameters() if "_norm." in n}
    with pytest.raises(NotImplementedError, match="unsplit QKV"):
        att.get_query_key_value_tensors(_rand(SEQ, BATCH, HEADS * HD, seed=3), split_qkv=False)
    with pytest.raises(ValueError, match="builds its own q/k norms"):
        _build("unified", stock_norms=IdentityOp)  # the stock q/k layernorm slots stay unset
    return shapes


def test_vectors_are_per_head_dim_and_refusals():
    (shapes,) = run_on_ranks(_structure, 1)
    # OR: a direction in R^head_dim and a magnitude per branch; no stock q_layernorm name
    assert shapes == {f"{b}_norm.{part}": shape for b in "qkv"
                      for part, shape in (("magnitude", (1,)), ("direction", (HD,)))}
