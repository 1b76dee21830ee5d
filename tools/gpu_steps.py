"""The GPU check's steps under one deadline: what tools/gpu_check.sh runs on a lent GPU machine.

    python tools/gpu_steps.py --plan                     # the steps, their estimates and limits; runs nothing
    OUT=/some/dir python tools/gpu_steps.py [--deadline 345]

GPU time is short (a lent H200: about 6 minutes for the whole check, the machine's start and the wheel
install not included in --deadline), so the steps run in priority order under ONE deadline:

- each step gets min(its limit, the time left) and is killed (its process group) when that runs out;
- an optional step whose estimate does not fit in the time left is skipped, and the next one is tried;
- a mandatory step runs in whatever time is left, even when its estimate does not fit; the check FAILS
  (exit 1, "ok": false in the JSON) when a mandatory step fails, runs out of time or cannot start because
  the deadline has passed. Optional steps that fail are recorded and do not fail the check.

Mandatory, in this order: the GPU tests (pytest tests/gpu), the tiny default's 10 steps on the GPU, the peer
comparison (tools/bench_e2e.py --peer trl, TRL's GRPOTrainer vs this project on a random 0.89B Llama: hidden
2048, 16 layers, 16 / 8 heads, ffn 5632, vocab 32003, bf16, 32 prompts x 4 samples x 128 new tokens) and the
kernel benchmark at the GPU shape. Optional, in the time left: attention, the rollout engines vs transformers'
generate, the weight sync, the bf16 noise floor.

Output, everything under $OUT (the device tool brings back at most 8 files): gpu_check.log (every step's
output, in order) and gpu_check.json, rewritten after every step so a run killed from outside still leaves
what ran: {"ok", "deadline_s", "elapsed_s", "failed_mandatory", "steps": [{"name", "mandatory", "estimate_s",
"limit_s", "status": passed | failed | timed_out | skipped | not_run, "rc", "seconds", "timeout_s", "reason"}],
"results": {step: {name: the JSON / JSON-lines / JUnit summary the step wrote}}}. Work files (models, run
directories) go to --work (default /tmp/gpu_check_work).

The estimates are seconds on one H200 (torch 2.11+cu130) from the 2026-12-04 run's figures where there are
some (the tiny default's step 0.064 s, the 0.89B step 5.5 s, TRL's 2.96 s, the kernels' 1.2 s per naive pass),
guesses otherwise: correct them from the JSON's `seconds` after a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 345.0  # 6 minutes on the machine, less its start-up of the check and the wheel install

# The peer comparison's model: a random Llama of 0.89B parameters (issue 49's shape).
PEER_MODEL = ["--family", "llama", "--hidden", "2048", "--layers", "16", "--heads", "16", "--kv-heads", "8"]
PEER_MODEL += ["--ffn", "5632", "--vocab", "32003"]

_ENV = """
import importlib, json, sys, torch
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count()}
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name()
    info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
for mod in ("megatron.core", "transformers", "triton", "trl", "datasets", "transformer_engine", "apex", "vllm"):
    try:
        info[mod] = getattr(importlib.import_module(mod), "__version__", "present")
    except Exception:
        info[mod] = None
