"""Benchmark the rollout engines on one model: vLLM, native and transformers' generate, ReMax's request.

    python tools/make_tiny_model.py --family llama --hidden 512 --layers 8 --heads 8 --kv-heads 4 \
        --ffn 1408 --vocab 32003 --out /tmp/llama-60m
    python tools/bench_rollout.py --hf-dir /tmp/llama-60m --prompts 16 --n 2 --max-new-tokens 64 \
        --device cpu --dtype fp32 --json rollout.json

One process (a world of 1), on --device (cpu, or cuda) in --dtype (fp32 or bf16). Each engine gets the model's
weights through the same sync the trainer uses, then decodes `--prompts` random prompts of `--prompt-len` tokens
with `n` sampled responses plus one greedy response each, in one request, `--repeats` times after one warm-up,
the engines taking turns (every engine built first; ABBA order over the repeats). A random model rarely samples
EOS (1 / vocab per token), so rows run to max_new_tokens on every engine; tokens_per_s counts what was decoded.

transformers-generate: what TRL's GRPOTrainer runs without vLLM, on the same prompts: the model loaded with
`AutoModelForCausalLM.from_pretrained` (SDPA attention), one `model.generate` of the P x (n + 1) rows (each
prompt repeated n + 1 times; the greedy row is sampled too, at the same cost), eager, transformers' default
DynamicCache, temperature 1, no top-k / top-p. vLLM runs where it is installed (its CPU build on CPU; the row
says "skipped" otherwise).

JSON: {"results": one object per engine: engine, samples_per_s (sampled completions / s of the ReMax request),
rows_per_s (sampled + greedy), tokens_per_s, seconds (median of --repeats after a warm-up), times and the
workload; "ratios": {"A_over_B": tokens/s of A / tokens/s of B} for every pair that ran; "vllm_over_native":
the samples/s ratio when both ran; "device", "dtype", "threads"}.
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

ENGINES = ("vllm", "native", "transformers-generate")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_prompts(args, arch) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(4, arch.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine_request(name: str, args, arch):
    """(request(step) -> output, tokens(output) -> tokens decoded): ReMax's request on engine `name`, its weights
    synced the trainer's way."""
    from remax_megatron.config import RolloutConfig
    from remax_megatron.rollout import SamplingParams, build_engine, sync_weights
    from remax_megatron.rollout.native import NativeEngine
    from remax_megatron.weights import HFCheckpointReader

    dtype = DTYPES[args.dtype]
    if name == "native":  # on --device, whatever CUDA says
        engine = NativeEngine(hf_dir=args.hf_dir, seed=0, dtype=dtype, device=args.device)
    else:
        engine = build_engine(
            RolloutConfig(engine=name, kv_cache_gib=args.kv_cache_gib),
            hf_dir=args.hf_dir,
            arch=arch,
            seed=0,
            dtype=dtype,
            max_model_len=args.prompt_len + args.max_new_tokens,
        )
    sync_weights(engine, HFCheckpointReader(args.hf_dir).tensors(), bucket_mb=64)
    prompts = make_prompts(args, arch)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)

    def request(step):
        return engine.generate(
            prompts, n=args.n, sampling=sampling, seeds=[step * 1000 + i for i in range(len(prompts))]
        )

    def tokens(out):
        return sum(len(c.token_ids) for r in out for c in r.sampled + [r.greedy])

    return request, tokens


def generate_request(args, arch):
    """TRL's engine without vLLM: one `model.generate` of every prompt n + 1 times (module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=DTYPES[args.dtype]).to(args.device).eval()
    prompts = make_prompts(args, arch)
    ids = torch.tensor([p for p in prompts for _ in range(args.n + 1)], device=args.device)  # [P * (n + 1), len]
    eos = model.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else (eos or []))

    def request(step):
        torch.manual_seed(step)
        with torch.no_grad():
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=model.generation_config.pad_token_id or 0,
            )

    def tokens(out):
        count = 0
        for row in out[:, ids.shape[1] :].tolist():  # up to and including the first EOS, as the engines count
            ends = [i for i, t in enumerate(row) if t in eos]
            count += ends[0] + 1 if ends else len(row)
        return count

    return request, tokens


def run_interleaved(requests: dict, args) -> dict:
    """{name: (seconds of each repeat, tokens of the last)}: one warm-up each, then --repeats rounds in which
    every engine serves the request once, the order reversed every other round (ABBA), so a change of the
    machine's speed during the run reaches every engine alike."""
    for request, _ in requests.values():
        request(0)
    names = list(requests)
    times = {name: [] for name in names}
    last = {}
    for step in range(1, args.repeats + 1):
        for name in names if step % 2 else names[::-1]:
            request, tokens = requests[name]
            _sync(args.device)
            start = time.perf_counter()
            out = request(step)
            _sync(args.device)
            times[name].append(time.perf_counter() - start)
            last[name] = tokens(out)
    return {name: (times[name], last[name]) for name in names}


def _row(name: str, args, times: list[float], tokens: int) -> dict:
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
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated: {', '.join(ENGINES)}")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="every engine's weights")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-gib", type=float, default=0.5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        p.error(f"--engines: unknown {unknown}; choose from {', '.join(ENGINES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    import importlib.util

    from remax_megatron.models import read_hf_config
    from remax_megatron.parallel import init_distributed

    init_distributed()
    arch = read_hf_config(args.hf_dir)
    requests, skipped = {}, {}
    for name in engines:
        if name == "vllm" and importlib.util.find_spec("vllm") is None:
            skipped[name] = "vLLM is not installed"
        elif name == "transformers-generate":
            requests[name] = generate_request(args, arch)
        else:
            requests[name] = engine_request(name, args, arch)
    measured = run_interleaved(requests, args)
    rows = [
        {"engine": name, "skipped": skipped[name]} if name in skipped else _row(name, args, *measured[name])
        for name in engines
    ]
    result = {"results": rows, "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads()}
    by = {r["engine"]: r for r in rows if "skipped" not in r}
    result["ratios"] = {
        f"{a}_over_{b}": by[a]["tokens_per_s"] / by[b]["tokens_per_s"] for a in by for b in by if a != b
    }
    if "vllm" in by and "native" in by:
        result["vllm_over_native"] = by["vllm"]["samples_per_s"] / by["native"]["samples_per_s"]
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
