"""Compatibility layers that let megatron-core run where it was not written to run."""
