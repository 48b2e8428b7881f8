"""A user's first hour, through the real commands: every mistake is one line and
exit 2 with nothing left behind, a Hugging Face model with transformers' default options warm
starts, resumes follow Megatron-LM's schedule rule, corrupt converter inputs and missing extras
name the file or the extra, and the output carries no library noise."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from scalevec_testing import run_on_ranks
from scalevec_testing.trainer_flags import OVR, TINY

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
CONVERT = os.path.join(ROOT, "tools", "convert_checkpoint.py")
# transformers' defaults but for the sizes (Llama/Mixtral rms_norm_eps 1e-6/1e-5, Mixtral's
# rope_theta 1e6, Qwen3-MoE's norm_topk_prob=False, untied embeddings)
HF_SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
RUN_SIZES = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "8",
             "--ffn-hidden-size", "64", "--untie-embeddings-and-output-weights",
             "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--train-iters", "1", "--eval-interval", "0", "--no-plot", "--quiet"]
FAMILIES = {  # name: (transformers config class, extra config, trainer flags)
    "llama": ("LlamaConfig", {}, ["--spec", "scalevec_dense"]),
    "qwen3": ("Qwen3Config", {}, ["--spec", "scalevec_dense", "--qk-layernorm"]),
    "qwen3moe": ("Qwen3MoeConfig", dict(num_experts=4, moe_intermediate_size=48,
                                        num_experts_per_tok=2),
                 ["--spec", "scalevec_moe", "--num-experts", "4", "--moe-ffn-hidden-size", "48",
                  "--qk-layernorm"]),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2),
                ["--spec", "scalevec_moe", "--num-experts", "4"]),
}


def _cli(*args, timeout=180, env=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env or ENV, timeout=timeout)


def _one_line(p, code=2) -> str:
    """The failure is exactly one line on stderr, no traceback, with exit ``code``."""
    assert p.returncode == code, (p.returncode, p.stderr[-3000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    return lines[0]


def _tree(path) -> dict:
    return {os.path.join(r, f): os.path.getsize(os.path.join(r, f))
            for r, _, fs in os.walk(path) for f in fs}


def _hf_model(path, family):
    import torch
    import transformers as tf

    cls, extra, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(getattr(tf, cls)(**HF_SIZES, **extra))
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """A tiny dense run saved at iteration 2 of 2 (copied by tests that change it)."""
    base = tmp_path_factory.mktemp("first_hour")
    p = _cli("pretrain_gpt.py", *TINY, "--train-iters", "2", "--save", str(base / "ck"))
    assert p.returncode == 0, p.stderr[-3000:]
    return base / "ck"


@pytest.fixture(scope="module")
def llama_ws(tmp_path_factory):
    """The README's HF-in recipe, step 1 (a transformers-default Llama -> unified), as run."""
    base = tmp_path_factory.mktemp("llama")
    _hf_model(str(base / "hf"), "llama")
    p = _cli(CONVERT, "--load", str(base / "hf"), "--to", "unified",
             "--allow-function-change", "--save", str(base / "ws"))
    return base, p


# --- 1. a mismatched --pretrained-checkpoint ----------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--scalevec", "hg+dp+er"], r"holds strategy 'hg\+dnp\+or\+iwd', this run trains "
                                 r"'hg\+dp\+er': pass --scalevec hg\+dnp\+or\+iwd to train its "
                                 r"strategy; a checkpoint with DNP converts to no other"),
    (["--ffn-hidden-size", "96"], r"is another model than this run .*ffn_hidden_size: 64 != 96"),
])
def test_mismatched_pretrained_checkpoint_is_one_line_and_leaves_nothing(ck, tmp_path, flags,
                                                                        message):
    save, run = tmp_path / "save", tmp_path / "run"
    loud = [f for f in TINY if f != "--quiet"]
    p = _cli("pretrain_gpt.py", *loud, "--train-iters", "2", "--pretrained-checkpoint", str(ck),
             "--save", str(save), "--run-dir", str(run), *flags)
    assert re.search(message, _one_line(p))
    assert p.stdout == ""  # refused before the build (which prints the decay groups)
    assert not save.exists() and not run.exists()


