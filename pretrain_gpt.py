"""Pre-train a GPT model with scale vectors. No flags: the embedded default run (small MoE,
unified strategy, CPU, a few minutes). Under torchrun for many ranks:

    torchrun --standalone --nproc-per-node 2 pretrain_gpt.py --tensor-model-parallel-size 2 ...
"""

from megatron_scalevec.training.trainer import cli

if __name__ == "__main__":
    cli()
