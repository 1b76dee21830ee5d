#!/usr/bin/env bash
# Example: ReMax on Llama-3-8B, 2 nodes x 8 GPUs (16 ranks), submitted with remax.sbatch.
#
#   MODEL=/models/Meta-Llama-3-8B-Instruct bash launch/slurm/example_2x8.sh CONFIG.yaml [key=value ...]
#   DRY_RUN=1 bash launch/slurm/example_2x8.sh CONFIG.yaml     # print both nodes' torchrun commands
#
# Layout: actor TP=4 inside a node (NVLink), PP=1, so DP = 16 / 4 = 4; the
# rollout engine runs at TP=2 (8 engines), which halves the actor-TP weight
# gather per engine and gives vLLM more KV cache per GPU. The planner checks
# this layout and its memory before you queue:
#   python -m remax_megatron.plan --config CONFIG --nodes 2 --gpus-per-node 8 --gpu-mem-gib 80 <overrides below>
# The dry run fakes the SLURM variables of such a job on this machine.
set -euo pipefail

[[ $# -ge 1 ]] || {
  echo "error: no config file given; usage: MODEL=HF_DIR bash launch/slurm/example_2x8.sh CONFIG.yaml [key=value ...]" >&2
  exit 2
}
config=$1
shift
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model=${MODEL:-configs/models/llama3-8b}

overrides=(
  "actor.model=$model"
  actor.tp=4
  actor.pp=1
  actor.dtype=bfloat16
  actor.sequence_parallel=true
  actor.recompute=selective
  optim.distributed_optimizer=true
  rollout.engine=vllm
  rollout.tp=2
  trainer.prompts_per_step=64
  trainer.micro_batch_size=4
  checkpoint.save_every=20
  "$@"
)

if [[ ${DRY_RUN:-0} == 1 ]]; then
  echo "# sbatch --nodes=2 --gpus-per-node=8 launch/slurm/remax.sbatch $config ${overrides[*]}"
  SLURM_JOB_NODELIST='node[01-02]' SLURM_NNODES=2 SLURM_JOB_ID=${SLURM_JOB_ID:-12345} GPUS_PER_NODE=8 \
    DRY_RUN=1 bash "$repo/launch/slurm/remax.sbatch" "$config" "${overrides[@]}"
  exit 0
fi

# sbatch does not create the directory of --output; the per-node logs go under logs/remax.
mkdir -p logs/remax
sbatch --nodes=2 --gpus-per-node=8 --ntasks-per-node=1 --job-name=remax-llama3-8b \
  "$repo/launch/slurm/remax.sbatch" "$config" "${overrides[@]}"