def test_refusal_while_loading_leaves_nothing(ck, tmp_path):
    """A source that passes every check before the build (no manifest to verify) and fails
    in the load itself: still one line, and the run dir created meanwhile is removed."""
    src = tmp_path / "src"
    shutil.copytree(ck / "iter_0000002", src)
    (src / "scalevec_manifest.json").unlink()
    victim = sorted(src.glob("__*.distcp"))[-1]
    victim.write_bytes(victim.read_bytes()[:100])
    run = tmp_path / "run"
    p = _cli("pretrain_gpt.py", *TINY, "--train-iters", "2", "--pretrained-checkpoint", str(src),
             "--save", str(run))
    assert "loading the weights failed" in _one_line(p)
    assert not run.exists()


def test_truncated_pretrained_weights_are_one_line(llama_ws, tmp_path):
    base, _ = llama_ws
    ws = tmp_path / "ws"
    shutil.copytree(base / "ws", ws)
    f = ws / "model.safetensors"
    f.write_bytes(f.read_bytes()[:5000])
    run = tmp_path / "run"
    p = _cli("pretrain_gpt.py", *RUN_SIZES, *FAMILIES["llama"][2], "--pretrained-checkpoint",
             str(ws), "--save", str(run))
    line = _one_line(p)
    assert "model.safetensors: not a readable safetensors file (truncated" in line, line
    assert not run.exists()


# --- 2. transformers' default options warm-start -----------------------------------------
def test_readme_hf_in_recipe_runs_with_transformers_defaults(llama_ws, tmp_path):
    """Llama's rms_norm_eps 1e-6 comes from the converted checkpoint (--norm-epsilon unset);
    the converter's report is the whole of stdout, stderr has no warning or progress bar."""
    base, conv = llama_ws
    assert conv.returncode == 0, conv.stderr[-3000:]
    report = json.loads(conv.stdout)  # nothing else shares its lines
    assert report["target"] == "hg+dnp+or+iwd"
    assert conv.stderr == "", conv.stderr  # no progress bar (text=True reads \r as \n)
    assert json.load(open(base / "ws" / "scalevec_arch.json"))["layernorm_epsilon"] == 1e-6
    run = tmp_path / "run"
    p = _cli("pretrain_gpt.py", *RUN_SIZES, *FAMILIES["llama"][2], "--pretrained-checkpoint",
             str(base / "ws"), "--save", str(run))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.load(open(run / "config.json"))["norm_epsilon"] == 1e-6


def _convert_and_train(rank, world, base, family):
    from megatron_scalevec.convert.api import convert
    from megatron_scalevec.training.trainer import main

    hf, ws = os.path.join(base, "hf"), os.path.join(base, "ws")
    _hf_model(hf, family)
    convert(hf, ws, "unified", allow_function_change=True)
    run = os.path.join(base, "run")
    return main(RUN_SIZES + FAMILIES[family][2] + ["--pretrained-checkpoint", ws,
                                                   "--save", run])


@pytest.mark.parametrize("family", ["qwen3", "qwen3moe", "mixtral"])
def test_hf_defaults_warm_start(tmp_path, family):
    """Qwen3 / Qwen3-MoE (eps 1e-6, pre-softmax routing) and Mixtral (rope_theta 1e6): the
    trainer takes them from the checkpoint and trains."""
    losses = run_on_ranks(_convert_and_train, 1, str(tmp_path), family, timeout=300)[0]
    assert len(losses) == 1
    arch = json.load(open(tmp_path / "run" / "iter_0000001" / "scalevec_arch.json"))
    src = json.load(open(tmp_path / "ws" / "scalevec_arch.json"))
    for key in ("layernorm_epsilon", "rotary_base", "moe_router_pre_softmax"):
        assert arch[key] == src[key], key


# --- 3. resume ---------------------------------------------------------------------------
def test_resume_of_a_finished_run_trains_and_writes_nothing(ck, tmp_path):
    before = _tree(ck)
    run = tmp_path / "run"
    p = _cli("pretrain_gpt.py", *TINY, "--train-iters", "2", "--load", str(ck), "--save",
             str(ck), "--run-dir", str(run))
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.fullmatch(r"nothing to train: \S+iter_0000002 is at iteration 2, --train-iters 2 "
                        r"\(pass a larger --train-iters with --override-opt_param-scheduler \(an "
                        r"LR schedule over the new length\) or --use-checkpoint-opt_param-"
                        r"scheduler \(the checkpoint's\) to continue\)", p.stdout.strip())
    assert not run.exists() and _tree(ck) == before


def test_longer_resume_without_a_schedule_flag_is_refused(ck, tmp_path):
    run = tmp_path / "run"
    p = _cli("pretrain_gpt.py", *TINY, "--train-iters", "4", "--load", str(ck),
             "--run-dir", str(run))
    line = _one_line(p)
    assert "changes the checkpoint's LR schedule (--lr-decay-iters 2 -> 4" in line, line
    assert "--override-opt_param-scheduler" in line
    assert "--use-checkpoint-opt_param-scheduler" in line
    assert not run.exists()


