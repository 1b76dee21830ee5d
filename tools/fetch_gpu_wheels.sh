#!/usr/bin/env bash
# Download, here, the wheels tools/gpu_check.sh installs on a GPU machine that cannot reach PyPI:
# megatron-core 0.16.1 built for that machine's Python (3.12 on this project's H200 image; its other
# requirements, torch, numpy and packaging, are there already). Into tools/wheels/ (git-ignored).
#   bash tools/fetch_gpu_wheels.sh [PYTHON_VERSION=3.12]
set -euo pipefail
cd "$(dirname "$0")"
PYV=${1:-3.12}
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels megatron-core==0.16.1
ls -l wheels
