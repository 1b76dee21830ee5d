"""Benchmark: the SDPA core attention (models/attention.py) vs megatron-core's DotProductAttention, forward+backward.

    python tools/bench_attention.py --device cpu --json bench.json [--seq 512 | --long] [--batch 2] \
        [--heads 16] [--kv-heads 8] [--head-dim 128] [--dtype fp32|bf16] [--repeats 5] [--window 0] [--sink]

`--long` is --seq 2048 (the update shape issue 50's MFU goal is set at). The defaults are the 0.89B Llama
of issue 50 (16 query / 8 KV heads of 128). One JSON row per implementation:
- ``sdpa``: TorchDotProductAttention (torch SDPA; FlexAttention on CUDA for --window / --sink)
- ``megatron``: megatron-core's DotProductAttention (baddbmm into [b * heads, s, s], softmax, bmm; K/V
  repeated for GQA), megatron's local-spec attention before this project's

Each implementation runs in its own subprocess (allocator caches and peaks of one do not leak into the other).
Time: median of --repeats causal forward+backward runs (q, k, v gradients) after one warm-up run. Peak memory
ABOVE the inputs: on CUDA max_memory_allocated - memory_allocated after reset_peak_memory_stats; on CPU Linux's
peak resident set (VmHWM after /proc/self/clear_refs, minus VmRSS there), as tools/bench_kernels.py.
``speedup`` = megatron ms / sdpa ms; ``memory_ratio`` = megatron peak / sdpa peak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the workers import tools.measure

_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
IMPLS = ("sdpa", "megatron")


def _module(args, impl: str):
    import types

    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = args.device == "cuda"
    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.heads * args.head_dim,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        kv_channels=args.head_dim,
        use_cpu_initialization=not cuda,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        bf16=args.dtype == "bf16",
        params_dtype=getattr(torch, _DTYPES[args.dtype]),
        softmax_type="learnable" if args.sink else "vanilla",
        window_size=(args.window - 1, 0) if args.window else None,
        window_attn_skip_freq=None,
    )

    class OneRank:
        def size(self):
            return 1

        def rank(self):
            return 0

    tp = types.SimpleNamespace(tp=OneRank())
    kw = dict(attn_mask_type=AttnMaskType.causal, attention_type="self", pg_collection=tp)
    if impl == "sdpa":
        from remax_megatron.models.attention import TorchDotProductAttention

        return TorchDotProductAttention(config, 1, **kw)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if not cuda:
        from remax_megatron.parallel import cpu_compat

        cpu_compat.install()  # its score buffer, causal mask and RNG fork name CUDA
        from megatron.core.fusions import fused_softmax

        def window_mask_on_cpu(sq, skv, window_size):  # megatron's builds on device="cuda"
            m = torch.ones(sq, skv, dtype=torch.bool)
            return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

        fused_softmax.get_sliding_window_causal_mask = window_mask_on_cpu
    parallel_state._set_global_memory_buffer()
    tensor_parallel.get_cuda_rng_tracker().add("model-parallel-rng", 1234)
    return DotProductAttention(config, 1, **kw)


def _worker(args) -> dict:
    import torch

    from tools.measure import first_call, repeat_ms

    dev = torch.device(args.device)
    dtype = getattr(torch, _DTYPES[args.dtype])
    module = _module(args, args.impl)
    b, s = args.batch, args.seq
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, args.heads, args.head_dim, generator=gen).to(dev, dtype).requires_grad_()
    k = torch.randn(s, b, args.kv_heads, args.head_dim, generator=gen).to(dev, dtype).requires_grad_()
    v = torch.randn(s, b, args.kv_heads, args.head_dim, generator=gen).to(dev, dtype).requires_grad_()
    grad = torch.randn(s, b, args.heads * args.head_dim, generator=gen).to(dev, dtype)

    def step():
        for x in (q, k, v):
            x.grad = None
        module(q, k, v, None).backward(grad)

    _, peak = first_call(step, dev)
    times = repeat_ms(step, dev, args.repeats)
    return {"impl": args.impl, "fwd_bwd_ms": round(statistics.median(times), 3), "peak_mib": round(peak, 2)}


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--long", action="store_true", help="--seq 2048")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=0, help="HF sliding_window W (0: none)")
    p.add_argument("--sink", action="store_true", help="a learnable sink logit per head")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write the result here (stdout always)")
    p.add_argument("--impl", choices=IMPLS, default=None, help=argparse.SUPPRESS)  # the worker's
    args = p.parse_args(argv)
    if args.long:
        args.seq = 2048
    if args.repeats < 3:
        p.error(f"--repeats {args.repeats}: use at least 3 (the median of fewer means little)")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    return args


def main(argv=None) -> dict:
    args = _parse(argv)
    if args.impl is not None:
        print(json.dumps(_worker(args)))
        return {}
    rows = []
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
    with contextlib.suppress(ValueError):  # the parent's --json is not the workers'
        i = forwarded.index("--json")
        del forwarded[i : i + 2]
    for impl in IMPLS:
        out = subprocess.run(
            [sys.executable, __file__, *forwarded, "--impl", impl], capture_output=True, text=True, check=False
        )
        if out.returncode != 0:
            raise RuntimeError(f"{impl} worker failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    by = {r["impl"]: r for r in rows}
    result = {
        "device": args.device,
        "dtype": args.dtype,
        "batch": args.batch,
        "seq": args.seq,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "window": args.window,
        "sink": args.sink,
        "repeats": args.repeats,
        "rows": rows,
        "speedup": round(by["megatron"]["fwd_bwd_ms"] / max(by["sdpa"]["fwd_bwd_ms"], 1e-9), 3),
        "memory_ratio": round(by["megatron"]["peak_mib"] / max(by["sdpa"]["peak_mib"], 1e-9), 3),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
