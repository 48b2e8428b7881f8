"""ScaleVecConfig parsing, canonical names and conflict messages."""

import pytest

from megatron_scalevec import ScaleVecConfig


@pytest.mark.parametrize("text,expect", [
    ("unified", "hg+dnp+or+iwd"), ("shared", "shared"), ("baseline", "shared"),
    ("none", "none"), ("hg+dnp+or+iwd", "hg+dnp+or+iwd"), ("hg+dp+er", "hg+dp+er"),
    ("HG + DP", "hg+dp"), ("shared+or", "shared+or"), ("iwd", "shared+iwd"),
])
def test_parse_and_round_trip(text, expect):
    cfg = ScaleVecConfig.from_string(text)
    assert cfg.to_string() == expect
    assert ScaleVecConfig.from_string(cfg.to_string()) == cfg


def test_unified_fields():
    cfg = ScaleVecConfig.from_string("unified")
    assert (cfg.hg, cfg.dnp, cfg.dp, cfg.parameterization, cfg.iwd) == (True, True, False, "or",
                                                                          True)
    assert not cfg.is_baseline and ScaleVecConfig.from_string("shared").is_baseline


@pytest.mark.parametrize("text,words", [
    ("hg+dp+dnp", ["dp", "dnp"]), ("hg+or+er", ["or", "er"]), ("none+hg", ["none"]),
    ("shared+hg", ["shared", "hg"]), ("hg+xyz", ["xyz", "known"]), ("", ["empty"]),
])
def test_conflicts_name_the_problem(text, words):
    with pytest.raises(ValueError) as err:
        ScaleVecConfig.from_string(text)
    for w in words:
        assert w in str(err.value)


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="dp.*dnp"):
        ScaleVecConfig(hg=True, dp=True, dnp=True)
    with pytest.raises(ValueError, match="parameterization"):
        ScaleVecConfig(parameterization="xr")
    with pytest.raises(ValueError, match="none"):
        ScaleVecConfig(vectors=False, iwd=True)
    with pytest.raises(ValueError, match="scale_vector_weight_decay"):
        ScaleVecConfig(scale_vector_weight_decay=-1.0)


def test_overrides_through_from_string():
    cfg = ScaleVecConfig.from_string("unified", scale_vector_weight_decay=0.05)
    assert cfg.scale_vector_weight_decay == 0.05


def test_vector_lr_mult_is_validated_resolved_and_recorded():
    """A number > 0; None resolves to the strategy's default at construction (x30, 1 for the
    stock model; a recorded config never changes meaning); a record from before the field
    existed means 1."""
    for bad in (0, -1.0, float("nan"), float("inf"), "7", True):
        with pytest.raises(ValueError, match="vector_lr_mult must be a number > 0"):
            ScaleVecConfig.from_string("shared", vector_lr_mult=bad)
    from megatron_scalevec.config import default_vector_lr_mult

    for s in ("shared", "unified", "hg+dp+er"):
        cfg = ScaleVecConfig.from_string(s)
        assert cfg.vector_lr_mult == default_vector_lr_mult(cfg)
        assert ScaleVecConfig.from_dict(cfg.to_dict()) == cfg
        old = {k: v for k, v in cfg.to_dict().items() if k != "vector_lr_mult"}
        assert ScaleVecConfig.from_dict(old).vector_lr_mult == 1.0
    for s, m in (("unified", 30.0), ("hg+dp+er", 30.0), ("shared+dnp", 30.0), ("shared", 1.0),
                 ("shared+iwd", 1.0), ("none", 1.0)):  # x30 for every model that is not stock
        assert ScaleVecConfig.from_string(s).vector_lr_mult == m, s
    one = ScaleVecConfig.from_string("unified", vector_lr_mult=1)
    assert "vector_lr_mult=1.0" in one.describe()
    seven = ScaleVecConfig.from_string("unified", vector_lr_mult=7)
    assert seven.vector_lr_mult == 7.0 and "vector_lr_mult=7.0" in seven.describe()


@pytest.mark.parametrize("strategy,flags,refused", [
    ("shared", dict(transformer_impl="local"), "plain vectors"),       # ours, gamma - 1 unknown
    ("shared", dict(transformer_impl="transformer_engine"), None),     # TE's own norms honour it
    ("shared+iwd", dict(transformer_impl="transformer_engine"), "IWD"),  # decay toward gamma 1
    ("unified", dict(transformer_impl="transformer_engine"), None),    # OR decays its magnitude
    ("hg+er+iwd", dict(transformer_impl="local"), None),
])
def test_zero_centred_gamma_refused_only_where_it_changes_the_model(strategy, flags, refused):
    import types

    from megatron_scalevec.config import unsupported_with

    opts = types.SimpleNamespace(apply_layernorm_1p=True, **flags)
    why = unsupported_with(opts, ScaleVecConfig.from_string(strategy))
    assert (why is None) if refused is None else (refused in (why or "")), why


def test_reading_a_strategy_imports_no_megatron_core():
    """A command line's strategy is read before an entry point enables the CPU layer and folds
    megatron-core's import warnings: reading it (the registry included) must not import
    megatron-core (a fresh process: this one has it imported)."""
    import subprocess
    import sys

    code = ("import sys; from megatron_scalevec import ScaleVecConfig; "
            "c = ScaleVecConfig.from_string('hg+dnp+er+iwd'); c.describe(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))")
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=root, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": root},
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
