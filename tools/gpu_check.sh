#!/usr/bin/env bash
# One-shot GPU check: everything of the GPU path that a single GPU can show, in about 6-10 minutes on one
# H200 (the varlen step adds ~1-2), summarised in $OUT/gpu_check.json (plus the kernel benchmark JSON, the pytest report and a log).
#
#   bash tools/fetch_gpu_wheels.sh        # here, once: megatron-core for the GPU machine's Python
#   OUT=/some/dir bash tools/gpu_check.sh # there (default OUT: ./gpu_check_out)
# tools/wheels/ is git-ignored: a device run must carry it (this project's device tool:
# run(command="bash tools/gpu_check.sh", carry=["tools/wheels"], timeout_s=600)).
#
# Steps (each under its own time limit; a failing step is recorded and the next one runs):
#   env      torch / CUDA / GPU / library versions
#   tests    pytest tests/gpu: compiled Triton kernels vs the fp64 oracle, actor TP=1 bf16/fp32 vs
#            transformers, megatron DistributedOptimizer vs the CPU optimizer path on the same grads,
#            train-state offload round trip with the DistributedOptimizer (GPU memory freed), and
#            (test_packing_cuda.py) packed rows in Transformer Engine's THD format == padded rows in bf16
#            (log-probs and one update; skipped, with the reason, where TE is missing)
#   kernels  tools/bench_kernels.py at the GPU shape (bf16, 16384 tokens, hidden 4096, vocab 151936; Triton
#            with and without the gradient hint, autotuned: first_call_ms holds the tuning)
#   update_profile tools/bench_update_profile.py: MFU of the update alone and its profile breakdown, random
#            0.89B Llama, bf16, 128 x 144-token rows and 9 x 2048-token rows (one process each)
#            and tests/gpu/test_moe_cuda.py: TE grouped experts vs SequentialMLP vs transformers, vLLM's CUDA
#            reload of MoE experts without the CPU re-processing
#   train    10 steps of the tiny default on the GPU (TP=1, native engine, megatron optimizer)
#   moe_train 10 steps of the MoE default on the GPU (EP=1 on one GPU, grouped experts where TE runs,
#            megatron optimizer with its expert grad norm)
#   replay   routing replay's gap with and without it (tools/bench_routing_replay.py) on a random 16-expert
#            Qwen3-MoE, fp32 and bf16, then 3 bf16 training steps each way (~1-2 min): vLLM's CUDA routed experts when
#            vLLM imports (never run yet), else the native engine's
#   varlen   the variable-length benchmark (issue 29): tools/bench_e2e.py on the 60M shape, every 128th
#            token a stop token (geometric responses, mean ~128, max_new_tokens 512), packed rows under a
#            4096-token budget, then 2 steps with today's padded micro-batches: computed/real tokens and
#            the update's seconds per real token both ways (vLLM when it imports, else the native engine)
#   separate rollout on its own rank (issue 36): 10 steps of the tiny default with 1 training + 1 rollout rank,
#            one step ahead with token-tis (the NCCL bridge: ProcessGroupNCCL broadcast and send/recv); needs 2
#            GPUs (NCCL refuses two ranks on one device): on one GPU it records rc 0 and "skipped: 1 GPU" in the log
#   lora     10 steps of the LoRA default (configs/tiny_cpu_lora.yaml) on the GPU: megatron's GPU optimizer over
#            adapters only, the merged sync, optim/state_mib (issue 37)
#   cpu_tests the fast lane (pytest -m "not slow", tests/gpu left out) with CUDA present: the CPU-tensor
#            tests must keep gloo and CPU placement there (issue 16; the full README command takes ~20 min)
# megatron-core is installed from wheels in tools/wheels/ or .whl/ when the Python there lacks it.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LOG="$OUT/gpu_check.log"
STEPS="$OUT/.steps.jsonl"
: >"$LOG"; : >"$STEPS"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false

