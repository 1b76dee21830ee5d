"""Are two runs' metrics the same? metrics.jsonl of run A against run B, every key but the timings, bitwise.

    python tools/compare_metrics.py outputs/before/tiny_cpu outputs/after/tiny_cpu [more pairs ...]

For changes that must not change behaviour (issue 38 moved the Trainer apart with it): run the defaults
before and after on one machine, then compare. Timing keys (time/, throughput/, perf/, memory/) differ
run to run and are skipped. Prints one line per pair and the differences; exit 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TIMING = ("time/", "throughput/", "perf/", "memory/")


def differences(a_dir: str, b_dir: str) -> tuple[list[str], int]:
    """(one line per differing value or record, the number of values compared)."""
    records = []
    for top in (a_dir, b_dir):
        with open(os.path.join(top, "metrics.jsonl")) as f:
            records.append([json.loads(line) for line in f])
    a, b = records
    if len(a) != len(b):
        return [f"{len(a)} records against {len(b)}"], 0
    out, compared = [], 0
    for x, y in zip(a, b):
        if set(x) != set(y):
            out.append(f"step {x.get('step')}: keys differ: {sorted(set(x) ^ set(y))}")
        for key in sorted(set(x) & set(y)):
            if key.startswith(TIMING):
                continue
            compared += 1
            if x[key] != y[key]:
                out.append(f"step {x.get('step')}: {key} {x[key]!r} != {y[key]!r}")
    return out, compared


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="output directories, in pairs: A1 B1 [A2 B2 ...]")
    args = p.parse_args(argv)
    if len(args.runs) % 2:
        p.error(f"{len(args.runs)} directories: give them in pairs (before after)")
    failed = False
    for a, b in zip(args.runs[::2], args.runs[1::2]):
        lines, compared = differences(a, b)
        print(f"{a} vs {b}: {'EQUAL' if not lines else f'{len(lines)} differences'} ({compared} values compared)")
        for line in lines[:20]:
            print(f"  {line}")
        failed |= bool(lines)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
