"""End-to-end benchmark: trained samples per second of the real trainer, optionally against TRL.

    python tools/make_tiny_model.py --family llama --hidden 512 --layers 8 --heads 8 --kv-heads 4 \
        --ffn 1408 --vocab 32003 --out /tmp/llama-60m
    python tools/bench_e2e.py --hf-dir /tmp/llama-60m --peer trl --json e2e.json \
        actor.tp=1 trainer.prompts_per_step=16 rollout.n=2 rollout.max_new_tokens=64 \
        trainer.micro_batch_size=8 rollout.kv_cache_gib=0.5 actor.dtype=bfloat16
    torchrun --nproc_per_node=2 tools/bench_e2e.py --hf-dir HF --json e2e.json actor.tp=2

Ours: the project's Trainer (remax_megatron.train check_inputs + build, then
`Trainer.train_step`) for --warmup + --steps steps on `--config` (default the tiny
CPU config) with actor.model=--hf-dir and the given dotted overrides. Per step:
trained samples/s = rollout.n * trainer.prompts_per_step / time/step_s; the JSON
reports medians over the steps after the warm-up.

Greedy row: after the steps, the same prompts are decoded `--greedy-repeats` times
with the n samples + greedy row (ReMax's request) and with the n samples alone,
same seeds, alternating; `greedy_row.ratio` is compared with (n + 1) / n.

--peer trl: TRL's GRPOTrainer (tools/bench_e2e_trl.py, in a subprocess of --peer-python) on
the same model, prompts, n, max new tokens, reward functions, lr, micro-batching and precision
(actor.dtype float32, or bfloat16 against TRL's bf16=True), beta=0. Generation: vLLM colocate
first, and when that fails, transformers generate (the JSON says which, and why).

--rounds R (with --peer, world 1): ours and TRL alternate R times in ABBA order (ours, TRL, TRL,
ours, ...), --steps measured steps per side and round, so a drift of the machine's speed during
the run reaches both sides alike; `ratio` is the median of the rounds' ratios (`rounds` lists
them), `pooled_ratio` the ratio of the medians over all steps.

Variable lengths (issue 29): --stop-every K makes every K-th token id a stop token
(rollout.stop_token_ids; TRL's generation gets the same ids), so a random model's responses end
after a geometric number of tokens, mean ~K. The JSON reports `computed_over_real` (the training
forward's tokens, padding included, over the rows' tokens: batch/computed_tokens /
batch/real_tokens) and `update_s_per_real_token`; --padded-steps N adds N steps with today's
fixed-count padded micro-batches (trainer.micro_batch_tokens=0) in the same process, alternating
with ours' first measured steps (packed, padded, packed, ...), reported under `padded` (not part of
the ratio).

    python tools/bench_e2e.py --hf-dir /tmp/llama-60m --peer trl --stop-every 128 --padded-steps 3 \
        --json e2e.json actor.tp=1 trainer.prompts_per_step=16 rollout.n=2 rollout.max_new_tokens=512 \
        trainer.micro_batch_size=8 trainer.micro_batch_tokens=4096 trainer.pack_sequences=true \
        rollout.kv_cache_gib=0.5 actor.dtype=bfloat16

Rollout on its own ranks (issue 36): --placement separate --rollout-ranks K splits the torchrun world into
K rollout ranks and world - K training ranks (rollout.placement=separate; rollout.max_staleness from the
overrides, default 1). The JSON adds `rollout_wait_s` (median time/rollout_s: what the training ranks wait
for their batch; the rest of the rollout ran during the previous update) and `placement`. The greedy-row
measurement needs a local engine and is left out. tools/bench_placement.py runs the comparison (colocated
at world W - 1 and W, separate at W with staleness 0 and 1) and reports the ratios.

    torchrun --nproc_per_node=3 tools/bench_e2e.py --hf-dir HF --placement separate --rollout-ranks 1 \
        --json sep.json actor.tp=2 rollout.engine=native

Both sides also report `launch_to_first_step_s` (from the process's start to the end of its first
training step: imports, model build, first rollout and update) and `peak_memory` (GPU: torch's allocator
peak, where CUDA is used; host: peak RSS; GiB). For TRL these are the subprocess's own.

Output: one JSON object (DESIGN.md, "Benchmark JSON"), printed and written to --json
(rank 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DEFAULT_CONFIG = os.path.join(REPO, "configs", "tiny_cpu.yaml")


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


_IMPORTED = time.time()


def seconds_since_launch() -> float:
    """Seconds since this process started (Linux: /proc), else since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED


