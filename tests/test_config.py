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