json.dump(info, open(sys.argv[1], "w"))
print(info)
"""


@dataclasses.dataclass
class Step:
    """One step of the check."""

    name: str
    # argv, or a bash script (str)
    command: list[str] | str
    # expected seconds on one H200: whether an optional step fits in the time left
    estimate_s: float
    # the most seconds it may take (less when less is left)
    limit_s: float
    # a mandatory step that fails, times out or cannot run fails the check
    mandatory: bool = False
    # {key: file the step writes}: .json parsed, .jsonl as records, .xml as a JUnit summary, into the JSON
    results: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.estimate_s <= 0 or self.limit_s < self.estimate_s:
            raise ValueError(
                f"step {self.name!r}: estimate_s={self.estimate_s} must be > 0 and <= limit_s={self.limit_s}"
            )


def default_steps(py: str, work: str) -> list[Step]:
    """The check on one GPU, in priority order (mandatory first)."""

    def sh(*parts) -> str:
        return " ".join(shlex.quote(str(p)) for p in parts)

    def w(name: str) -> str:
        return os.path.join(work, name)

    model = w("llama-0.89b")
    make_model = f"[ -f {model}/config.json ] || {sh(py, 'tools/make_tiny_model.py', *PEER_MODEL, '--out', model)}"
    make_model += " --overwrite >/dev/null"
    train = w("train")
    return [
        Step("env", [py, "-c", _ENV, w("env.json")], 10, 30, True, {"env": w("env.json")}),
        Step(
            "tests",
            [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", "-rs", "--durations=25"]
            + ["--junitxml", w("gpu_tests.xml")],
            120,
            150,
            True,
            {"junit": w("gpu_tests.xml")},
        ),
        Step(
            "train",  # the tiny default's 10 steps: TP=1, native engine, megatron's optimizer
            f"rm -rf {train} && "
            + sh(py, "-m", "torch.distributed.run", "--nproc_per_node=1", "-m", "remax_megatron.train")
            + " "
            + sh("--config", "configs/tiny_cpu.yaml", "actor.tp=1", "reward.tp=1", "rollout.engine=native")
            + " "
            + sh("trainer.steps=10", "trainer.eval_every=10", f"trainer.output_dir={train}")
            + " checkpoint.save_every=0 logging.progress_bar=false",
            40,
            75,
            True,
            {"metrics": os.path.join(train, "metrics.jsonl")},
        ),
        Step(
            "peer",  # TRL's GRPOTrainer (transformers generate: no vLLM there) vs ours on the 0.89B Llama
            f"{make_model} && "
            + sh(py, "tools/bench_e2e.py", "--hf-dir", model, "--peer", "trl", "--peer-generation", "transformers")
            + " "
            + sh("--peer-timeout", "120", "--steps", "2", "--warmup", "1", "--greedy-repeats", "1")
            + " "
            + sh("--json", w("bench_e2e.json"), "actor.tp=1", "actor.dtype=bfloat16", "rollout.engine=native")
            + " trainer.prompts_per_step=32 rollout.n=4 rollout.max_new_tokens=128 trainer.micro_batch_size=32"
            + " optim.lr=1e-6",
            110,
            150,
            True,
            {"e2e": w("bench_e2e.json")},
        ),
        Step(
            "kernels",  # fused log-probs at 16384 x 4096 x 151936, bf16 (issue 3's GPU shape)
            [py, "tools/bench_kernels.py", "--device", "cuda", "--tokens", "16384", "--hidden", "4096"]
            + ["--vocab", "151936", "--dtype", "bf16", "--repeats", "3", "--json", w("bench_kernels.json")],
            40,
            70,
            True,
            {"kernels": w("bench_kernels.json")},
        ),
        Step(
            "attention",
            [py, "tools/bench_attention.py", "--device", "cuda", "--dtype", "bf16", "--long", "--batch", "4"]
            + ["--json", w("bench_attention.json")],
            30,
            60,
            results={"attention": w("bench_attention.json")},
        ),
        Step(
            "rollout",  # native engine vs transformers' generate (TRL's engine without vLLM), tokens/s
            f"{make_model} && "
            + sh(py, "tools/bench_rollout.py", "--hf-dir", model, "--device", "cuda", "--dtype", "bf16")
            + " "
            + sh("--engines", "native,transformers-generate", "--prompts", "32", "--n", "4")
            + " "
            + sh("--max-new-tokens", "128", "--repeats", "2", "--json", w("bench_rollout.json")),
            50,
            90,
            results={"rollout": w("bench_rollout.json")},
        ),
        Step(
            "weight_sync",
            f"{make_model} && "
            + sh(py, "tools/bench_weight_sync.py", "--hf-dir", model, "--engine", "native", "--dtype", "bfloat16")
            + " "
            + sh("--json", w("bench_weight_sync.json")),
            40,
            70,
            results={"weight_sync": w("bench_weight_sync.json")},
        ),
        Step(
            "noise_floor",
            [py, "tools/bench_noise_floor.py", "--dtype", "bf16", "--engines", "native"]
            + ["--json", w("bench_noise_floor.json")],
            50,
            90,
            results={"noise_floor": w("bench_noise_floor.json")},
        ),
        Step(  # issue 50: the update's MFU and where its time goes, 0.89B shape, 144- and 2048-token rows
            "update_profile",
            [py, "tools/bench_update_profile.py", "--json", w("bench_update_profile.json")],
            60,
            120,
            results={"update_profile": w("bench_update_profile.json")},
        ),
    ]


def describe(command: list[str] | str) -> str:
    """The command on one line (an inline script shown as <script>)."""
    if isinstance(command, str):
        return command
    return shlex.join("<script>" if "\n" in a else a for a in command)


def load_steps(path: str) -> list[Step]:
    """A step list from a JSON file: [{"name", "command", "estimate_s", "limit_s", "mandatory", "results"}]."""
    with open(path) as f:
        return [Step(**entry) for entry in json.load(f)]


def plan(steps: list[Step], deadline_s: float) -> list[dict]:
    """What a run would do if every step took its estimate: start time and whether it fits."""
    rows, at = [], 0.0
    for s in steps:
        fits = at + s.estimate_s <= deadline_s
        rows.append(
            {
                "name": s.name,
                "mandatory": s.mandatory,
                "estimate_s": s.estimate_s,
                "limit_s": s.limit_s,
                "starts_at_s": at,
                "fits": fits,
            }
        )
        if fits or s.mandatory:  # a mandatory step runs anyway; a skipped optional one costs nothing
            at += s.estimate_s
    return rows


def _run(step: Step, timeout_s: float, log) -> tuple[int, bool]:
    """(exit code, timed out): the step in its own process group, killed whole at the timeout."""
    argv = ["bash", "-c", step.command] if isinstance(step.command, str) else list(step.command)
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s), False
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait()
        return 124, True


def _junit(path: str) -> dict:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["seconds"] = float(suite.get("time", 0))
    cases = list(suite.iter("testcase"))
    counts["failed"] = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
    counts["skipped_why"] = {
        c.get("name"): c.find("skipped").get("message") for c in cases if c.find("skipped") is not None
    }
    counts["slowest"] = sorted(((float(c.get("time", 0)), c.get("name")) for c in cases), reverse=True)[:10]
    return counts


def read_result(path: str):
    """What a step wrote, for the JSON: parsed JSON, JSON-lines records, a JUnit summary; None if absent."""
    if not os.path.exists(path):
        return None
    try:
        if path.endswith(".jsonl"):
            with open(path) as f:
                return [json.loads(line) for line in f if line.strip()][-200:]
        if path.endswith(".xml"):
            return _junit(path)
        with open(path) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001 - a broken file is reported, not fatal to the check
        return {"unreadable": f"{type(e).__name__}: {e}"}


def run_steps(steps: list[Step], deadline_s: float, out_dir: str, clock=time.monotonic) -> dict:
    """Run `steps` in order under one deadline (module docstring); write gpu_check.log and gpu_check.json in
    `out_dir`; return the summary."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "gpu_check.json")
    summary = {"ok": True, "deadline_s": deadline_s, "elapsed_s": 0.0, "failed_mandatory": [], "steps": []}
    summary["results"] = {}
    start = clock()

    def write():
        summary["elapsed_s"] = round(clock() - start, 3)
        summary["ok"] = not summary["failed_mandatory"]
        with open(json_path + ".tmp", "w") as f:
            json.dump(summary, f, indent=2)
        os.replace(json_path + ".tmp", json_path)

    with open(os.path.join(out_dir, "gpu_check.log"), "w") as log:
        for step in steps:
            left = deadline_s - (clock() - start)
            record = {"name": step.name, "mandatory": step.mandatory, "estimate_s": step.estimate_s}
            record.update(limit_s=step.limit_s, status=None, rc=None, seconds=0.0, timeout_s=0.0, reason="")
            summary["steps"].append(record)
            if left <= 0:
                record.update(status="not_run", reason="the deadline has passed")
            elif step.estimate_s > left and not step.mandatory:
                record.update(
                    status="skipped", reason=f"does not fit: estimate {step.estimate_s:g} s > {left:.1f} s left"
                )
            else:
                if step.estimate_s > left:
                    record["reason"] = f"over its estimate: {step.estimate_s:g} s > {left:.1f} s left; run anyway"
                timeout = min(step.limit_s, left)
                print(f"=== {step.name}: {describe(step.command)} (limit {timeout:.0f} s)", file=log, flush=True)
                t0 = clock()
                rc, timed_out = _run(step, timeout, log)
                record.update(rc=rc, seconds=round(clock() - t0, 3), timeout_s=round(timeout, 3))
                record["status"] = "timed_out" if timed_out else ("passed" if rc == 0 else "failed")
                print(f"=== {step.name}: {record['status']} rc={rc} in {record['seconds']} s", file=log, flush=True)
                got = {k: read_result(p) for k, p in step.results.items()}
                if any(v is not None for v in got.values()):
                    summary["results"][step.name] = got
            if step.mandatory and record["status"] != "passed":
                summary["failed_mandatory"].append(step.name)
            line = f"{step.name}: {record['status']}" + (
                f" in {record['seconds']} s" if record["rc"] is not None else ""
            )
            print(line + (f" ({record['reason']})" if record["reason"] else ""), flush=True)
            write()
    write()
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for all steps together")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "gpu_check_out"))
    p.add_argument("--work", default="/tmp/gpu_check_work", help="models and run directories")
    p.add_argument("--python", default=sys.executable, help="the python every step runs")
    p.add_argument("--steps", default=None, help="a JSON step list instead of the check's own (tests)")
    p.add_argument("--plan", action="store_true", help="print the plan and exit (1 if a mandatory step does not fit)")
    args = p.parse_args(argv)
    if args.deadline <= 0:
        p.error(f"--deadline {args.deadline}: must be > 0")
    steps = load_steps(args.steps) if args.steps else default_steps(args.python, args.work)
    if args.plan:
        rows = plan(steps, args.deadline)
        for r in rows:
            kind = "mandatory" if r["mandatory"] else "optional"
            fits = "fits" if r["fits"] else ("DOES NOT FIT" if r["mandatory"] else "skipped unless time is left")
            print(
                f"{r['name']:<12} {kind:<9} at {r['starts_at_s']:>5.0f} s  estimate {r['estimate_s']:>4.0f} s  "
                f"limit {r['limit_s']:>4.0f} s  {fits}"
            )
        for s in steps:
            print(f"  {s.name}: {describe(s.command)}")
        return 0 if all(r["fits"] for r in rows if r["mandatory"]) else 1
    os.makedirs(args.work, exist_ok=True)
    summary = run_steps(steps, args.deadline, args.out)
    print(json.dumps({k: summary[k] for k in ("ok", "elapsed_s", "failed_mandatory")}))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
