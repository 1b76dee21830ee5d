#!/usr/bin/env bash
# Single-node launch: one process per GPU under remax_megatron.launch (torchrun's agent, with
# SIGTERM / SIGUSR1 / SIGINT forwarded to the workers, which save and exit 0, and the workers' exit code),
# overrides passed through.
#
#   bash launch/torchrun.sh configs/tiny_cpu.yaml actor.tp=2 trainer.steps=10
#   NPROC=4 bash launch/torchrun.sh CONFIG ...        # 4 processes (e.g. 4 of 8 GPUs, or 4 on CPU)
#   DRY_RUN=1 bash launch/torchrun.sh CONFIG ...      # print the command, run nothing
#
# Process count: NPROC if set, else the visible GPUs (CUDA_VISIBLE_DEVICES, else
# nvidia-smi), else 1 on a machine without GPUs. --standalone lets torchrun pick a
# free rendezvous port, so two single-node jobs on one machine do not collide.
# Environment: DRY_RUN, NPROC, PYTHON (default: python), TORCHRUN (a plain torchrun command
# instead of the launcher: stop signals then kill it, see remax_megatron/launch.py).
set -euo pipefail

usage="usage: bash launch/torchrun.sh CONFIG.yaml [key=value ...]"

die() {
  echo "error: $*" >&2
  exit 2
}

[[ $# -ge 1 ]] || die "no config file given; $usage"
config=$1
shift
[[ -f $config ]] || die "config file $config not found; $usage"
for arg in "$@"; do
  [[ $arg == *=* ]] || die "override '$arg' is not key=value (e.g. actor.tp=2); $usage"
done

# Relative paths in the config resolve against the caller's directory (the README
# runs everything from the repo root); PYTHONPATH makes the package importable
# from elsewhere too, installed or not.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

count_gpus() {
  # CUDA_VISIBLE_DEVICES wins over nvidia-smi: it is what the processes will see.
  if [[ -n ${CUDA_VISIBLE_DEVICES+x} ]]; then
    if [[ -z $CUDA_VISIBLE_DEVICES || $CUDA_VISIBLE_DEVICES == "-1" ]]; then
      echo 0
    else
      local ids
      IFS=, read -r -a ids <<<"$CUDA_VISIBLE_DEVICES"
      echo "${#ids[@]}"
    fi
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

if [[ -n ${NPROC:-} ]]; then
  [[ $NPROC =~ ^[1-9][0-9]*$ ]] || die "NPROC=$NPROC is not a positive integer"
  nproc=$NPROC
else
  nproc=$(count_gpus)
  if [[ $nproc -eq 0 ]]; then
    nproc=1
    echo "launch/torchrun.sh: no GPU visible, starting 1 CPU process (set NPROC=N for more)" >&2
  fi
fi

if [[ -n ${TORCHRUN:-} ]]; then
  launcher=("$TORCHRUN")
else
  launcher=("${PYTHON:-python}" -m remax_megatron.launch)
fi
cmd=("${launcher[@]}" --standalone --nnodes=1 "--nproc_per_node=$nproc"
  -m remax_megatron.train --config "$config" "$@")

if [[ ${DRY_RUN:-0} == 1 ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi

exec "${cmd[@]}"
