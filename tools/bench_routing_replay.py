"""Routing replay: how far the engine's log-probs are from the actor's with and without replaying the engine's
routes, and how many tokens the two route to different experts, at fp32 and bf16.

    python tools/bench_routing_replay.py [--model builtin:tiny-arith-moe] [--dtypes float32 bfloat16]
        [--prompts 32] [--n 4] [--max-new-tokens 4] [--engine native|vllm] [--train-steps 10] [--nproc 2]
        [--json OUT]

Part 1 (one process, the same sequences for every row of the table): the engine (native: transformers with a
KV cache; vllm: CUDA only, its CPU build cannot return routes) generates n samples per prompt and returns the
experts of every token it feeds; the megatron actor
(local spec, world 1) then scores the same sequences three ways: its own routing (`own_routes`), without
replay, and with the engine's routes replayed. `route_mismatch_frac`: the fed tokens x layers whose expert
set differs between engine and actor; `gap_*`: |actor - engine| log-probs over the response tokens.

Part 2 (`--train-steps N` > 0): configs/tiny_cpu_moe.yaml with `--model` as the actor, the same engine,
`actor.dtype=bfloat16` and `actor.ep` = `--nproc` processes, N steps with and without `rollout.routing_replay`,
the same seed; the per-step
`logprob/engine_vs_actor_{max,mean}_diff` (medians over the steps). Trajectories differ after the first
update, so part 1 is the controlled comparison. One JSON object on stdout (and in --json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = ("float32", "bfloat16")


def _init_world_1() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)


def _prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    import torch

    from remax_megatron.builtin.tasks import arith_records

    records = arith_records()
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed))[:count].tolist()
    return [tokenizer(records[i]["prompt"], add_special_tokens=False)["input_ids"] for i in order]


def controlled(
    model_dir: str, dtype: str, prompts: int, n: int, max_new_tokens: int, seed: int, engine_name: str = "native"
) -> dict:
    """Part 1 at one dtype: engine routes vs the actor's own, and the log-prob gap with and without replay."""
    import torch

    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.arch import ExpertOptions
    from remax_megatron.models.forward import forward_only
    from remax_megatron.models.moe import end_replay, own_routes, replay_routes
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.batching import pad_sequences
    from remax_megatron.rollout import SamplingParams, flatten_rollouts, logprob_mismatch, sync_weights
    from transformers import AutoTokenizer

    from remax_megatron.config import RolloutConfig
    from remax_megatron.rollout import build_engine
    from remax_megatron.weights import export_hf_weights, load_hf_weights

    ParallelLayout(tp=1, pp=1, world_size=1).initialize(seed=seed)
    arch = read_hf_config(model_dir)
    actor = build_policy(
        arch,
        tp=1,
        pp=1,
        params_dtype=getattr(torch, dtype),
        trainable=False,
        experts=ExpertOptions(routing_replay=True),
    )
    load_hf_weights(actor, model_dir)
    engine = build_engine(
        RolloutConfig(engine=engine_name, routing_replay=True),
        hf_dir=model_dir,
        arch=arch,
        seed=seed,
        dtype=getattr(torch, dtype),
    )
    sync_weights(engine, export_hf_weights(actor), bucket_mb=64)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    asked = _prompts(tokenizer, prompts, seed)
    out = engine.generate(
        asked, n=n, sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
    )
    rows_p, rows_c = flatten_rollouts(asked, out)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = pad_sequences(rows_p, rows_c, pad_id=pad, routes=True)
    given = batch["routed_experts"]  # [B, S, layers, k]
    fed = given[..., 0] >= 0  # [B, S, layers]
    actor_routes = own_routes(actor, batch)
    differ = (given.sort(-1).values != actor_routes.sort(-1).values).any(-1) & fed
    response_fed = fed & batch["response_mask"][..., None]  # response tokens fed
    mb = {"input_ids": batch["input_ids"], "labels": batch["labels"]}

    def logprobs(replay: bool):
        if replay:
            replay_routes(actor, given.to(next(actor.parameters()).device))
        lp = forward_only(actor, [mb], lambda m, hidden, b: m.token_logprobs(hidden, b["labels"])[0])[0]
        end_replay(actor)
        return lp.float().cpu()

    engine.shutdown()
    result = {
        "engine": engine_name,
        "dtype": dtype,
        "rows": int(batch["input_ids"].shape[0]),
        "fed_token_layers": int(fed.sum()),
        "route_mismatch_frac": float(differ.sum() / fed.sum()),
        "response_route_mismatch_frac": float((differ & response_fed).sum() / max(int(response_fed.sum()), 1)),
    }
    for replay in (False, True):
        gap = logprob_mismatch(logprobs(replay), batch["engine_logprobs"], batch["response_mask"])
        key = "replay" if replay else "no_replay"
        result[f"gap_max_{key}"], result[f"gap_mean_{key}"] = gap["max"], gap["mean"]
        result["response_tokens"] = gap["tokens"]
    result["gap_mean_ratio_replay_over_no_replay"] = result["gap_mean_replay"] / max(
        result["gap_mean_no_replay"], 1e-30
    )
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return result


