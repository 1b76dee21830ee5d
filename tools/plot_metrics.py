"""Plot a run's metrics.jsonl as PNG curves (one panel per metric).

    python tools/plot_metrics.py outputs/tiny_cpu [--keys eval/reward_mean reward/sampled_mean ...] [--out curves.png]

Needs matplotlib: `pip install -e .[plot]` (the project's plot extra).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

DEFAULT_KEYS = [
    "eval/reward_mean",
    "reward/sampled_mean",
    "reward/greedy_mean",
    "loss",
    "entropy/mean",
    "kl/mean",
    "response/length_mean",
    "logprob/engine_vs_actor_max_diff",
    "time/step_s",
]


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl") if os.path.isdir(run_dir) else run_dir
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: give a run's output_dir or its metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(records: list[dict], keys: list[str], out: str) -> str:
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            "tools/plot_metrics.py needs matplotlib: pip install -e .[plot] (or pip install matplotlib)"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in keys if any(k in r for r in records)]
    if not keys:
        raise ValueError("none of the requested metrics are in the file")
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        points = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o" if len(points) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run's output_dir (or its metrics.jsonl)")
    p.add_argument("--keys", nargs="*", default=DEFAULT_KEYS)
    p.add_argument("--out", default=None, help="PNG path (default <run>/curves.png)")
    a = p.parse_args(argv)
    try:
        records = read_metrics(a.run)
        out = a.out or os.path.join(a.run if os.path.isdir(a.run) else os.path.dirname(a.run), "curves.png")
        print(f"wrote {plot(records, a.keys, out)}")
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
