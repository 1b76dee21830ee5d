"""Benchmark: naive vs fused per-token log-prob + ReMax loss, forward+backward.

    python tools/bench_kernels.py --device cpu --tokens 4096 --hidden 1024 \
        --vocab 32768 --json bench.json [--dtype fp32|bf16] [--repeats 5] [--tp 1]

Implementations (one JSON row each):
- ``naive``:  logits = h @ W.T -> log_softmax -> gather -> remax_loss
- ``fused``:  ``fused_logprobs(impl="torch")`` (chunked torch) -> remax_loss
- ``fused-hint``: the same with ``grad_hint`` = the loss's gradient (``logprob_gradient``,
  on-policy without KL): the gradients are taken in the forward, three GEMMs instead of four
- ``triton``: ``fused_logprobs(impl="triton")`` -> remax_loss (CUDA only)
- ``triton-hint``: the Triton path with ``grad_hint`` (three GEMM passes; CUDA only)

Every implementation runs in its own fresh subprocess, so allocator caches and
peaks of one cannot leak into another. Peak memory is measured ABOVE the
inputs (hidden, weight, labels, advantages already allocated):
- CUDA: ``torch.cuda.max_memory_allocated() - memory_allocated()`` after
  ``reset_peak_memory_stats()`` at the baseline.
- CPU: Linux's peak resident set size. After the inputs exist the peak is reset
  by writing ``5`` to ``/proc/self/clear_refs``; the first forward+backward then
  runs and ``VmHWM - VmRSS(baseline)`` is its peak. Large torch CPU tensors are
  mmap-backed, so RSS follows live tensors (tracemalloc cannot see them).
Time: median of ``--repeats`` (>= 3) forward+backward runs after that first
(warm-up) run; the first run's own time is ``first_call_ms`` (kernel compilation and, for Triton
on a GPU, autotuning: a second invocation with the same ``TRITON_CACHE_DIR`` reads the tuned
choice from disk). In the same subprocess a bare GEMM floor is timed: the three
GEMMs any implementation needs (``h @ W.T``, ``dz @ W``, ``dz.T @ h``);
``ratio_to_gemm_floor = fwd_bwd_ms / gemm_floor_ms``. ``gemm_passes``: the ``[N, V, D]`` GEMMs
the implementation runs (3 with the hint, 4 without). ``tflops`` counts
``8 * N * D * V`` per forward+backward (four GEMMs, whatever the implementation runs: comparable
across rows and with earlier runs). One summary line per implementation goes to stderr.
``--tp`` is recorded only: this tool runs a single rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _worker(args) -> dict:
    import torch

    from remax_megatron.kernels import fused_logprobs, logprob_gradient, remax_loss
    from tools.measure import first_call, repeat_ms, synchronize

    dev = torch.device(args.device)
    dtype = getattr(torch, _DTYPES[args.dtype])
    n, d, v = args.tokens, args.hidden, args.vocab
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, d, generator=gen) / d**0.5).to(dev, dtype).requires_grad_()
    weight = torch.randn(v, d, generator=gen).to(dev, dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen).to(dev)
    adv = torch.randn(1, generator=gen).to(dev)
    mask = torch.ones(1, n, device=dev)
    hinted = args.impl.endswith("-hint")
    hint = logprob_gradient(adv, mask, global_num_tokens=n)[0] if hinted else None  # [N]

    def step():
        hidden.grad = weight.grad = None
        if args.impl == "naive":
            logits = hidden.float() @ weight.float().T  # [N, V]
            logp = torch.log_softmax(logits, dim=-1).gather(1, labels[:, None]).squeeze(1)
        else:
            logp, _ = fused_logprobs(
                hidden, weight, labels, grad_hint=hint, impl="triton" if args.impl.startswith("triton") else "torch"
            )
        loss, _ = remax_loss(logp[None], adv, mask, global_num_tokens=n)
        loss.backward()

    first, peak = first_call(step, dev)
    times = repeat_ms(step, dev, args.repeats)
    fwd_bwd = statistics.median(times)
    with torch.no_grad():
        dz = torch.randn(n, v, device=dev, dtype=dtype)
        floor = []
        for _ in range(max(3, args.repeats // 2)):
            synchronize(dev)
            t0 = time.perf_counter()
            torch.matmul(hidden, weight.T)
            torch.matmul(dz, weight)
            torch.matmul(dz.T, hidden)
            synchronize(dev)
            floor.append((time.perf_counter() - t0) * 1e3)
    floor_ms = statistics.median(floor)
    return dict(
        impl=args.impl,
        tokens=n,
        hidden=d,
        vocab=v,
        tp=args.tp,
        dtype=args.dtype,
        device=args.device,
        fwd_bwd_ms=round(fwd_bwd, 2),
        first_call_ms=round(first, 2),
        gemm_passes=None if args.impl == "naive" else (3 if hinted else 4),
        peak_mem_mib=round(peak, 1),
        tflops=round(8 * n * d * v / (fwd_bwd * 1e-3) / 1e12, 4),
        gemm_floor_ms=round(floor_ms, 2),
        ratio_to_gemm_floor=round(fwd_bwd / floor_ms, 3),
        repeats=args.repeats,
        times_ms=[round(t, 2) for t in times],
    )


def summary(row: dict) -> str:
    """One line: the median against the GEMM floor, and the first call apart from it."""
    return (
        f"{row['impl']}: median {row['fwd_bwd_ms']} ms = {row['ratio_to_gemm_floor']}x the GEMM floor "
        f"({row['gemm_floor_ms']} ms, 3 GEMMs); first call {row['first_call_ms']} ms (compile/autotune, "
        f"not in the median); {row['tflops']} TFLOP/s; peak {row['peak_mem_mib']} MiB"
    )


def main(argv=None) -> list | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--impls", default=None, help="comma list; default naive,fused,fused-hint[,triton]")
    p.add_argument("--impl", default=None, help=argparse.SUPPRESS)  # worker mode
    args = p.parse_args(argv)
    if args.repeats < 3:
        raise SystemExit(f"--repeats: {args.repeats} must be >= 3 (the time is a median)")
    if args.impl is not None:
        print(json.dumps(_worker(args)))
        return
    impls = (
        args.impls.split(",")
        if args.impls
        else ["naive", "fused", "fused-hint"] + (["triton", "triton-hint"] if args.device == "cuda" else [])
    )
    rows = []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for impl in impls:
        cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl] + [
            f"--{k}={getattr(args, k)}" for k in ("device", "tokens", "hidden", "vocab", "dtype", "repeats", "tp")
        ]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{impl} failed:\n{out.stderr}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
        print(summary(row), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