def trained(
    model: str, max_new_tokens: int, steps: int, replay: bool, out: str, engine: str = "native", nproc: int = 2
) -> dict:
    """Part 2: one trainer run of the MoE default (with `model` as the actor, experts over `nproc` ranks) in bf16."""
    cmd = [
        sys.executable,
        "-m",
        "remax_megatron.launch",
        f"--nproc_per_node={nproc}",
        "-m",
        "remax_megatron.train",
        "--config",
        "configs/tiny_cpu_moe.yaml",
        f"actor.model={model}",
        f"rollout.max_new_tokens={max_new_tokens}",
        f"actor.ep={nproc}",
        f"rollout.engine={engine}",
        f"rollout.routing_replay={str(replay).lower()}",
        "actor.dtype=bfloat16",
        f"trainer.steps={steps}",
        "trainer.eval_every=0",
        "checkpoint.save_every=0",
        f"trainer.output_dir={out}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"trainer run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if '"loss"' in line]
    gaps_max = [r["logprob/engine_vs_actor_max_diff"] for r in records]
    gaps_mean = [r["logprob/engine_vs_actor_mean_diff"] for r in records]
    result = {
        "replay": replay,
        "steps": len(records),
        "gap_max_median": statistics.median(gaps_max),
        "gap_mean_median": statistics.median(gaps_mean),
        "gap_max": gaps_max,
        "gap_mean": gaps_mean,
    }
    if replay:  # the replayed token-layers the live router would have sent elsewhere, per step
        result["route_mismatch_frac"] = [r["moe/route_mismatch_frac"] for r in records]
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny-arith-moe", help="builtin:<name> or an HF MoE directory")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=DTYPES)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default="native", choices=["native", "vllm"])
    p.add_argument("--train-steps", type=int, default=0)
    p.add_argument("--nproc", type=int, default=2, help="part 2's processes (= actor.ep)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from remax_megatron.console import quiet_console

    quiet_console()  # the trainer's console: no megatron-core import warnings
    from remax_megatron.builtin.models import ensure_builtin_model

    model_dir = args.model
    if model_dir.startswith("builtin:"):
        model_dir = ensure_builtin_model(model_dir.split(":", 1)[1])
    _init_world_1()
    try:
        report = _report(args, model_dir)
    except ValueError as e:  # a refusal (e.g. vLLM's CPU build and routes): its one line
        raise SystemExit(f"error: {e}") from None
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


def _report(args, model_dir: str) -> dict:
    report = {
        "model": args.model,
        "engine": args.engine,
        "prompts": args.prompts,
        "n": args.n,
        "max_new_tokens": args.max_new_tokens,
        "controlled": [
            controlled(model_dir, d, args.prompts, args.n, args.max_new_tokens, args.seed, args.engine)
            for d in args.dtypes
        ],
    }
    if args.train_steps:
        with tempfile.TemporaryDirectory() as tmp:
            runs = [
                trained(
                    args.model,
                    args.max_new_tokens,
                    args.train_steps,
                    r,
                    os.path.join(tmp, f"replay-{r}"),
                    args.engine,
                    args.nproc,
                )
                for r in (False, True)
            ]
        report["trained_bf16"] = runs
        report["trained_gap_mean_median_ratio_replay_over_no_replay"] = runs[1]["gap_mean_median"] / max(
            runs[0]["gap_mean_median"], 1e-30
        )
    return report


if __name__ == "__main__":
    main()
