"""Packaging for megatron_scalevec (metadata also summarized in pyproject.toml)."""

from setuptools import find_packages, setup

MUON = "emerging-optimizers==0.3.0; python_version >= '3.12'"
# Megatron-Bridge, installed with `pip install --no-deps` (its own requirements pull GPU-only
# packages), one pin per CI leg: 0.3.1 supports megatron-core < 0.17 (Python 3.11); 0.6.2
# (Python 3.12 only) megatron-core 0.19. Tests import it through testing/bridge_shim.py.
BRIDGE = "megatron-bridge==0.3.1"
BRIDGE_PY312 = "megatron-bridge==0.6.2"

setup(
    name="megatron_scalevec",
    version="0.1.0",
    description="Scale-vector strategy (arXiv 2605.26895) for megatron-core pre-training",
    # 3.11: megatron-core 0.16.1 (its last line for 3.11). 3.12: 0.19.2, run by CI's second leg.
    # 3.13: megatron-core 0.19.2 and torch 2.13.0 ship cp313 wheels (installs; not run in CI).
    python_requires=">=3.11,<3.14",
    packages=find_packages(include=["megatron_scalevec", "megatron_scalevec.*"]),
    install_requires=[
        # Supported: megatron-core 0.16.1 through 0.19.x (compat/mcore.py). From 0.17 it needs
        # Python >= 3.12, so each Python gets the newest release it can run.
        "megatron-core==0.16.1; python_version < '3.12'",
        "megatron-core==0.19.2; python_version >= '3.12'",
        # 3.11: the local CPU wheel of 2.13.0; 3.12+: the registry's (CUDA) build, which runs on
        # CPU. On GPUs install the CUDA build first.
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
        # --optimizer muon; the package exists for Python >= 3.12 only (3.11: a refusal).
        "muon": [MUON],
        "test": ["pytest>=8", "ruff>=0.6", "safetensors==0.8.0", "transformers==5.24.0",
                 "matplotlib>=3.8", MUON],
        # Optional accelerators: Transformer Engine (FP8, fused kernels). NVIDIA apex is built
        # from source; the PyPI package named "apex" is unrelated, so it is never listed.
        "te": ["transformer-engine[pytorch]"],
        # The pure-Python packages Bridge needs to build models and convert checkpoints;
        # Bridge itself: `pip install --no-deps` BRIDGE or BRIDGE_PY312 above.
        "bridge": ["omegaconf==2.4.0", "rich==15.0.0", "einops==0.8.2", "pyyaml>=6",
                   "regex", "tqdm", "transformers==5.24.0", "safetensors==0.8.0"],
    },
    entry_points={"console_scripts": [
        "megatron-scalevec-pretrain = megatron_scalevec.training.trainer:cli",
        "megatron-scalevec-preprocess = megatron_scalevec.training.preprocess:main",
        "megatron-scalevec-convert = megatron_scalevec.convert.cli:main",
        "megatron-scalevec-bench = megatron_scalevec.bench:main",
    ]},
)
