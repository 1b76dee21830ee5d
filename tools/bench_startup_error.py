"""How long a bad input takes to be refused under the README's main command, and what comes first.

    python tools/bench_startup_error.py [--runs 3] [--json OUT]

Runs `torchrun --nproc_per_node=2 -m remax_megatron.train --config configs/tiny_cpu.yaml` and the same
through `python -m remax_megatron.launch`, each with a data file whose second row lacks the column the
reward function needs, and measures from the start of the command to its first line on stderr (and
to its exit). One JSON object per launcher: the first stderr line, its time (median and each run),
the time of the project's `error: ...` line, the exit code, the stderr line count. The built-in model is not
built (the checks refuse before).
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
LAUNCHERS = {
    "torchrun": [os.path.join(os.path.dirname(sys.executable), "torchrun")],
    "remax_megatron.launch": [sys.executable, "-m", "remax_megatron.launch"],
}


def one_run(launcher: list[str], data: str, out: str) -> dict:
    cmd = [
        *launcher,
        "--nproc_per_node=2",
        "-m",
        "remax_megatron.train",
        "--config",
        "configs/tiny_cpu.yaml",
        f"data.train={data}",
        "data.eval_size=0",
        f"trainer.output_dir={out}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as a fresh shell has it
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first, first_s, error_s, lines = None, None, None, 0
    for line in proc.stderr:
        lines += 1
        if first is None and line.strip():
            first, first_s = line.rstrip("\n"), time.perf_counter() - start
        if error_s is None and line.startswith("error: "):
            error_s = time.perf_counter() - start
    code = proc.wait()
    return {
        "first_line": first,
        "first_line_s": first_s,
        "error_line_s": error_s,
        "exit_s": time.perf_counter() - start,
        "exit_code": code,
        "stderr_lines": lines,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results here too")
    a = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="bench-startup-error-")
    data = os.path.join(tmp, "d.jsonl")
    with open(data, "w") as f:
        f.write('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    results = {"load_average": os.getloadavg(), "cpus": os.cpu_count()}
    for name, launcher in LAUNCHERS.items():
        runs = [one_run(launcher, data, os.path.join(tmp, "out")) for _ in range(a.runs)]
        results[name] = {
            "first_line": runs[0]["first_line"],
            "exit_code": runs[0]["exit_code"],
            "stderr_lines": runs[0]["stderr_lines"],
            "first_line_s_median": statistics.median(r["first_line_s"] for r in runs),
            "first_line_s": [round(r["first_line_s"], 2) for r in runs],
            "error_line_s": [r["error_line_s"] and round(r["error_line_s"], 2) for r in runs],
            "exit_s": [round(r["exit_s"], 2) for r in runs],
        }
    text = json.dumps(results, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
