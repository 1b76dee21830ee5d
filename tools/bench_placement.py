"""Rollout on its own ranks vs colocated (issue 36): step time and the rollout hidden behind the update.

    python tools/bench_placement.py --hf-dir HF --world 3 --json placement.json [key=value ...]

Runs tools/bench_e2e.py four times under torchrun, one after the other, on the same model and overrides:

    colocated_small   colocated at world W - 1 (actor.tp = --tp)
    colocated         colocated at world W (actor.tp = --tp-full, default 1: tp must divide W)
    separate_0        rollout.placement=separate, 1 rollout rank + W - 1 training ranks (actor.tp = --tp),
                      rollout.max_staleness=0 (the training ranks wait for every batch)
    separate_1        the same one step ahead (rollout.max_staleness=1, algo.rollout_correction=token-tis)

and writes one JSON object: each run's bench_e2e result under its name, and
    hidden_frac         1 - rollout_wait_s(separate_1) / rollout_wait_s(separate_0): the share of the
                        rollout the training ranks no longer wait for
    speedup_vs_colocated        step_s(colocated) / step_s(separate_1), equal world
    speedup_vs_colocated_small  step_s(colocated_small) / step_s(separate_1) (one more rank for rollout)
(step_s: the median step time of each run's measured steps). On a machine with fewer cores than ranks the
processes share the cores, so what overlaps in time also competes for them: the JSON records os.cpu_count().
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
SEPARATE = ("--placement", "separate", "--rollout-ranks", "1")


def run_bench_e2e(name: str, nproc: int, args, extra: list[str], out_dir: str, flags: tuple = ()) -> dict:
    """tools/bench_e2e.py under torchrun with `nproc` processes on args.hf_dir (args.steps, args.warmup), its
    `flags`, the user's args.overrides and then this run's `extra` overrides (which win); its JSON, or exit
    naming the failed run."""
    path = os.path.join(out_dir, f"{name}.json")
    cmd = [
        TORCHRUN,
        f"--nproc_per_node={nproc}",
        os.path.join(REPO, "tools", "bench_e2e.py"),
        "--hf-dir",
        args.hf_dir,
        "--json",
        path,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--greedy-repeats",
        "1",
        *flags,
        *args.overrides,
        *extra,
    ]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode != 0:
        sys.exit(f"error: the {name} run failed (exit {r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--world", type=int, default=3, help="W: the world of the separate runs (>= 2)")
    p.add_argument("--tp", type=int, default=2, help="actor.tp of the W - 1 training ranks")
    p.add_argument("--tp-full", type=int, default=1, help="actor.tp of the colocated run at world W")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run (e.g. rollout.engine=native)")
    args = p.parse_args(argv)
    if args.world < 2:
        p.error("--world must be >= 2 (one rollout rank and at least one training rank)")
    out_dir = tempfile.mkdtemp(prefix="bench-placement-")
    w = args.world
    runs = {
        "colocated_small": run_bench_e2e("colocated_small", w - 1, args, [f"actor.tp={args.tp}"], out_dir),
        "colocated": run_bench_e2e("colocated", w, args, [f"actor.tp={args.tp_full}"], out_dir),
        "separate_0": run_bench_e2e(
            "separate_0", w, args, [f"actor.tp={args.tp}", "rollout.max_staleness=0"], out_dir, SEPARATE
        ),
        "separate_1": run_bench_e2e(
            "separate_1",
            w,
            args,
            [f"actor.tp={args.tp}", "rollout.max_staleness=1", "algo.rollout_correction=token-tis"],
            out_dir,
            SEPARATE,
        ),
    }
    step = {name: sorted(r["step_s"])[len(r["step_s"]) // 2] for name, r in runs.items()}
    result = {
        "world": w,
        "cpus": os.cpu_count(),
        "overrides": args.overrides,
        "step_s": step,
        "rollout_wait_s": {name: r["rollout_wait_s"] for name, r in runs.items()},
        "hidden_frac": 1 - runs["separate_1"]["rollout_wait_s"] / runs["separate_0"]["rollout_wait_s"],
        "speedup_vs_colocated": step["colocated"] / step["separate_1"],
        "speedup_vs_colocated_small": step["colocated_small"] / step["separate_1"],
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
