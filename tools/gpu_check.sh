#!/usr/bin/env bash
# One-shot GPU check within a GPU budget: under 6 minutes on one H200, the wheel install included. The steps,
# their order, estimates, limits and the one deadline live in tools/gpu_steps.py (`--plan` prints them); this
# script installs the wheels the machine lacks and runs it. Everything lands in $OUT: gpu_check.log and
# gpu_check.json ("ok": false and exit 1 when a mandatory step failed or could not run).
#
#   bash tools/fetch_gpu_wheels.sh        # here, once: megatron-core, TRL and its missing requirements
#   OUT=/some/dir bash tools/gpu_check.sh # there (default OUT: ./gpu_check_out)
# tools/wheels/ is git-ignored: a device run must carry it (this project's device tool:
# run(command="bash tools/gpu_check.sh", carry=["tools/wheels"], timeout_s=420)).
# GPU_CHECK_DEADLINE overrides the steps' deadline in seconds (default: tools/gpu_steps.py's 345).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false

# The wheels (no index there; --no-deps: their other requirements are in the image) go to their own directory,
# first on the path, when one of their packages is missing.
if ! $PY -c "import megatron.core, trl, datasets, dill, multiprocess" 2>/dev/null; then
    wheels=$(ls tools/wheels/*.whl .whl/*.whl 2>/dev/null)
    if [ -n "$wheels" ]; then
        start=$(date +%s)
        # shellcheck disable=SC2086  # one argument per wheel
        if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu_check_site \
            $wheels >"$OUT/wheels.log" 2>&1; then
            echo "wheels installed in $(( $(date +%s) - start )) s"
        else
            echo "wheel install failed: see $OUT/wheels.log"
        fi
        export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "no wheels in tools/wheels/ or .whl/ (bash tools/fetch_gpu_wheels.sh): steps that need them fail"
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

exec $PY tools/gpu_steps.py --python "$PY" ${GPU_CHECK_DEADLINE:+--deadline "$GPU_CHECK_DEADLINE"}
