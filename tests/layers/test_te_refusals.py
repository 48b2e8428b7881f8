"""What the Transformer Engine path refuses, each in one line naming the real flag or option (TE's
real Python over scalevec_testing/te_stub.py, inside forked ranks): TE options that cannot carry a
fold (every one that is a TransformerConfig field of this megatron-core), the activation mode, and a
TE build that reads its weights without asking our ``_get_weight_tensors()`` (it fails loudly on the
folded module's first forward)."""

import dataclasses

import pytest
import torch

from megatron_scalevec.layers import te
from scalevec_testing import models as M
from scalevec_testing import run_on_ranks, te_stub
from scalevec_testing.markers import needs_te
from scalevec_testing.te_compare import start_te, te_model, te_moe


def _cfg(name, **kw):
    from megatron_scalevec.config import ScaleVecConfig

    return ScaleVecConfig.from_string(name, **kw)


# ---------------------------------------------------------------- refusals
def _refusal(rank, world, field, strategy, grouped):
    start_te()
    config = M.tiny_config(transformer_impl="transformer_engine")
    if field:
        object.__setattr__(config, field, True)
    from megatron_scalevec.layers.parts import linear_modules

    cls = linear_modules("transformer_engine")["grouped_column" if grouped else "ln_column"]
    args = (4, 32, 48) if grouped else (32, 48)
    extra = {} if grouped else dict(gather_output=False, branches="fc1")
    try:
        with te_stub.cuda_claimed():
            cls(*args, scalevec=strategy, config=config, init_method=torch.nn.init.zeros_,
                bias=False, skip_bias_add=False, is_expert=grouped, **extra)
    except (NotImplementedError, ValueError) as err:
        return str(err)
    return None


def _config_fields():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {f.name for f in dataclasses.fields(TransformerConfig)}


@needs_te
def test_refusals_name_real_flags():
    """Each refused TE option that is a TransformerConfig field of this megatron-core is refused
    in one line naming it (the list must cover the flags that exist here)."""
    fields = _config_fields()
    live = [name for name, _ in te._REFUSED if name in fields]
    assert {"delay_wgrad_compute", "fp8_param"} <= set(live), live
    for name in live:
        grouped = "grouped" in name
        msg = run_on_ranks(_refusal, 1, name, _cfg("hg+dp" if grouped else "unified"),
                           grouped)[0]
        assert msg and f"config.{name}=True" in msg and "\n" not in msg, (name, msg)


@needs_te
def test_refusals_for_activation_mode_and_te_grouped():
    msg = run_on_ranks(_refusal, 1, None, _cfg("hg", apply_mode="activation"), False)[0]
    assert msg and "fold the vectors" in msg, msg
    for name in ("unified", "hg+dp", "hg+dnp+or"):  # every strategy builds on TE grouped
        assert run_on_ranks(_refusal, 1, None, _cfg(name), True)[0] is None, name
    if "moe_mlp_glu_interleave_size" in _config_fields():  # 0.19: gate / up rows interleaved
        msg = run_on_ranks(_refusal, 1, "moe_mlp_glu_interleave_size", _cfg("unified"), True)[0]
        assert msg and "config.moe_mlp_glu_interleave_size" in msg and "\n" not in msg, msg
    msg = run_on_ranks(_refusal, 1, None, _cfg("shared+or"), False)[0]
    assert msg and "plain TE parameter" in msg, msg


@needs_te
def test_te_grouped_refuses_dp_with_a_bias_as_every_linear():
    """DP with a linear bias: one refusal (layers/linear.py ``check_dp_bias``) for the local,
    TE and TE grouped linears, each naming the flag to set."""
    msg = run_on_ranks(_refusal, 1, "add_bias_linear", _cfg("hg+dp"), True)[0]
    assert msg == ("DP output-side vectors with a linear bias are not supported: "
                   "set add_bias_linear=False"), msg
    assert run_on_ranks(_refusal, 1, "add_bias_linear", _cfg("hg+dnp"), True)[0] is None


def _bypassed_fold(rank, world, grouped):
    import types

    start_te()
    model = te_model("hg+dp", **te_moe(4 if grouped else 0, grouped))
    b = M.batches(1, 2)[0]
    with te_stub.cuda_claimed():
        model(b["tokens"], b["position_ids"], None, labels=b["labels"])  # checked: it folds
        folded = [m for m in model.modules() if getattr(m, "_fold_checked", False)]
        victim = next(m for m in folded if ("Grouped" in type(m).__name__) == grouped)
        te_base = next(c for c in type(victim).__mro__
                       if c.__module__.startswith("transformer_engine")
                       and "_get_weight_tensors" in vars(c))
        victim._fold_checked = False  # a fresh process with a TE that reads weights its own way
        victim._get_weight_tensors = types.MethodType(te_base._get_weight_tensors, victim)
        try:
            model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        except RuntimeError as err:
            return len(folded), type(victim).__name__, str(err)
    return len(folded), type(victim).__name__, None


@needs_te
@pytest.mark.parametrize("grouped", [False, True], ids=["linear", "te_grouped"])
def test_a_te_that_bypasses_the_fold_fails_loudly(grouped):
    n, name, err = run_on_ranks(_bypassed_fold, 1, grouped)[0]
    assert n > 0 and err is not None and ("Grouped" in name) == grouped, (n, name)
    assert "did not call _get_weight_tensors()" in err and name in err, err
