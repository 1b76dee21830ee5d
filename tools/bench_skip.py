"""No compute where ReMax has no signal: trainer.skip_zero_advantage and algo.dynamic_sampling, measured in one run.

    python tools/bench_skip.py --json /tmp/skip.json [--steps 20] [--nproc 2] [key=value ...]

Runs the tiny default (native engine unless overridden) three times from the same seed: skip off, skip on,
and skip on with dynamic sampling. Reports per run the medians over steps after the first of the update
stage and the step, the zero-advantage fraction, the tokens the training forward computed, and the eval
reward gained per second of training steps; and the ratios on / off measured in the same invocation. The
update-time ratio is expected to follow the computed-token ratio (the skipped rows' share).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {
    "skip_off": ["trainer.skip_zero_advantage=off"],
    "skip_on": ["trainer.skip_zero_advantage=on"],
    "skip_on_dynamic": ["trainer.skip_zero_advantage=on", "algo.dynamic_sampling=true"],
}


def run(name: str, overrides: list[str], steps: int, nproc: int, top: str) -> dict:
    out = os.path.join(top, name)
    cmd = [
        sys.executable,
        "-m",
        "remax_megatron.launch",
        f"--nproc_per_node={nproc}",
        "-m",
        "remax_megatron.train",
        "--config",
        "configs/tiny_cpu.yaml",
        "rollout.engine=native",
        f"trainer.steps={steps}",
        "trainer.eval_every=5",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        f"trainer.output_dir={out}",
        *overrides,
    ]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if "loss" in r][1:]  # the first step pays one-time costs
    evals = [r["eval/reward_mean"] for r in records if "eval/reward_mean" in r]

    def median(key):
        return statistics.median(r[key] for r in train)

    # eval reward gained per second of training steps (start-up and eval excluded: the same in every run)
    train_s = sum(r["time/step_s"] for r in records if "loss" in r)
    return {
        "update_s": median("time/update_s"),
        "step_s": median("time/step_s"),
        "train_s": train_s,
        "zero_advantage_frac": statistics.mean(r["batch/zero_advantage_frac"] for r in train),
        "computed_tokens": median("batch/computed_tokens"),
        "skipped_rows": median("batch/skipped_rows"),
        "eval_first": evals[0] if evals else None,
        "eval_last": evals[-1] if evals else None,
        "wall_s": wall,
        "eval_gain_per_train_s": (evals[-1] - evals[0]) / train_s if evals else None,
        "rounds_mean": statistics.mean(r.get("sampling/rounds", 1) for r in train),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as top:
        results = {name: run(name, extra + args.overrides, args.steps, args.nproc, top) for name, extra in RUNS.items()}
    off, on = results["skip_off"], results["skip_on"]
    results["ratios"] = {
        "update_s_on_over_off": on["update_s"] / off["update_s"],
        "computed_tokens_on_over_off": on["computed_tokens"] / off["computed_tokens"],
        "step_s_on_over_off": on["step_s"] / off["step_s"],
    }
    results["config"] = {
        "steps": args.steps,
        "nproc": args.nproc,
        "overrides": args.overrides,
        "base": "configs/tiny_cpu.yaml, rollout.engine=native",
    }
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
