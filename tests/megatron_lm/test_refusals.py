"""Flags and settings our ``--spec`` cannot honour, refused by Megatron-LM's own
``pretrain_gpt.py`` in one line (exit 2) before the model is built."""

import os

import pytest

from scalevec_testing import megatron_lm as M
from scalevec_testing.markers import needs_megatron_lm

pytestmark = needs_megatron_lm

REFUSED = {  # name: (strategy, extra flags, environment, what the line names)
    "layernorm_1p": ("shared", ["--apply-layernorm-1p"], {}, "--apply-layernorm-1p"),
    "mtp": ("unified", ["--mtp-num-layers", "1"], {}, "--mtp-num-layers"),
    "wd_qk_under_dnp": ("unified", ["--qk-layernorm", "--apply-wd-to-qk-layernorm"], {},
                        "--apply-wd-to-qk-layernorm"),
    "bad_variable": ("hg+bogus", [], {}, "MEGATRON_SCALEVEC='hg+bogus'"),
    "bad_option": ("unified", [], {"MEGATRON_SCALEVEC_DECAY_DIRECTION": "maybe"},
                   "MEGATRON_SCALEVEC_DECAY_DIRECTION"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_in_one_line_before_the_model_is_built(tmp_path, name):
    strategy, flags, env, named = REFUSED[name]
    out = M.run([*M.TINY, *M.LOCAL, "--position-embedding-type", "rope", *flags, *M.SPEC,
                 "scalevec_dense"], str(tmp_path), env={"MEGATRON_SCALEVEC": strategy, **env})
    lines = [ln for ln in out.output.splitlines() if ln.startswith("megatron_scalevec:")]
    assert out.returncode == 2, out.output[-3000:]
    assert len(lines) == 1 and named in lines[0], lines
    assert out.ranks[0].get("params") is None  # no model was built
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))
