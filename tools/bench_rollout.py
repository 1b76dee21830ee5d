"""Benchmark the rollout engines on one model: vLLM vs native, samples/s of ReMax's request.

    python tools/make_tiny_model.py --family llama --hidden 512 --layers 8 --heads 8 --kv-heads 4 \
        --ffn 1408 --vocab 32003 --out /tmp/llama-60m
    python tools/bench_rollout.py --hf-dir /tmp/llama-60m --prompts 16 --n 2 --max-new-tokens 64 \
        --json rollout.json

One process (a world of 1). Each engine gets the model's weights through the same sync
the trainer uses, then decodes `--prompts` random prompts of `--prompt-len` tokens with
`n` sampled responses plus one greedy response each, in one request, `--repeats` times
(after one warm-up). A random model rarely samples EOS (1 / vocab per token), so rows run
to max_new_tokens on both engines; tokens_per_s counts what was decoded.

JSON: {"results": one object per engine: engine, samples_per_s (sampled completions / s
of the ReMax request), rows_per_s (sampled + greedy), tokens_per_s, seconds (median of
--repeats after a warm-up), times and the workload; "vllm_over_native": the samples/s
ratio when both ran, "threads"}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def bench_engine(name: str, args, arch) -> dict:
    from remax_megatron.config import RolloutConfig
    from remax_megatron.rollout import SamplingParams, build_engine, sync_weights
    from remax_megatron.weights import HFCheckpointReader

    engine = build_engine(
        RolloutConfig(engine=name, kv_cache_gib=args.kv_cache_gib),
        hf_dir=args.hf_dir,
        arch=arch,
        seed=0,
        dtype=torch.float32,
        max_model_len=args.prompt_len + args.max_new_tokens,
    )
    sync_weights(engine, HFCheckpointReader(args.hf_dir).tensors(), bucket_mb=64)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, arch.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)
    ]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)

    def remax_request(step):
        return engine.generate(
            prompts, n=args.n, sampling=sampling, seeds=[step * 1000 + i for i in range(len(prompts))]
        )

    remax_request(0)  # warm-up
    times = []
    for step in range(1, args.repeats + 1):
        start = time.perf_counter()
        out = remax_request(step)
        times.append(time.perf_counter() - start)
    tokens = sum(len(c.token_ids) for r in out for c in r.sampled + [r.greedy])
    seconds = statistics.median(times)
    return {
        "engine": name,
        "prompts": args.prompts,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "seconds": seconds,
        "times": times,
        "samples_per_s": args.prompts * args.n / seconds,
        "rows_per_s": args.prompts * (args.n + 1) / seconds,
        "tokens_per_s": tokens / seconds,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--engines", default="vllm,native", help="comma-separated: vllm, native")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-gib", type=float, default=0.5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from remax_megatron.models import read_hf_config
    from remax_megatron.parallel import init_distributed

    init_distributed()
    arch = read_hf_config(args.hf_dir)
    rows = [bench_engine(name, args, arch) for name in args.engines.split(",")]
    result = {"results": rows, "threads": torch.get_num_threads()}
    by = {r["engine"]: r for r in rows}
    if "vllm" in by and "native" in by:
        result["vllm_over_native"] = by["vllm"]["samples_per_s"] / by["native"]["samples_per_s"]
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
