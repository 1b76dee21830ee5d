#!/usr/bin/env bash
# Download, here, the wheels tools/gpu_check.sh installs on a GPU machine that cannot reach PyPI, built for that
# machine's Python (3.12 on this project's H200 image: torch 2.11, transformers 5.17, accelerate, pyarrow there):
#   megatron-core 0.16.1 (the actor; its torch, numpy and packaging are there),
#   trl 1.16.0 with the requirements the image lacks: datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19
#   (the peer comparison, tools/bench_e2e.py --peer trl).
# Into tools/wheels/ (git-ignored; a few MB in all). --no-deps: nothing else is fetched, so a requirement the
# image lacks must be named here.
#   bash tools/fetch_gpu_wheels.sh [PYTHON_VERSION=3.12]
set -euo pipefail
cd "$(dirname "$0")"
PYV=${1:-3.12}
PACKAGES=(megatron-core==0.16.1 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
mkdir -p wheels
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d wheels "${PACKAGES[@]}"
# One version of each package: two wheels of one name stop the whole install there.
dupes=$(ls wheels/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "more than one wheel of: $dupes (remove the old ones from tools/wheels/)" >&2
    exit 1
fi
ls -l wheels
