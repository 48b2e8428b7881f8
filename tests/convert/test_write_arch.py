"""``python -m megatron_scalevec.convert.write_arch``: the arch file ``--arch`` reads, written
from one of our checkpoints (its ``latest`` followed); an existing output is never replaced."""

from megatron_scalevec.convert.arch import ModelArch
from megatron_scalevec.convert.write_arch import main


def test_writes_the_checkpoints_arch_and_refuses_an_existing_file(tmp_path, capsys):
    arch = ModelArch(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                     vocab_size=64, scalevec="hg+dp+or")
    (tmp_path / "save" / "iter_0000003").mkdir(parents=True)
    (tmp_path / "save" / "latest").write_text("3\n")
    arch.save(str(tmp_path / "save" / "iter_0000003"))
    out = tmp_path / "arch.json"
    assert main([str(tmp_path / "save"), str(out)]) == 0
    assert ModelArch.load(str(out)) == arch
    out.write_text("mine")
    assert main([str(tmp_path / "save"), str(out)]) == 2
    assert "File exists" in capsys.readouterr().err and out.read_text() == "mine"
    assert main([str(tmp_path / "nothing"), str(tmp_path / "b.json")]) == 2
    assert not (tmp_path / "b.json").exists()
