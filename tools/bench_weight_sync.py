"""Benchmark the rollout weight sync: actor export -> buckets -> native engine, against the transport.

    python tools/make_tiny_model.py --family llama --hidden 1024 --layers 8 --heads 16 --kv-heads 8 \
        --ffn 2816 --vocab 32000 --out /tmp/bench-model
    torchrun --nproc_per_node=4 tools/bench_weight_sync.py --hf-dir /tmp/bench-model --tp 2 --pp 2 \
        --json sync.json

Every rank builds the actor shard (TP x PP from the flags, DP = the rest) and a
native engine (a full replica), then times the trainer's `WeightSync(engine,
actor)()` (export in the engine dtype -> buckets -> engine) between barriers. Measured in the same run:

- transport_gbps: one plain `dist.broadcast` of the same number of bytes from
  rank 0 over all ranks and the same backend: what the transport allows;
- memcpy_gbps: a single-process tensor copy of min(bytes, 256 MiB);
- max_logprob_diff: engine vs actor log-probs on a fixed batch after the sync.

JSON (rank 0 writes it): bytes, seconds (median of --repeats syncs after one
warm-up), gbps, transport_gbps, memcpy_gbps, ratio (= gbps / transport_gbps),
buckets, max_logprob_diff, plus the layout and the per-repeat times.
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
import torch.distributed as dist  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _timed(fn, repeats: int) -> list[float]:
    """Wall seconds of fn() between barriers (the slowest rank decides), `repeats` times."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def _memcpy_gbps(nbytes: int, repeats: int) -> float:
    n = min(nbytes, 256 * 2**20)
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return n / statistics.median(times) / 1e9


def _max_logprob_diff(actor, engine, vocab: int) -> float:
    from remax_megatron.models.forward import broadcast_from_last_stage, forward_only

    ids = torch.randint(4, vocab, (4, 64), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    out = forward_only(actor, [{"input_ids": ids, "labels": labels}],
                       lambda m, hidden, batch: m.token_logprobs(hidden, batch["labels"])[0])
    actor_lp = broadcast_from_last_stage(out[0] if out else None, ids.shape, torch.float32)
    diff = (engine.score(ids, labels).float().cpu() - actor_lp.float()).abs().max().view(1).double()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff.item())


def run(args) -> dict:
    from remax_megatron.config import RolloutConfig
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.parallel import ParallelLayout, init_distributed
    from remax_megatron.rollout import WeightSync, build_engine
    from remax_megatron.weights import load_hf_weights

    rank, world = init_distributed()
    layout = ParallelLayout(tp=args.tp, pp=args.pp, world_size=world)
    layout.initialize(seed=0)
    arch = read_hf_config(args.hf_dir)
    dtype = DTYPES[args.dtype]
    actor = build_policy(arch, tp=args.tp, pp=args.pp, params_dtype=dtype, trainable=False)
    load_hf_weights(actor, args.hf_dir)
    engine = build_engine(RolloutConfig(sync_bucket_mb=args.bucket_mb), hf_dir=args.hf_dir, arch=arch,
                          seed=0, dtype=dtype)
    weight_sync = WeightSync(engine, actor, bucket_mb=args.bucket_mb)
    stats = {}

    def sync():
        stats.update(weight_sync())

    sync()  # warm-up: first-touch page faults, allocator growth
    sync_times = _timed(sync, args.repeats)
    nbytes = stats["bytes"]
    payload = torch.empty(nbytes, dtype=torch.uint8)
    if rank == 0:
        payload.fill_(1)
    device_payload = payload.cuda() if dist.get_backend() == "nccl" else payload
    dist.broadcast(device_payload, src=0)
    bcast_times = _timed(lambda: dist.broadcast(device_payload, src=0), args.repeats)
    seconds, bcast = statistics.median(sync_times), statistics.median(bcast_times)
    result = {
        "bytes": nbytes,
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9,
        "transport_gbps": nbytes / bcast / 1e9,
        "memcpy_gbps": _memcpy_gbps(nbytes, args.repeats),
        "buckets": stats["buckets"],
        "max_logprob_diff": _max_logprob_diff(actor, engine, arch.vocab_size),
        "tp": args.tp, "pp": args.pp, "world": world, "backend": dist.get_backend(),
        "dtype": args.dtype, "bucket_mb": args.bucket_mb, "sync_times": sync_times,
        "broadcast_times": bcast_times,
    }
    result["ratio"] = result["gbps"] / result["transport_gbps"]
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF model directory (make one with tools/make_tiny_model.py)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--json", default=None, help="write the result object here (rank 0)")
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--repeats", type=int, default=3, help="timed syncs (>= 3; the median is reported)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = p.parse_args(argv)
    if args.repeats < 3:
        sys.exit(f"error: --repeats {args.repeats}: the median needs at least 3")
    if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        sys.exit(f"error: --hf-dir {args.hf_dir} has no config.json: make one with tools/make_tiny_model.py "
                 "(see this file's docstring)")
    try:
        result = run(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if dist.get_rank() == 0:
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
