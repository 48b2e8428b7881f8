"""Packaging for megatron_scalevec (metadata also summarized in pyproject.toml)."""

from setuptools import find_packages, setup

# Ranges, not pins: installing into an environment (an NGC container, a cluster's venv) that
# already has an in-range torch / megatron-core changes neither (tests/test_packaging.py). The
# exact versions CI installs are in constraints/cpu.txt (pip install -c constraints/cpu.txt ...).
MUON = "emerging-optimizers>=0.3.0,<0.4; python_version >= '3.12'"
CONVERT = ["safetensors>=0.8.0,<0.9", "transformers>=5.24.0,<6"]
TENSORBOARD = "tensorboard>=2.16,<3"  # --tensorboard-dir (metrics.jsonl needs nothing)
BRIDGE_DEPS = ["omegaconf>=2.3,<3", "rich>=13", "einops>=0.8,<1", "pyyaml>=6", "regex", "tqdm"]
# What Megatron-LM's megatron/training imports (tests/megatron_lm/ run its pretrain_gpt.py)
MEGATRON_LM_DEPS = ["six", "regex", "pyyaml>=6", "pydantic>=2"]

setup(
    name="megatron_scalevec",
    version="0.1.0",
    description="Scale-vector strategy (arXiv 2605.26895) for megatron-core pre-training",
    # 3.11: megatron-core 0.16.1 (its last line for 3.11). 3.12: 0.19.2, run by CI's second leg.
    # 3.13: megatron-core 0.19.2 and torch 2.13.0 ship cp313 wheels (installs; not run in CI).
    python_requires=">=3.11,<3.14",
    packages=find_packages(include=["megatron_scalevec", "megatron_scalevec.*"]),
    install_requires=[
        # Supported: megatron-core 0.16.1 through 0.19.x (compat/mcore.py); CI runs both ends
        # (0.16.1 on Python 3.11, 0.19.2 on 3.12). From 0.17 it needs Python >= 3.12, so pip
        # gives each Python the newest release it can run.
        "megatron-core>=0.16.1,<0.20",
        # The 2.13 line, NGC's pre-release builds (2.13.0a0+<git>) included: an exact
        # "torch==2.13.0" would make pip replace a container's CUDA torch. CI runs 2.13.0;
        # widen a bound once a CI leg runs that end.
        "torch>=2.13.0a0,<2.14",
        "numpy>=1.26,<3",
        "sentencepiece>=0.2.3,<0.3",
        # dist_checkpointing needs psutil but megatron-core does not declare it.
        "psutil>=5.9",
    ],
    extras_require={
        # Conversion to/from Hugging Face (safetensors for our own full format too).
        "convert": CONVERT,
        "plot": ["matplotlib>=3.8"],
        "tensorboard": [TENSORBOARD],
        # --optimizer muon; the package exists for Python >= 3.12 only (3.11: a refusal).
        "muon": [MUON],
        "test": ["pytest>=8", "ruff>=0.6", *CONVERT, "matplotlib>=3.8", TENSORBOARD, MUON,
                 *BRIDGE_DEPS, *MEGATRON_LM_DEPS],
        # Optional accelerators: Transformer Engine (FP8, fused kernels). NVIDIA apex is built
        # from source; the PyPI package named "apex" is unrelated, so it is never listed.
        "te": ["transformer-engine[pytorch]"],
        # The pure-Python packages Megatron-Bridge needs to build models and convert
        # checkpoints; Bridge itself goes in with `pip install --no-deps` (its own requirements
        # pull GPU-only packages): tools/test_deps.sh, constraints/cpu.txt's pins.
        "bridge": [*BRIDGE_DEPS, *CONVERT],
    },
    entry_points={"console_scripts": [
        "megatron-scalevec-pretrain = megatron_scalevec.training.trainer:cli",
        "megatron-scalevec-preprocess = megatron_scalevec.training.preprocess:main",
        "megatron-scalevec-convert = megatron_scalevec.convert.cli:main",
        "megatron-scalevec-env = megatron_scalevec.env:main",
    ]},
)
