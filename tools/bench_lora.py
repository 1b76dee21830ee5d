"""LoRA vs full fine-tuning on the same model (issue 37): step time, update time, optimizer state, peak memory.

    python tools/bench_lora.py --hf-dir HF --json lora.json [key=value ...]
    torchrun --nproc_per_node=2 ... is not needed: the two runs are launched here, one after the other

Runs tools/bench_e2e.py twice under torchrun with --nproc (default 1) processes on the same model and
overrides, without and with actor.lora_rank=--rank (actor.lora_alpha = 2 * rank), and writes one JSON object:
each run's bench_e2e result under "full" / "lora", and per run from its metrics (medians over the measured
steps): `step_s`, `update_s`, `optim_state_mib` (this rank's optimizer state, optim/state_mib), and
`peak_rss_gib` (the largest memory/rss_gib_* of rank 0: the process's resident memory, libraries included;
on GPU the runs record memory/peak_gib_* instead, reported as `peak_gpu_gib`); then the ratios lora / full.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_placement import run_bench_e2e  # noqa: E402


def measured(result: dict) -> list[dict]:
    """The measured steps' records of a bench_e2e run (after its warm-up)."""
    with open(result["metrics_jsonl"]) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "loss" in r]
    return steps[result["warmup"] : result["warmup"] + result["steps"]]


def summary(result: dict) -> dict:
    steps = measured(result)
    med = lambda key: statistics.median(r[key] for r in steps) if all(key in r for r in steps) else None  # noqa: E731
    peak = lambda prefix: max((v for r in steps for k, v in r.items() if k.startswith(prefix)), default=None)  # noqa: E731
    return {
        "step_s": med("time/step_s"),
        "update_s": med("time/update_s"),
        "optim_state_mib": med("optim/state_mib"),
        "peak_rss_gib": peak("memory/rss_gib_"),
        "peak_gpu_gib": peak("memory/peak_gib_"),
        "samples_per_s": result["samples_per_s"],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 * rank)")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    out_dir = tempfile.mkdtemp(prefix="bench-lora-")
    results = {
        name: run_bench_e2e(name, args.nproc, args, extra, out_dir)
        for name, extra in (
            ("full", []),
            ("lora", [f"actor.lora_rank={args.rank}", f"actor.lora_alpha={2 * args.rank}"]),
        )
    }
    full, lora = summary(results["full"]), summary(results["lora"])
    ratio = {k: lora[k] / full[k] for k in full if full[k] and lora[k] is not None}
    out = {
        "rank": args.rank,
        "nproc": args.nproc,
        "overrides": args.overrides,
        "full": full,
        "lora": lora,
        "lora_over_full": ratio,
        "runs": results,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
