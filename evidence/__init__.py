"""Evidence tooling, not part of the installed package: the paper's ablation ladder, controls and
compute-efficiency fit, FP8 numerics, run through the real trainer
(``megatron_scalevec.training.trainer.main``) and summarized with paired seeds. Imported by
``tools/*.py`` and the tests from the repository root."""
