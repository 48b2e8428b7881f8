"""Evidence tools: the paper's ablation ladder, controls and compute-efficiency fit, run through
the real trainer (``megatron_scalevec.training.trainer.main``) and summarized with paired seeds."""
