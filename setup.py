"""Installs the ``folding`` package: an MoE training engine built around MoE Parallel Folding.

CPU machines: install ``torch==2.13.0`` (a CPU build) *before* this package, as ``.ci/run`` and the
README do; the ``torch>=2.4`` requirement below is then already satisfied and pip pulls no CUDA build.
"""

from setuptools import find_packages, setup

setup(
    name="folding",
    version="0.1.0",
    description="PyTorch training engine for Mixture-of-Experts models with MoE Parallel Folding",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["folding", "folding.*"]),
    package_data={"folding": ["data/corpus/*"]},
    install_requires=[
        "torch>=2.4",
        "numpy",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "safetensors",
        "wandb>=0.20",  # reinit="finish_previous"
        "matplotlib",  # tools/plot_run.py, shown in the README right after the install
    ],
    extras_require={
        # the TE range folding/moe/experts/te.py was written against (TE_VERSION_RANGE there)
        "te": ["transformer_engine[pytorch]>=2.10,<3"],
        "hf": ["transformers>=4.46"],
        # megatron-core: an independent oracle for the routing helpers in the tests; ruff: lint and
        # format (pinned: a new release may format differently), run by tests/unit/test_lint.py
        "dev": [
            "pytest",
            "pytest-timeout",
            "pytest-xdist",
            "hypothesis",
            "transformers>=4.46",
            "megatron-core==0.16.1",
            "ruff==0.17.6",
        ],
    },
)