def peak_memory() -> dict:
    """This process's peak memory so far: GPU (torch's allocator, GiB) where CUDA is in use, host RSS (GiB)."""
    import resource

    import torch

    peak = {"host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return peak


# ---- ours ---------------------------------------------------------------------------------
def bench_config(args, overrides: list[str], output_dir: str):
    """The run's Config: --config, actor.model=--hf-dir, no eval / checkpoints / progress bar, the
    --stop-every stop set, then the user's overrides (they win)."""
    from remax_megatron.config import load_config

    steps = args.warmup + args.steps * args.rounds + args.padded_steps
    placement = (
        [f"rollout.placement={args.placement}", f"rollout.ranks={args.rollout_ranks}"]
        if args.placement == "separate"
        else []
    )
    fixed = [
        *placement,
        f"actor.model={args.hf_dir}",
        f"trainer.steps={steps}",
        f"trainer.output_dir={output_dir}",
        "trainer.eval_every=0",
        "checkpoint.save_every=0",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
    ]
    if args.stop_every:
        fixed.append(f"rollout.stop_token_ids={stop_ids(args.hf_dir, args.stop_every)}")
    return load_config(args.config, fixed + list(overrides))


def stop_ids(hf_dir: str, every: int) -> list[int]:
    """Every `every`-th token id of the model's vocabulary (the last of each block of `every`)."""
    from remax_megatron.models import read_hf_config

    return list(range(every - 1, read_hf_config(hf_dir).vocab_size, every))


class OursRun:
    """The project's trainer, built once; `steps(k)` runs k more steps (a run can pause while the peer
    runs and go on after it, as --rounds does)."""

    def __init__(self, args, overrides: list[str]):
        from remax_megatron.console import quiet_console

        quiet_console()  # before megatron-core and vLLM are imported, as the trainer does
        from remax_megatron.memory import keep_freed_host_memory
        from remax_megatron.metrics import MetricsLogger
        from remax_megatron.startup import build, check_inputs
        from remax_megatron.trainer import Trainer

        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.output_dir = tempfile.mkdtemp(prefix="bench-e2e-")
        try:
            cfg = bench_config(args, overrides, self.output_dir)
            checked = check_inputs(cfg, self.world)
            if getattr(args, "peer", None):
                check_peer(cfg)
        except (ValueError, FileNotFoundError) as e:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        if cfg.rollout.n < 1:
            print("error: rollout.n must be >= 1 to train", file=sys.stderr)
            sys.exit(2)
        bridge = None
        if cfg.rollout.placement == "separate":  # as remax_megatron.train does: the rollout ranks serve
            from remax_megatron.parallel.split import split_world

            split = split_world(cfg.rollout.ranks)
            if split.role == "rollout":
                from remax_megatron.rollout.remote import serve
                from remax_megatron.startup import build_rollout_engine
                from remax_megatron.train import teardown

                engine = build_rollout_engine(cfg, checked)
                serve(engine, split.bridge)
                teardown(engine)  # as remax_megatron.train's rollout ranks do
                sys.exit(0)
            bridge = split.bridge
        t0 = time.perf_counter()
        keep_freed_host_memory()  # as remax_megatron.train does
        self.parts = build(cfg, checked, bridge)
        self.build_s = time.perf_counter() - t0
        self.logger = MetricsLogger(self.output_dir, cfg.trainer.steps, tensorboard=False, progress_bar=False)
        self.trainer = Trainer(self.parts, self.logger)
        self.cfg, self.samples = cfg, cfg.rollout.n * cfg.trainer.prompts_per_step
        self.launch_to_first_step_s = None  # process start to the end of its first training step
        self.checked = dataclasses.replace(checked, actor_dir=self.parts.hf_dir)  # a built-in model: now built

    def steps(self, count: int, padded: bool = False) -> tuple[list[dict], list[float]]:
        """(records, CPU seconds) of `count` more trainer steps; padded: with today's fixed-count padded
        micro-batches (trainer.micro_batch_tokens=0), whatever the config says."""
        records, cpu_s = [], []
        t = self.cfg.trainer
        budget, pack = t.micro_batch_tokens, t.pack_sequences
        if padded:
            t.micro_batch_tokens, t.pack_sequences = 0, False
        try:
            records, cpu_s = self._steps(count)
        finally:
            t.micro_batch_tokens, t.pack_sequences = budget, pack
        return records, cpu_s

    def _steps(self, count: int) -> tuple[list[dict], list[float]]:
        records, cpu_s = [], []
        for _ in range(count):
            cpu_start = time.process_time()  # every thread of this process (the vLLM engine's too)
            record = self.trainer.train_step()
            cpu_s.append(time.process_time() - cpu_start)
            if self.launch_to_first_step_s is None:
                self.launch_to_first_step_s = seconds_since_launch()
            self.trainer.step += 1
            self.logger.log(record)
            records.append(record)
        return records, cpu_s

    def result(self, args, measured: list[dict], cpu_s: list[float], padded: list[dict] = ()) -> dict:
        """The JSON of the measured steps (DESIGN.md, "Benchmark JSON"), the greedy row measured now;
        `padded`: the --padded-steps records."""
        import torch

        self.logger.close()
        cfg, samples = self.cfg, self.samples
        time_keys = sorted({k for r in measured for k in r if k.startswith("time/")})
        result = {
            "samples_per_s": median([samples / r["time/step_s"] for r in measured]),
            "stages": {k: median([r[k] for r in measured if k in r]) for k in time_keys},
            "tokens_per_s": median([r["throughput/tokens_per_s"] for r in measured]),
            "rollout_tokens_per_s": median([r["rollout/tokens"] / r["time/rollout_s"] for r in measured]),
            "engine": cfg.rollout.engine,
            "layout": {
                "world": self.world,
                "actor_tp": cfg.actor.tp,
                "actor_pp": cfg.actor.pp,
                "dp": self.parts.groups.dp_size,
                "rollout_tp": cfg.rollout.tp,
            },
            "workload": {
                "model": args.hf_dir,
                "prompts_per_step": cfg.trainer.prompts_per_step,
                "n": cfg.rollout.n,
                "max_new_tokens": cfg.rollout.max_new_tokens,
                "micro_batch_size": cfg.trainer.micro_batch_size,
                "reward_functions": list(cfg.reward.functions),
                "lr": cfg.optim.lr,
                "dtype": cfg.actor.dtype,
                "kl": self.parts.reference is not None,
                "response_length_mean": median([r["response/length_mean"] for r in measured]),
            },
            "steps": args.steps,
            "warmup": args.warmup,
            "step_s": [r["time/step_s"] for r in measured],
            # CPU seconds per step (this rank): less sensitive than wall time to other jobs on a shared machine.
            "cpu_s_per_step": median(cpu_s),
            "cpu_s_per_sample": median(cpu_s) / samples,
            "build_s": self.build_s,
            "launch_to_first_step_s": self.launch_to_first_step_s,
            "peak_memory": peak_memory(),
            "metrics_jsonl": os.path.join(self.output_dir, "metrics.jsonl"),  # every step's full record
            # torch's threads after the run: vLLM's CPU build sets 1 in its process unless OMP_NUM_THREADS is set.
            "threads": torch.get_num_threads(),
        }
        result.update(token_work(measured))
        result["placement"] = {
            "placement": cfg.rollout.placement,
            "rollout_ranks": cfg.rollout.ranks,
            "max_staleness": cfg.rollout.max_staleness if cfg.rollout.ranks else 0,
            "staleness": median([r["rollout/staleness"] for r in measured]),
        }
        result["rollout_wait_s"] = median([r["time/rollout_s"] for r in measured])
        result["workload"].update(
            micro_batch_tokens=cfg.trainer.micro_batch_tokens,
            pack_sequences=cfg.trainer.pack_sequences,
            stop_token_ids=len(cfg.rollout.stop_token_ids),
        )
        if padded:
            result["padded"] = dict(
                token_work(padded),
                step_s=[r["time/step_s"] for r in padded],
                stages={k: median([r[k] for r in padded]) for k in time_keys},
            )
            result["update_speedup_per_real_token"] = (
                result["padded"]["update_s_per_real_token"] / result["update_s_per_real_token"]
            )
        if cfg.rollout.placement == "colocated":  # the greedy row is timed on a local engine
            result["greedy_row"] = measure_greedy_row(self.trainer, self.checked.train, args.greedy_repeats)
        return result


def token_work(records: list[dict]) -> dict:
    """What the training forward computed per real token, and the update's seconds per real token (medians)."""
    return {
        "computed_over_real": median([r["batch/computed_tokens"] / r["batch/real_tokens"] for r in records]),
        "update_s_per_real_token": median([r["time/update_s"] / r["batch/real_tokens"] for r in records]),
        "real_tokens": median([r["batch/real_tokens"] for r in records]),
        "computed_tokens": median([r["batch/computed_tokens"] for r in records]),
    }


def measure_greedy_row(trainer, train_prompts: list, repeats: int) -> dict:
    """Seconds of ReMax's rollout (n samples + greedy per prompt) vs a sampling-only rollout of the
    same prompts and seeds (median of `repeats` after one warm-up, the two alternating).

    vLLM: both are the engine's request (rollout.vllm_engine.build_requests) sent to its LLM, the
    sampling-only one without the greedy entries. Native: its request always carries a greedy row,
    so the sampling-only cost is measured as n - 1 samples + greedy (n rows per prompt; a native row
    costs the same sampled or greedy)."""
    import torch
    import torch.distributed as dist

    from remax_megatron.rollout import SamplingParams, stream_seed
    from remax_megatron.rollout.dispatch import contiguous_share

    cfg, engine, groups = trainer.cfg, trainer.parts.engine, trainer.groups
    n = cfg.rollout.n
    prompts = trainer.dispatch.share(train_prompts[: cfg.trainer.prompts_per_step])
    if engine.group_size == 1 and groups.mp_size > 1:  # as in training: each rank decodes its share
        lo, hi = contiguous_share(len(prompts), groups.mp_size, groups.mp_rank)
        prompts = prompts[lo:hi]
    ids = [q.token_ids for q in prompts]
    sampling = SamplingParams.from_config(cfg.rollout)
    trainer.weight_sync()  # the engine holds the current weights (whatever the last step left)

    if engine.name == "vllm":
        from vllm import SamplingParams as VllmParams

        from remax_megatron.rollout.vllm_engine import build_requests

        method = "vLLM request with vs without its greedy entries"

        def rollout(seeds, greedy):
            engine.wake_up()
            reqs, params = build_requests(ids, n, sampling, seeds, VllmParams)
            if not greedy:
                reqs, params = reqs[0::2], params[0::2]
            engine.llm.generate(reqs, params, use_tqdm=False)
    else:
        method = "native: n samples + greedy vs n - 1 samples + greedy (same row count as sampling-only)"

        def rollout(seeds, greedy):
            engine.generate(ids, n=n if greedy else n - 1, sampling=sampling, seeds=seeds)

    with_greedy, sampling_only = [], []
    for r in range(repeats + 1):
        seeds = [stream_seed(cfg.trainer.seed, 1_000_000 + r, i) for i in range(len(ids))]
        for greedy in (True, False) if r % 2 == 0 else (False, True):
            dist.barrier()
            start = time.perf_counter()
            rollout(seeds, greedy)
            # The slowest rank's time: a step waits for it.
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if r > 0:  # r == 0 warms both up
                (with_greedy if greedy else sampling_only).append(float(elapsed))
    engine.sleep()
    ratio = median(with_greedy) / median(sampling_only)
    return {
        "with_greedy_s": median(with_greedy),
        "sampling_only_s": median(sampling_only),
        "ratio": ratio,
        "bound": (n + 1) / n,
        "within_bound": ratio <= (n + 1) / n,
        "repeats": repeats,
        "with_greedy_times": with_greedy,
        "sampling_only_times": sampling_only,
        "method": method,
    }


# ---- the peer -----------------------------------------------------------------------------
def check_peer(cfg) -> None:
    """The work TRL can run the same way, checked before anything is built."""
    if cfg.reward.model:
        raise ValueError("--peer trl compares rule-based rewards only: this config has reward.model set")
    if cfg.actor.dtype not in ("float32", "bfloat16"):
        raise ValueError(
            f"--peer trl runs actor.dtype=float32 or bfloat16 (TRL's bf16=True), not "
            f"actor.dtype={cfg.actor.dtype}: set one of those"
        )


def peer_spec(args, cfg, checked) -> dict:
    """What tools/bench_e2e_trl.py needs to run the same work through TRL (OursRun ran check_peer)."""
    if cfg.algo.kl_coef:
        print(
            f"note: --peer trl runs TRL with beta=0 (no KL) while this config has algo.kl_coef={cfg.algo.kl_coef}",
            file=sys.stderr,
        )
    train = checked.train
    # Rows of the same train split, as many as TRL consumes (each side's sampler picks its own order).
    needed = (args.warmup + args.steps) * cfg.trainer.prompts_per_step
    rows = [dict(q.columns, prompt=q.text) for q in (train * (needed // len(train) + 1))[:needed]]
    return {
        "hf_dir": checked.actor_dir,
        "rows": rows,
        "steps": args.warmup + args.steps,
        "warmup": args.warmup,
        "prompts_per_step": cfg.trainer.prompts_per_step,
        "n": cfg.rollout.n,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "max_prompt_tokens": cfg.data.max_prompt_tokens,
        "temperature": cfg.rollout.temperature,
        "top_p": cfg.rollout.top_p,
        "top_k": cfg.rollout.top_k,
        "micro_batch_size": cfg.trainer.micro_batch_size,
        "lr": cfg.optim.lr,
        "grad_clip": cfg.optim.grad_clip,
        "weight_decay": cfg.optim.weight_decay,
        "seed": cfg.trainer.seed,
        "dtype": cfg.actor.dtype,
        "reward_functions": list(cfg.reward.functions),
        "reward_weights": list(cfg.reward.weights),
        "reward_options": {
            "pattern": cfg.reward.format_pattern,
            "tolerance": cfg.reward.numeric_tolerance,
            "limit": cfg.reward.length_limit,
        },
        "stop_token_ids": list(cfg.rollout.stop_token_ids),
        # Same KV-cache budget as our engine (on CPU vLLM's memory fraction is of host memory).
        "kv_cache_gib": cfg.rollout.kv_cache_gib or 0.5,
    }


def run_peer(args, spec: dict) -> dict:
    """TRL in a subprocess: vLLM colocate first, transformers generate when that fails."""
    modes = ["vllm", "transformers"] if args.peer_generation == "auto" else [args.peer_generation]
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "ROLE_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
        and not k.startswith("TORCHELASTIC")
    }
    if args.peer_malloc == "ours":  # glibc's environment names for what keep_freed_host_memory sets
        env.update(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(2**30))
    failures = {}
    with tempfile.TemporaryDirectory(prefix="bench-e2e-trl-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        for mode in modes:
            out = os.path.join(tmp, f"{mode}.json")
            cmd = [
                args.peer_python,
                os.path.join(REPO, "tools", "bench_e2e_trl.py"),
                "--spec",
                spec_path,
                "--generation",
                mode,
                "--out",
                out,
            ]
            print(f"peer: {' '.join(cmd)}", file=sys.stderr, flush=True)
            proc = subprocess.run(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.peer_timeout
            )
            log_path = os.path.join(args.peer_log_dir, f"trl_{mode}.log") if args.peer_log_dir else None
            if log_path:
                with open(log_path, "w") as f:
                    f.write(proc.stdout)
            if proc.returncode == 0 and os.path.exists(out):
                with open(out) as f:
                    peer = json.load(f)
                peer["fallback_from"] = failures
                peer["malloc"] = {"default": "glibc default", "ours": "no mmap, trim above 1 GiB (as ours)"}[
                    args.peer_malloc
                ]
                return peer
            tail = [line for line in proc.stdout.strip().splitlines() if line.strip()][-3:]
            failures[mode] = f"exit {proc.returncode}: " + " | ".join(tail)
            print(f"peer: TRL with {mode} generation failed ({failures[mode]})", file=sys.stderr, flush=True)
    raise RuntimeError(f"TRL failed in every generation mode: {failures}")


def alternate(ours: OursRun, steps: int, padded_steps: int) -> tuple[list[dict], list[float], list[dict]]:
    """`steps` steps as configured and `padded_steps` with today's padded micro-batches, taking turns (a drift
    of the machine's speed reaches both alike): (records, CPU seconds, padded records)."""
    records, cpu_s, padded = [], [], []
    for i in range(max(steps, padded_steps)):
        if i < steps:
            rec, cpu = ours.steps(1)
            records += rec
            cpu_s += cpu
        if i < padded_steps:
            padded += ours.steps(1, padded=True)[0]
    return records, cpu_s, padded


def run_rounds(args, ours: OursRun) -> dict:
    """--rounds R (one process): ours and TRL alternate, ABBA order (ours first in even rounds, TRL
    first in odd ones), each round `--steps` measured steps per side (ours warms up once, TRL in
    each of its fresh processes). A machine whose speed drifts during the run moves both sides of
    a round alike: `ratio` is the median of the rounds' ratios, each TRL's median step time over
    ours of the same round."""
    spec = peer_spec(args, ours.cfg, ours.checked)
    rounds, measured, cpu_s, peers, padded = [], [], [], [], []
    for r in range(args.rounds):
        for side in ("ours", "peer") if r % 2 == 0 else ("peer", "ours"):
            if side == "peer":
                peers.append(run_peer(args, spec))
                continue
            warm = args.warmup if r == 0 else 0
            ours.steps(warm)
            records, cpu, more_padded = alternate(ours, args.steps, args.padded_steps if r == 0 else 0)
            measured += records
            cpu_s += cpu
            padded += more_padded
            ours_step_s = [rec["time/step_s"] for rec in records]
        peer_step_s = peers[-1]["step_s"]
        rounds.append(
            {
                "order": "ours, trl" if r % 2 == 0 else "trl, ours",
                "ours_step_s": ours_step_s,
                "peer_step_s": peer_step_s,
                "ratio": median(peer_step_s) / median(ours_step_s),
            }
        )
    result = ours.result(args, measured, cpu_s, padded)
    peer_steps = [t for p in peers for t in p["step_s"]]
    peer_samples = ours.samples / median(peer_steps)
    result.update(
        peer_samples_per_s=peer_samples,
        ratio=median([x["ratio"] for x in rounds]),
        rounds=rounds,
        pooled_ratio=result["samples_per_s"] / peer_samples,
        cpu_ratio=median([p["cpu_s_per_sample"] for p in peers]) / result["cpu_s_per_sample"],
        peer=dict(
            peers[-1],
            step_s=peer_steps,
            samples_per_s=peer_samples,
            generation_s=[t for p in peers for t in (p.get("generation_s") or [])] or None,
        ),
    )
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="the actor's Hugging Face directory")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config the overrides apply to")
    p.add_argument("--json", default=None, help="write the result here (rank 0)")
    p.add_argument("--steps", type=int, default=4, help="measured steps, after --warmup")
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the medians")
    p.add_argument("--greedy-repeats", type=int, default=3, help="timed rollouts per greedy-row variant")
    p.add_argument("--peer", choices=["trl"], default=None, help="also run TRL's GRPOTrainer on the same work")
    p.add_argument("--peer-python", default=sys.executable, help="python that can import trl")
    p.add_argument(
        "--peer-generation",
        choices=["auto", "vllm", "transformers"],
        default="auto",
        help="TRL's generation backend; auto: vLLM colocate, else transformers generate",
    )
    p.add_argument("--peer-timeout", type=int, default=3600, help="seconds per TRL attempt")
    p.add_argument(
        "--peer-malloc",
        choices=["default", "ours"],
        default="default",
        help="TRL's host allocator: glibc's default, or ours (freed memory kept for reuse, as "
        "remax_megatron.train sets on CPU)",
    )
    p.add_argument("--peer-log-dir", default=None, help="keep the TRL subprocesses' output here")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --peer: alternate ours and TRL this many rounds (ABBA order); the ratio is the "
        "median of the rounds' ratios",
    )
    p.add_argument(
        "--stop-every",
        type=int,
        default=0,
        help="every K-th token id stops a completion (rollout.stop_token_ids; TRL gets the same ids): "
        "geometric response lengths, mean ~K, on a random model; 0: EOS only",
    )
    p.add_argument(
        "--padded-steps",
        type=int,
        default=0,
        help="also run this many steps with today's fixed-count padded micro-batches "
        "(trainer.micro_batch_tokens=0), reported under `padded`",
    )
    p.add_argument(
        "--placement",
        choices=["colocated", "separate"],
        default="colocated",
        help="separate: the last --rollout-ranks ranks run the engine (rollout.placement=separate)",
    )
    p.add_argument("--rollout-ranks", type=int, default=1, help="with --placement separate: the rollout ranks")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. actor.tp=1 rollout.n=2")
    args = p.parse_args(argv)
    if args.placement == "separate" and args.peer:
        p.error("--placement separate runs without --peer (the peer comparison is colocated at world 1)")
    if args.steps < 1 or args.warmup < 0 or args.greedy_repeats < 1:
        p.error("--steps and --greedy-repeats must be >= 1, --warmup >= 0")
    if args.rounds < 1:
        p.error(f"--rounds: {args.rounds} must be >= 1")
    if args.stop_every < 0 or args.padded_steps < 0:
        p.error("--stop-every and --padded-steps must be >= 0")
    if args.rounds > 1 and (not args.peer or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        p.error(
            f"--rounds {args.rounds} alternates with the peer in one process: add --peer trl and run "
            "without torchrun (world 1)"
        )

    load_start = os.getloadavg()
    ours = OursRun(args, args.overrides)
    import torch.distributed as dist

    rank = dist.get_rank()
    if args.rounds == 1:
        ours.steps(args.warmup)
        records, cpu_s, padded = alternate(ours, args.steps, args.padded_steps)
        result = ours.result(args, records, cpu_s, padded)
        if args.peer and rank == 0:
            peer = run_peer(args, peer_spec(args, ours.cfg, ours.checked))
            result.update(
                peer_samples_per_s=peer["samples_per_s"],
                ratio=result["samples_per_s"] / peer["samples_per_s"],
                cpu_ratio=peer["cpu_s_per_sample"] / result["cpu_s_per_sample"],
                peer=peer,
            )
    else:
        result = run_rounds(args, ours)
    if rank == 0:
        # A shared machine's load moves every number here: say what it was.
        result["machine"] = {
            "cpus": os.cpu_count(),
            "loadavg_1_5_15_start": load_start,
            "loadavg_1_5_15_end": os.getloadavg(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        }
        text = json.dumps(result, indent=2)
        print(text, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    # The engine (on separate placement: the rollout ranks' loop), then the process groups, in order, as
    # remax_megatron.train ends a run: left to interpreter exit, a rank once aborted after its last line
    # (CI: "terminate called without an active exception" in bench_placement's staleness-1 run).
    from remax_megatron.train import teardown

    teardown(ours.parts.engine)


if __name__ == "__main__":
    main()
