"""Pre-training: the trainer, its data pipeline (``data``, ``preprocess``) and logging.

Nothing is imported here on purpose: importing megatron pulls in ``torch.compile``, so the CPU
compatibility layer must be enabled first; each submodule imports megatron only when called.
"""
