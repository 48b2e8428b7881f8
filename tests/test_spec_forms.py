"""The ways a model reaches our spec, on the installed megatron-core: plain
``GPTModel(config, transformer_layer_spec=get_scalevec_block_spec(config, ...))``, the callable
form Megatron-Bridge providers take (``scalevec_moe_spec(config, vp_stage=...)``), and the
names Megatron-LM's ``megatron/training`` must offer the installer (read from its source, as
shipped in the megatron-core wheel from 0.17 on)."""

import ast
import importlib.util
import pathlib

import pytest
import torch

from megatron_scalevec import megatron_lm
from scalevec_testing import models as M
from scalevec_testing.distributed import init_model_parallel, run_on_ranks

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
           moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, moe_layer_freq=[0, 1])


def _build(rank, world, form, moe):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_scalevec import specs
    from megatron_scalevec.norms import ScaleVecNorm

    init_model_parallel()
    config = M.tiny_config(**(MOE if moe else {}))
    if form == "block":
        spec = specs.get_scalevec_block_spec(config, "hg+dp+er")
    elif form == "callable":  # what a Bridge provider / Megatron-LM's builder does with it
        fn = specs.scalevec_moe_spec if moe else specs.scalevec_dense_spec
        spec = fn(config, vp_stage=None)
    torch.manual_seed(0)
    model = GPTModel(config, transformer_layer_spec=spec, vocab_size=M.VOCAB,
                     max_sequence_length=M.SEQ, position_embedding_type="rope")
    tokens = torch.randint(0, M.VOCAB, (2, M.SEQ))
    pos = torch.arange(M.SEQ)[None].expand(2, M.SEQ)
    loss = model(tokens, pos, None, labels=tokens).float().mean()
    loss.backward()
    names = [n for n, _ in model.named_parameters()]
    return (float(loss), isinstance(model.decoder.final_layernorm, ScaleVecNorm),
            sorted({n.split(".")[2] for n in names if ".mlp.experts." in n}),
            any("scale_in" in n for n in names))


@pytest.mark.parametrize("form,moe", [("block", False), ("block", True), ("callable", False),
                                      ("callable", True)])
def test_spec_forms_build_a_working_gpt(form, moe):
    loss, our_norm, expert_layers, has_vectors = run_on_ranks(_build, 1, form, moe)[0]
    assert 0.0 < loss < 20.0 and our_norm and has_vectors
    assert expert_layers == (["1"] if moe else [])  # moe_layer_freq=[0, 1]


def _dense_on_moe(rank, world):
    from megatron_scalevec.specs import scalevec_dense_spec

    init_model_parallel()
    try:
        scalevec_dense_spec(M.tiny_config(**MOE))
    except ValueError as e:
        return str(e)
    return None


def test_dense_callable_refuses_an_moe_config():
    message = run_on_ranks(_dense_on_moe, 1)[0]
    assert message and "num_moe_experts=4; use scalevec_moe_spec" in message


def _source(module: str):
    spec = importlib.util.find_spec(module)
    return ast.parse(pathlib.Path(spec.origin).read_text())


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                    reason="no megatron/training here (megatron-core < 0.17 does not ship it)")
def test_megatron_training_offers_what_the_installer_wraps():
    """The import contract, read from the source (importing megatron.training costs ~40 s)."""
    tree = _source("megatron.training.training")
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                for a in n.names}
    for name in megatron_lm.WRAPPED + megatron_lm.OPTIONAL:
        present = name in defs or name in imported
        assert present or name in megatron_lm.OPTIONAL, f"training.py lacks {name}"
    assert [a.arg for a in defs["get_megatron_optimizer_config"].args.args] == ["args"]
    # wrap_training_log reads the iteration as the 4th positional argument
    assert [a.arg for a in defs["training_log"].args.args][3] == "iteration"
    package = {a.asname or a.name for n in _source("megatron.training").body
               if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {"get_args", "get_tensorboard_writer", "get_wandb_writer",
            "print_rank_last"} <= package
    # specs.py sizes the lazy block from it (defined there up to 0.17, re-exported from 0.18)
    arguments = _source("megatron.training.arguments").body
    args = {n.name for n in arguments if isinstance(n, ast.FunctionDef)} | \
        {a.asname or a.name for n in arguments if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "core_transformer_config_from_args" in args