@pytest.mark.parametrize("flag, follows", [("--override-opt_param-scheduler", "run"),
                                           ("--use-checkpoint-opt_param-scheduler", "ckpt")])
def test_longer_resume_follows_the_chosen_schedule(ck, tmp_path, flag, follows):
    """Megatron-LM's meaning: --override: this run's cosine over 4 iterations (iteration 3 above
    min_lr); --use-checkpoint: the checkpoint's 2, so min_lr from there on. One line says
    which."""
    save, run = tmp_path / "save", tmp_path / "run"
    shutil.copytree(ck, save)
    flags = [f for f in TINY if f != "--quiet"]
    p = _cli("pretrain_gpt.py", *flags, "--train-iters", "4", "--load", str(save), "--save",
             str(save), "--run-dir", str(run), "--log-interval", "1", flag)
    assert p.returncode == 0, p.stderr[-3000:]
    said = [x for x in p.stdout.splitlines() if x.startswith("LR schedule:")]
    assert len(said) == 1 and flag in said[0], p.stdout
    lr3 = [json.loads(x) for x in open(run / "metrics.jsonl")][0]
    assert lr3["iteration"] == 3
    min_lr = float(TINY[TINY.index("--min-lr") + 1])
    assert (lr3["lr"] > 2 * min_lr) if follows == "run" else lr3["lr"] == pytest.approx(min_lr)


# --- 4. corrupt converter inputs ---------------------------------------------------------
def test_truncated_safetensors_to_the_converter_is_one_line(llama_ws, tmp_path):
    base, _ = llama_ws
    for name in ("hf", "ws"):  # a Hugging Face model, our full format
        src = tmp_path / name
        shutil.copytree(base / name, src)
        f = src / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        out = tmp_path / f"out_{name}"
        line = _one_line(_cli(CONVERT, "--load", str(src), "--to", "stock", "--save", str(out)))
        assert re.fullmatch(r"convert_checkpoint: refused: \S+model\.safetensors: not a readable "
                            r"safetensors file \(truncated or corrupt: .*\)", line), line
        assert not out.exists() and not [p for p in os.listdir(tmp_path) if "out_" in p]


def test_truncated_distcp_hint_does_not_offer_the_checksum_switch(ck, tmp_path):
    src = tmp_path / "ck"
    shutil.copytree(ck, src)
    victim = sorted((src / "iter_0000002").glob("__*.distcp"))[-1]
    victim.write_bytes(victim.read_bytes()[:100])
    out = tmp_path / "out"
    line = _one_line(_cli(CONVERT, "--load", str(src), "--to", "stock", "--save", str(out),
                          "--no-verify-checkpoint"))
    assert f"{victim.name}: 100 bytes" in line and "sizes are checked even with " \
        "--no-verify-checkpoint" in line and "skips this check" not in line, line
    assert not out.exists()


# --- 5. Hugging Face out without the extra -------------------------------------------------
def test_hf_export_without_tokenizers_names_the_extra(llama_ws, tmp_path):
    base, _ = llama_ws
    spm = tmp_path / "tokenizer.model"
    spm.write_bytes(b"\0")  # never read: the missing package is found first
    out = tmp_path / "hf_out"
    code = ("import sys; sys.modules['tokenizers'] = None; "
            "from megatron_scalevec.convert.cli import main; sys.exit(main(sys.argv[1:]))")
    line = _one_line(_cli("-c", code, "--load", str(base / "ws"), "--to", "hf", "--save",
                          str(out), "--tokenizer-model", str(spm)))
    assert line.startswith("convert_checkpoint: missing dependency: this conversion needs the "
                           "optional package 'tokenizers'"), line
    assert "pip install 'megatron_scalevec[convert]'" in line
    assert not out.exists()


# --- 6. noise ------------------------------------------------------------------------------
def test_help_is_quiet_and_shows_defaults():
    conv = _cli(CONVERT, "--help")
    assert conv.returncode == 0 and conv.stderr == "", conv.stderr  # no Apex/TE warnings
    assert "(default: full)" in conv.stdout
    train = _cli("pretrain_gpt.py", "--help")
    assert train.returncode == 0 and train.stderr == "", train.stderr
    assert re.search(r"--lr LR\s+default: 0\.003", train.stdout), train.stdout
    assert re.search(r"--num-layers NUM_LAYERS\s+default: 4", train.stdout)
    for tool in ("preprocess_data.py", "plot_run.py", "example_data.py"):
        p = _cli(os.path.join(ROOT, "tools", tool), "--help")
        assert p.returncode == 0 and "default: " in p.stdout, tool


