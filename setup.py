"""Packaging for megatron_scalevec (metadata also summarized in pyproject.toml)."""

from setuptools import find_packages, setup

setup(
    name="megatron_scalevec",
    version="0.1.0",
    description="Scale-vector strategy (arXiv 2605.26895) for megatron-core pre-training",
    python_requires=">=3.11,<3.13",
    packages=find_packages(include=["megatron_scalevec", "megatron_scalevec.*"]),
    install_requires=[
        # megatron-core 0.16.x ships cp311/cp312 wheels; newer ones need Python >= 3.12.
        "megatron-core==0.16.1",
        # The CPU wheel of 2.13.0 lies on these machines; on GPUs install the CUDA build first.
        "torch==2.13.0",
        "numpy>=1.26,<3",
        "sentencepiece==0.2.3",
        # dist_checkpointing needs psutil but megatron-core does not declare it.
        "psutil>=5.9",
    ],
    extras_require={
        # Conversion to/from Hugging Face (safetensors for our own full format too).
        "convert": ["safetensors==0.8.0", "transformers==5.24.0"],
        "plot": ["matplotlib>=3.8"],
        "test": ["pytest>=8", "ruff>=0.6", "safetensors==0.8.0", "transformers==5.24.0",
                 "matplotlib>=3.8"],
        # Optional accelerators: Transformer Engine (FP8, fused kernels). NVIDIA apex is built
        # from source; the PyPI package named "apex" is unrelated, so it is never listed.
        "te": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": [
        "megatron-scalevec-pretrain = megatron_scalevec.training.trainer:cli",
        "megatron-scalevec-preprocess = megatron_scalevec.training.preprocess:main",
        "megatron-scalevec-convert = megatron_scalevec.convert.cli:main",
        "megatron-scalevec-bench = megatron_scalevec.bench:main",
    ]},
)