if ! $PY -c "import megatron.core" 2>/dev/null; then
    wheels=$(ls tools/wheels/*.whl .whl/*.whl 2>/dev/null)
    if [ -n "$wheels" ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu_check_site \
            $wheels >>"$LOG" 2>&1
        export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME TIMEOUT_S COMMAND...: run, log, record rc and seconds
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*" >>"$LOG"
    local start=$(date +%s%N)
    timeout "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    local ms=$(( ($(date +%s%N) - start) / 1000000 ))
    local secs=$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))
    echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $secs}" >>"$STEPS"
    echo "=== $name: rc=$rc in ${secs}s" | tee -a "$LOG"
}

step env 60 $PY - <<'EOF'
import json, os, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability()))}
for mod in ("megatron.core", "transformers", "triton", "transformer_engine", "apex", "vllm"):
    try:
        m = __import__(mod, fromlist=["_"])
        info[mod] = getattr(m, "__version__", "present")
    except Exception as e:
        info[mod] = None
json.dump(info, open(os.environ["OUT"] + "/.env.json", "w"))
print(info)
EOF

step tests 240 $PY -m pytest -q -p no:cacheprovider tests/gpu --junitxml="$OUT/gpu_tests.xml" -rA

step kernels 240 $PY tools/bench_kernels.py --device cuda --tokens 16384 --hidden 4096 --vocab 151936 \
    --dtype bf16 --repeats 5 --json "$OUT/bench_kernels.json"

step update_profile 300 $PY tools/bench_update_profile.py --json "$OUT/bench_update_profile.json"

TRAIN_DIR=/tmp/gpu_check_train
rm -rf "$TRAIN_DIR"
step train 150 $PY -m torch.distributed.run --nproc_per_node=1 -m remax_megatron.train \
    --config configs/tiny_cpu.yaml actor.tp=1 reward.tp=1 rollout.engine=native trainer.steps=10 trainer.eval_every=10 \
    trainer.output_dir="$TRAIN_DIR" checkpoint.save_every=0 logging.progress_bar=false
cp "$TRAIN_DIR/metrics.jsonl" "$OUT/train_metrics.jsonl" 2>/dev/null

MOE_DIR=/tmp/gpu_check_moe
rm -rf "$MOE_DIR"
step moe_train 150 $PY -m torch.distributed.run --nproc_per_node=1 -m remax_megatron.train \
    --config configs/tiny_cpu_moe.yaml actor.ep=1 rollout.engine=native trainer.steps=10 trainer.eval_every=10 \
    trainer.output_dir="$MOE_DIR" checkpoint.save_every=0 logging.progress_bar=false
cp "$MOE_DIR/metrics.jsonl" "$OUT/moe_train_metrics.jsonl" 2>/dev/null

ENGINE=$($PY -c "import vllm" >/dev/null 2>&1 && echo vllm || echo native)
REPLAY_MODEL=/tmp/gpu_check_qwen3moe
step replay 120 bash -c "$PY tools/make_tiny_model.py --family qwen3_moe --hidden 256 --layers 4 --heads 4 \
    --kv-heads 2 --ffn 128 --experts 16 --top-k 4 --seed 3 --out $REPLAY_MODEL --overwrite >/dev/null && \
    $PY tools/bench_routing_replay.py --model $REPLAY_MODEL --max-new-tokens 32 --prompts 16 --engine $ENGINE \
    --train-steps 3 --nproc 1 --json $OUT/bench_replay.json"

VARLEN_MODEL=/tmp/gpu_check_llama60m
step varlen 240 bash -c "$PY tools/make_tiny_model.py --family llama --hidden 512 --layers 8 --heads 8 \
    --kv-heads 4 --ffn 1408 --vocab 32003 --out $VARLEN_MODEL --overwrite >/dev/null && \
    $PY tools/bench_e2e.py --hf-dir $VARLEN_MODEL --stop-every 128 --padded-steps 2 --steps 3 --warmup 1 \
    --greedy-repeats 1 --json $OUT/bench_varlen.json actor.tp=1 trainer.prompts_per_step=16 rollout.n=2 \
    rollout.max_new_tokens=512 trainer.micro_batch_size=8 trainer.micro_batch_tokens=4096 \
    trainer.pack_sequences=true rollout.kv_cache_gib=0.5 actor.dtype=bfloat16 rollout.engine=$ENGINE"

LORA_DIR=/tmp/gpu_check_lora
rm -rf "$LORA_DIR"
step lora 150 $PY -m torch.distributed.run --nproc_per_node=1 -m remax_megatron.train \
    --config configs/tiny_cpu_lora.yaml actor.tp=1 rollout.engine=native trainer.steps=10 trainer.eval_every=10 \
    trainer.output_dir="$LORA_DIR" checkpoint.save_every=0 logging.progress_bar=false
cp "$LORA_DIR/metrics.jsonl" "$OUT/lora_metrics.jsonl" 2>/dev/null

SEP_DIR=/tmp/gpu_check_separate
rm -rf "$SEP_DIR"
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${GPUS:-0}" -ge 2 ]; then
    step separate 150 $PY -m torch.distributed.run --nproc_per_node=2 -m remax_megatron.train \
        --config configs/tiny_cpu.yaml actor.tp=1 rollout.engine=native rollout.placement=separate rollout.ranks=1 \
        algo.rollout_correction=token-tis rollout.behaviour_logprobs=true trainer.steps=10 trainer.eval_every=10 \
        trainer.output_dir="$SEP_DIR" checkpoint.save_every=0 logging.progress_bar=false
    cp "$SEP_DIR/metrics.jsonl" "$OUT/separate_metrics.jsonl" 2>/dev/null
else
    step separate 5 echo "skipped: 1 GPU (separate placement needs 2: NCCL refuses two ranks on one device)"
fi

step cpu_tests 150 $PY -m pytest -q -p no:cacheprovider -m "not slow" tests --ignore=tests/gpu \
    --junitxml="$OUT/cpu_tests.xml"

$PY - <<'EOF'
import json, os
out = os.environ["OUT"]
def load(name, default=None):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except Exception:
        return default
summary = {"env": load(".env.json"), "steps": [json.loads(l) for l in open(os.path.join(out, ".steps.jsonl"))]}
summary["kernels"] = load("bench_kernels.json")
summary["update_profile"] = load("bench_update_profile.json")
def junit(name):
    try:
        import xml.etree.ElementTree as ET
        suite = ET.parse(os.path.join(out, name)).getroot().find("testsuite")
        counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
        counts["failed"] = [c.get("name") for c in suite.iter("testcase")
                            if c.find("failure") is not None or c.find("error") is not None]
        return counts
    except Exception as e:
        return {"error": str(e)}
summary["tests"] = junit("gpu_tests.xml")
varlen = load("bench_varlen.json")
if varlen:
    summary["varlen"] = {k: varlen.get(k) for k in ("samples_per_s", "computed_over_real", "update_s_per_real_token",
                                                   "update_speedup_per_real_token", "engine", "stages")}
    summary["varlen"]["padded"] = {k: (varlen.get("padded") or {}).get(k)
                                   for k in ("computed_over_real", "update_s_per_real_token")}
summary["cpu_tests"] = junit("cpu_tests.xml")
replay = load("bench_replay.json")
if replay:
    summary["replay"] = {"engine": replay.get("engine"), "controlled": replay.get("controlled"),
                         "trained": [{k: t.get(k) for k in ("replay", "gap_max_median", "gap_mean_median")}
                                     for t in replay.get("trained_bf16", [])]}
try:
    records = [json.loads(l) for l in open(os.path.join(out, "train_metrics.jsonl"))]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval/reward_mean" in r]
    keys = ("loss", "grad_norm", "reward/sampled_mean", "time/step_s", "time/sync_s", "time/rollout_s",
            "time/train_s", "perf/tflops_per_device", "perf/mfu", "memory/peak_gib_train",
            "memory/peak_gib_rollout", "logprob/engine_vs_actor_max_diff")
    summary["train"] = {"steps": len(train), "first": {k: train[0].get(k) for k in keys},
                        "last": {k: train[-1].get(k) for k in keys},
                        "eval": [(r["step"], r["eval/reward_mean"]) for r in evals]}
except Exception as e:
    summary["train"] = {"error": str(e)}
try:
    records = [json.loads(l) for l in open(os.path.join(out, "moe_train_metrics.jsonl"))]
    train = [r for r in records if "loss" in r]
    summary["moe_train"] = {"steps": len(train), "eval": [(r["step"], r["eval/reward_mean"]) for r in records
                                                          if "eval/reward_mean" in r],
                            "last": {k: train[-1].get(k) for k in ("loss", "grad_norm", "moe/aux_loss",
                                                                   "moe/expert_load", "time/step_s")}}
except Exception as e:
    summary["moe_train"] = {"error": str(e)}
try:
    records = [json.loads(l) for l in open(os.path.join(out, "lora_metrics.jsonl"))]
    train = [r for r in records if "loss" in r]
    summary["lora"] = {"steps": len(train), "eval": [(r["step"], r["eval/reward_mean"]) for r in records
                                                     if "eval/reward_mean" in r],
                       "last": {k: train[-1].get(k) for k in ("loss", "grad_norm", "optim/state_mib", "time/step_s",
                                                              "logprob/engine_vs_actor_max_diff")}}
except Exception as e:
    summary["lora"] = {"error": str(e)}
try:
    records = [json.loads(l) for l in open(os.path.join(out, "separate_metrics.jsonl"))]
    train = [r for r in records if "loss" in r]
    summary["separate"] = {"steps": len(train), "eval": [(r["step"], r["eval/reward_mean"]) for r in records
                                                         if "eval/reward_mean" in r],
                           "last": {k: train[-1].get(k) for k in ("rollout/staleness", "time/step_s",
                                                                  "time/rollout_s", "time/sync_s",
                                                                  "logprob/engine_vs_behaviour_max_diff",
                                                                  "is/ratio_mean", "is/clipped_frac")}}
except Exception as e:
    summary["separate"] = {"error": str(e)}
summary["ok"] = all(s["rc"] == 0 for s in summary["steps"])
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=2)
print(json.dumps(summary, indent=2))
EOF
rm -f "$STEPS" "$OUT/.env.json"