def test_no_eta_from_a_compiling_first_iteration(monkeypatch):
    """The first iteration alone (start-up, compilation: 20x a step) gives no ETA; the line
    says why; later intervals do."""
    from megatron_scalevec.training import summary

    clock = iter([0.0, 20.0, 21.0])
    monkeypatch.setattr(summary.time, "time", lambda: next(clock))
    speed = summary.Throughput(100, 11, 0)
    first = speed.update(1)
    assert "eta_s" not in first
    rec = dict(iteration=1, train_iters=11, loss=1.0, lr=1e-3, grad_norm=1.0, **first)
    assert "compiling" in summary.format_line(rec)
    assert speed.update(2)["eta_s"] == pytest.approx(9.0)


def test_tp2_sp_run_prints_no_library_warnings(tmp_path):
    """torchrun TP2+SP: none of torch.distributed's FutureWarnings (46 lines on a real run) or
    megatron-core's other deprecations reach the console; before the first iteration there is
    the start-up summary only (the argument table lists flags not at their default)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    p = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2",
                        os.path.join(ROOT, "pretrain_gpt.py"),
                        *[f for f in TINY if f != "--quiet"], "--train-iters", "2",
                        "--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--save", str(tmp_path / "run")],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Warning" not in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    head = p.stdout.split("iter      1/2")[0].splitlines()
    table = [x for x in head if re.match(r"  \w+ \.+ ", x)]
    assert len(head) - len(table) < 20, p.stdout


# --- 7. refusals that name the real reason ------------------------------------------------
@pytest.mark.parametrize("target, flags", [("stock", []),
                                           ("hg+dp+er", ["--allow-function-change"])])
def test_dnp_checkpoint_conversion_names_why_it_cannot_fold(ck, tmp_path, target, flags):
    out = tmp_path / "out"
    line = _one_line(_cli(CONVERT, "--load", str(ck), "--to", target, "--save", str(out),
                          *flags))
    assert f"to {target}: its DNP normalizations on branches ['gate', 'up', 'v']" in line, line
    assert "not even with --allow-function-change" in line and "hg+dp+or" in line, line
    assert "stock megatron-core model" not in line, line
    assert not out.exists()


def test_run_dir_without_checkpoint_is_named_so(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 1, "loss": 1.0}\n')
    (run / "config.json").write_text('{"spec": "scalevec_dense"}')  # what the trainer writes
    line = _one_line(_cli(CONVERT, "--load", str(run), "--to", "hf", "--save",
                          str(tmp_path / "out")))
    assert "a run directory without a checkpoint" in line and "Hugging Face" not in line, line


def test_pretrained_checkpoint_without_safetensors_is_one_line(llama_ws, tmp_path):
    base, _ = llama_ws
    code = ("import sys; sys.modules['safetensors'] = None; "
            "from megatron_scalevec.training.trainer import cli; cli()")
    run = tmp_path / "run"
    line = _one_line(_cli("-c", code, *RUN_SIZES, *FAMILIES["llama"][2],
                          "--pretrained-checkpoint", str(base / "ws"), "--save", str(run)))
    assert "needs the optional package 'safetensors'" in line, line
    assert "pip install 'megatron_scalevec[convert]'" in line and not run.exists(), line


def test_flag_refusal_under_torchrun_is_printed_once(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    p = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2",
                        os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--lr", "-1",
                        "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=240)
    assert p.returncode != 0
    assert p.stderr.count("error: --lr -1.0 must be > 0") == 1, p.stderr[-3000:]


# --- 8. every refusal's advice, followed -------------------------------------------------
def test_resume_of_another_model_lists_every_field_and_its_flags_work(ck, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(ck, save)
    base = [*TINY, "--train-iters", "3", OVR, "--load", str(save)]
    other = ["--num-layers", "3", "--hidden-size", "48", "--qk-layernorm"]
    line = _one_line(_cli("pretrain_gpt.py", *base, *other))
    for field in ("num_layers 2 (this run 3)", "hidden_size 32 (this run 48)",
                  "qk_layernorm False (this run True)"):
        assert field in line, line
    m = re.search(r"to resume it pass (.*) and drop (--\S+)$", line)
    assert m and m.group(1).split() == ["--num-layers", "2", "--hidden-size", "32"], line
    p = _cli("pretrain_gpt.py", *base, *[f for f in other if f != m.group(2)], *m.group(1).split())
    assert p.returncode == 0, p.stderr[-3000:]
    assert (save / "latest").read_text().strip() == "3"


def test_strategy_refusal_of_a_dnp_checkpoint_offers_no_conversion(ck, tmp_path):
    base = [*TINY, "--train-iters", "2", "--load", str(ck), "--run-dir", str(tmp_path / "r")]
    line = _one_line(_cli("pretrain_gpt.py", *base, "--scalevec", "hg+dp+er"))
    assert "converts to no other strategy" in line and "convert_checkpoint" not in line, line
    m = re.search(r"pass (--scalevec \S+) to resume it", line)
    p = _cli("pretrain_gpt.py", *base, *m.group(1).split())
    assert p.returncode == 0 and p.stdout.startswith("nothing to train"), p.stderr[-3000:]


def test_conversion_advice_of_a_foldable_checkpoint_works(tmp_path):
    ck = tmp_path / "ck"
    p = _cli("pretrain_gpt.py", *TINY, "--train-iters", "1", "--scalevec", "hg+dp+or", "--save",
             str(ck))
    assert p.returncode == 0, p.stderr[-3000:]
    run = [*TINY, "--train-iters", "1", "--scalevec", "hg+dp+er"]
    line = _one_line(_cli("pretrain_gpt.py", *run, "--load", str(ck), "--run-dir",
                          str(tmp_path / "r")))
    m = re.search(r"python (tools/convert_checkpoint\.py .*) --save DIR, then "
                  r"--pretrained-checkpoint DIR", line)
    assert m, line
    out = tmp_path / "converted"
    p = _cli(*m.group(1).split(), "--save", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    p = _cli("pretrain_gpt.py", *run, "--pretrained-checkpoint", str(out), "--save",
             str(tmp_path / "new"))
    assert p.returncode == 0, p.stderr[-3000:]


def test_run_dir_refusal_advice_is_followed(ck, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(ck, save)
    again = [*TINY, "--train-iters", "2", "--save", str(save)]  # ck's own command, again
    line = _one_line(_cli("pretrain_gpt.py", *again))
    m = re.search(r"pass (--load \S+) to resume it", line)
    assert m and "--overwrite" in line, line
    p = _cli("pretrain_gpt.py", *again, *m.group(1).split())
    assert p.returncode == 0 and p.stdout.startswith("nothing to train"), p.stderr[-3000:]


def test_megatron_lm_strategy_variables_are_refused(monkeypatch, tmp_path):
    """Both named in one line with the flags that replace them, which then give the same
    strategy; a test-only variable (MEGATRON_SCALEVEC_TINY) is not refused."""
    from megatron_scalevec import megatron_lm
    from megatron_scalevec.training.arguments import ArgumentError, parse_args

    flags = TINY + ["--run-dir", str(tmp_path / "r")]
    monkeypatch.setenv("MEGATRON_SCALEVEC_TINY", "1")
    monkeypatch.setenv("MEGATRON_SCALEVEC", "hg+dp+er")
    monkeypatch.setenv("MEGATRON_SCALEVEC_VECTOR_WD", "0.05")
    with pytest.raises(ArgumentError) as e:
        parse_args(flags)
    line = str(e.value)
    assert "\n" not in line and "Megatron-LM" in line, line
    use = re.search(r"pass (.*) instead", line).group(1).replace(",", "").split()
    assert use == ["--scalevec", "hg+dp+er", "--scale-vector-weight-decay", "0.05"], line
    monkeypatch.delenv("MEGATRON_SCALEVEC")
    monkeypatch.delenv("MEGATRON_SCALEVEC_VECTOR_WD")
    cfg = parse_args(flags + use).scalevec_config
    assert cfg.to_string() == "hg+dp+er" and cfg.scale_vector_weight_decay == 0.05
    monkeypatch.setattr(megatron_lm, "STRATEGY_ENV_VARS", (*megatron_lm.STRATEGY_ENV_VARS,
                                                           "MEGATRON_SCALEVEC_NEW"))
    monkeypatch.setenv("MEGATRON_SCALEVEC_NEW", "x")  # a name added to the list is refused too
    with pytest.raises(ArgumentError, match="MEGATRON_SCALEVEC_NEW=x"):
        parse_args(flags)
