"""Run by test_cpu_off.py in a fresh process (no conftest.py, no test stand-ins): the library
imported, its entry modules too, a model built from the converter's library code and trained
two steps on CPU, all without the CPU layer. Prints JSON: what changed in torch, and the loss."""

import json
import math

import torch
import torch.distributed as dist


def callables() -> dict:
    """Every callable the CPU layer could replace, by name (torch.cuda's, the collectives')."""
    out = {"torch.compile": torch.compile}
    for mod in (torch.cuda, torch.cuda.random, dist, dist.distributed_c10d):
        out.update({f"{mod.__name__}.{k}": v for k, v in vars(mod).items() if callable(v)})
    return out


before = callables()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.tensor_parallel.random import initialize_rng_tracker  # noqa: E402

import megatron_scalevec  # noqa: E402, F401
from megatron_scalevec import compile as fused_compile  # noqa: E402
from megatron_scalevec import env  # noqa: E402
from megatron_scalevec.convert import build, cli  # noqa: E402, F401
from megatron_scalevec.convert.arch import ModelArch  # noqa: E402
from megatron_scalevec.specs import get_scalevec_block_spec  # noqa: E402
from megatron_scalevec.training import preprocess, trainer  # noqa: E402, F401

facts = env.facts()  # the library half of `python -m megatron_scalevec.env`

# Two CUDA requests of megatron-core's that the CPU layer would otherwise answer (0.16.1 and
# 0.19.2): the RNG tracker's fork (the inference tracker, public initialize_rng_tracker, forks
# nothing; model_parallel_cuda_manual_seed keeps it) and DotProductAttention's scratch buffer
# (private GlobalMemoryBuffer.buffer, filled here on the CPU, keyed (name, dtype)).
initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
arch = ModelArch(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                 ffn_hidden_size=64, vocab_size=64, max_sequence_length=32, scalevec="unified")
build.ensure_parallel_state()
parallel_state.get_global_memory_buffer().buffer[("mpu", torch.float32)] = torch.empty(1 << 14)
config = build.transformer_config(arch)
# RoPE moves its frequencies to torch.cuda.current_device() (0.16.1, 0.19.2): learned positions
model = GPTModel(config, get_scalevec_block_spec(config, arch.strategy()), vocab_size=64,
                 max_sequence_length=32, position_embedding_type="learned_absolute")
model.train()
tokens, positions = build.sample_batch(arch, batch=2, seq=16)
mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)  # megatron's default asks for cuda
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for _ in range(2):
    loss = model(tokens, positions, mask, labels=tokens).float().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())

after = callables()
cpu = __import__("sys").modules.get("megatron_scalevec.compat.cpu")
print(json.dumps({
    "changed": sorted(k for k in before if after.get(k) is not before[k]),
    "modes": [type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()],
    "cpu_layer_enabled": bool(cpu and cpu.is_cpu_compat_enabled()),
    "compiled_call_plain": fused_compile._run is fused_compile._run_plain,
    "losses": losses, "finite": all(map(math.isfinite, losses)),
    "linears_local": facts["linears_local"],
}))
dist.destroy_process_group()
