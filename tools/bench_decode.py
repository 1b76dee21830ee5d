"""Benchmark the native engine's decode loop against the loop before issue 49, same engine, same process.

    python tools/bench_decode.py --json decode.json                      # builtin:tiny-arith, CPU
    python tools/bench_decode.py --hf-dir /tmp/llama-60m --workloads full --max-new-tokens 64

"new" is rollout/native_decode.py (static cache, keyed batched sampler, host checks at tokens 1-8, 12, then
every 16); "old" is tests/rollout/_reference_decode.py (DynamicCache, finished rows removed every token, one
torch.Generator per row, host reads every token), the tests' reference, run on the same engine. Workloads,
each one ReMax request of --prompts prompts x (n sampled + 1 greedy) rows:
- arith: the built-in task's "a+b=" prompts: answers of 2-3 tokens (the tiny default's shape);
- random: random --prompt-len-token prompts: on the arith model rows end after 1-9 tokens, unevenly;
- full: random prompts with EOS off: every row runs to --max-new-tokens.
The two loops take turns (ABBA over --repeats after a warm-up of each); medians in ms, "new_over_old" is the
ratio of the medians (< 1: the new loop is faster). One process, --threads torch threads.

JSON: {"results": [{"workload", "rows", "tokens" (decoded, new loop), "new_ms", "old_ms", "new_over_old",
"new_times_ms", "old_times_ms"}], "model", "threads"}.
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

WORKLOADS = ("arith", "random", "full")


def make_prompts(workload: str, engine, args) -> list[list[int]]:
    if workload == "arith":
        from remax_megatron.builtin.tasks import arith_records

        texts = [r["prompt"] for r in arith_records()[:: max(1, 100 // args.prompts)][: args.prompts]]
        return [engine.tokenizer(t)["input_ids"] for t in texts]
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    return [torch.randint(4, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]


def bench_workload(workload: str, engine, args) -> dict:
    from remax_megatron.rollout import SamplingParams
    from tests.rollout._reference_decode import reference_decode

    prompts = make_prompts(workload, engine, args)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    seeds = list(range(len(prompts)))
    eos = engine.eos_token_ids
    engine.eos_token_ids = set() if workload == "full" else eos
    per = args.n + 1

    def new():
        return engine.generate(prompts, n=args.n, sampling=sampling, seeds=seeds)

    def old():  # the same seeds convention: sample j of prompt p draws from stream seeds[p] + j
        generators = [
            None if j == args.n else torch.Generator().manual_seed(seed + j) for seed in seeds for j in range(per)
        ]
        greedy = [j == args.n for _ in seeds for j in range(per)]
        limits = [args.max_new_tokens] * len(greedy)
        return reference_decode(engine, prompts, per, greedy, generators, sampling, limits)

    try:
        tokens = sum(len(c.token_ids) for ro in new() for c in ro.sampled + [ro.greedy])
        old()
        times = {"new": [], "old": []}
        for i in range(args.repeats):
            for name in ("new", "old") if i % 2 == 0 else ("old", "new"):
                start = time.perf_counter()
                (new if name == "new" else old)()
                times[name].append((time.perf_counter() - start) * 1e3)
    finally:
        engine.eos_token_ids = eos
    new_ms, old_ms = statistics.median(times["new"]), statistics.median(times["old"])
    return {
        "workload": workload,
        "rows": len(prompts) * per,
        "tokens": tokens,
        "new_ms": round(new_ms, 3),
        "old_ms": round(old_ms, 3),
        "new_over_old": round(new_ms / old_ms, 4),
        "new_times_ms": [round(t, 3) for t in times["new"]],
        "old_times_ms": [round(t, 3) for t in times["old"]],
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-dir", default="builtin:tiny-arith", help="a model directory or builtin:<name>")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32, help="random and full workloads")
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    workloads = args.workloads.split(",")
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        p.error(f"--workloads {','.join(unknown)}: not a workload; choose from {', '.join(WORKLOADS)}")

    from remax_megatron.builtin.models import resolve_model
    from remax_megatron.rollout import sync_weights
    from remax_megatron.rollout.native import NativeEngine
    from remax_megatron.weights import HFCheckpointReader

    torch.set_num_threads(args.threads)
    hf_dir = resolve_model(args.hf_dir, "--hf-dir")
    engine = NativeEngine(hf_dir=hf_dir, seed=0, dtype=torch.float32, device="cpu")
    sync_weights(engine, HFCheckpointReader(hf_dir).tensors(), bucket_mb=64)
    result = {
        "results": [bench_workload(w, engine, args) for w in workloads],
        "model": args.hf_dir,
        "threads": args.threads,
    }
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
