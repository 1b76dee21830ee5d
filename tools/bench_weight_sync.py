"""Benchmark the rollout weight sync: actor export -> buckets -> rollout engine, against the transport.

    python tools/make_tiny_model.py --family llama --hidden 1024 --layers 8 --heads 16 --kv-heads 8 \
        --ffn 2816 --vocab 32000 --out /tmp/bench-model
    torchrun --nproc_per_node=4 tools/bench_weight_sync.py --hf-dir /tmp/bench-model --tp 2 --pp 2 \
        --json sync.json [--engine vllm|native]

Every rank builds the actor shard (TP x PP from the flags, DP = the rest) and an
engine (--engine: vLLM, the default, its CPU build on CPU; or native), then times the trainer's `WeightSync(engine,
actor)()` (export in the engine dtype -> buckets -> engine) between barriers. Measured in the same run:

- transport_gbps: one plain `dist.broadcast` of the same number of bytes from
  rank 0 over all ranks and the same backend: what the transport allows;
- memcpy_gbps: a single-process tensor copy of min(bytes, 256 MiB);
- copy_floor_s: one device-to-device copy of the same bytes on the engine's device (`dst.copy_(src)`, both
  preallocated): the least a colocated sync can cost; `time/sync_s` (the sync's median) and
  `sync_over_copy_floor` (= time/sync_s / copy_floor_s) set the sync against it;
- floor_s (vLLM): the engine's own cost, every rank's engine reloading the same tensors already
  in its memory (`VllmEngine.reload`, ONE reload_weights call, no export, no copy);
- transport_s: the plain broadcast's median seconds (transport_gbps in seconds);
- max_logprob_diff: after the sync, every rank's engine samples 2 prompts (n=1 +
  greedy); the actor scores all ranks' rows; the largest |engine - actor| log-prob.

The syncs, the plain broadcasts and the floors are timed between barriers in turns (the order
reversed every repeat), `--repeats` of each after one warm-up of each.

JSON (rank 0 writes it): bytes, seconds (median of the syncs), gbps, transport_gbps, memcpy_gbps,
ratio (= gbps / transport_gbps), time/sync_s, copy_floor_s, sync_over_copy_floor, in_place (the native
engine: tensors the export wrote straight into its parameters / copied from a bucket), transport_s,
floor_s and overhead_ratio (= (floor_s + transport_s) / seconds: 1.0 when the sync costs no more than its
two parts; vLLM only), buckets, max_logprob_diff, plus the layout and the per-repeat times.
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
    from remax_megatron.batching import pad_sequences
    from remax_megatron.rollout import SamplingParams, flatten_rollouts

    gen = torch.Generator().manual_seed(dist.get_rank())
    prompts = [torch.randint(4, vocab, (16,), generator=gen).tolist() for _ in range(2)]
    rollouts = engine.generate(
        prompts, n=1, sampling=SamplingParams(max_new_tokens=16), seeds=[dist.get_rank() * 2, dist.get_rank() * 2 + 1]
    )
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, (prompts, rollouts))
    rows_p, rows_c = flatten_rollouts(
        [p for ps, _ in shares for p in ps], [r for _, rs in shares for r in rs], include_greedy=True
    )
    batch = pad_sequences(rows_p, rows_c, pad_id=0)
    out = forward_only(
        actor,
        [{"input_ids": batch["input_ids"], "labels": batch["labels"]}],
        lambda m, hidden, b: m.token_logprobs(hidden, b["labels"])[0],
    )
    actor_lp = broadcast_from_last_stage(out[0] if out else None, batch["input_ids"].shape, torch.float32)
    mask = batch["response_mask"]
    return float((batch["engine_logprobs"] - actor_lp.float())[mask].abs().max())


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
    engine = build_engine(
        RolloutConfig(engine=args.engine, sync_bucket_mb=args.bucket_mb, kv_cache_gib=args.kv_cache_gib),
        hf_dir=args.hf_dir,
        arch=arch,
        seed=0,
        dtype=dtype,
        max_model_len=64,
    )
    weight_sync = WeightSync(engine, actor, bucket_mb=args.bucket_mb)
    stats = {}

    def sync():
        stats.update(weight_sync())

    sync()  # warm-up: first-touch page faults, allocator growth
    nbytes = stats["bytes"]
    payload = torch.empty(nbytes, dtype=torch.uint8)
    if rank == 0:
        payload.fill_(1)
    device_payload = payload.cuda() if dist.get_backend() == "nccl" else payload
    dist.broadcast(device_payload, src=0)
    # The copy floor: the same bytes copied once on the engine's device (one kernel, no export, no merge).
    copy_src = torch.ones(nbytes, dtype=torch.uint8, device=engine.device)
    copy_dst = torch.empty_like(copy_src)

    def copy_floor():
        copy_dst.copy_(copy_src)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)

    copy_floor()
    parts = {"sync": sync, "broadcast": lambda: dist.broadcast(device_payload, src=0), "copy_floor": copy_floor}
    if args.engine == "vllm":  # the engine's floor: its reload of the same tensors, held in memory
        held = [(name, tensor.clone()) for name, tensor in weight_sync.exporter]
        if engine.untied_head:
            held += [("lm_head.weight", t) for n, t in held if n == "model.embed_tokens.weight"]
        engine.reload(iter(held))  # warm-up, as the syncs had
        parts["floor"] = lambda: engine.reload(iter(held))
    # Interleaved, the order reversed every repeat: a machine whose speed drifts moves all parts alike.
    times = {name: [] for name in parts}
    for r in range(args.repeats):
        for name in list(parts) if r % 2 == 0 else list(parts)[::-1]:
            times[name] += _timed(parts[name], 1)
    sync()  # the engine ends on the synced weights (the same values either way)
    sync_times, bcast_times, floor_times = times["sync"], times["broadcast"], times.get("floor", [])
    seconds, bcast = statistics.median(sync_times), statistics.median(bcast_times)
    copy_floor_s = statistics.median(times["copy_floor"])
    result = {
        "bytes": nbytes,
        "seconds": seconds,
        "time/sync_s": seconds,
        "copy_floor_s": copy_floor_s,
        "sync_over_copy_floor": seconds / copy_floor_s,
        "copy_floor_times": times["copy_floor"],
        "in_place": getattr(engine, "last_update", None) or None,
        "device": str(engine.device),
        "gbps": nbytes / seconds / 1e9,
        "transport_gbps": nbytes / bcast / 1e9,
        "memcpy_gbps": _memcpy_gbps(nbytes, args.repeats),
        "buckets": stats["buckets"],
        "max_logprob_diff": _max_logprob_diff(actor, engine, arch.vocab_size),
        "engine": args.engine,
        "tp": args.tp,
        "pp": args.pp,
        "world": world,
        "backend": dist.get_backend(),
        "dtype": args.dtype,
        "bucket_mb": args.bucket_mb,
        "sync_times": sync_times,
        "broadcast_times": bcast_times,
        "transport_s": bcast,
    }
    result["ratio"] = result["gbps"] / result["transport_gbps"]
    if floor_times:
        result.update(floor_s=statistics.median(floor_times), floor_times=floor_times)
        result["overhead_ratio"] = (result["floor_s"] + bcast) / seconds
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
    p.add_argument("--engine", default="vllm", choices=["vllm", "native"])
    p.add_argument("--kv-cache-gib", type=float, default=0.1, help="vLLM KV cache per engine (rollout.kv_cache_gib)")
    args = p.parse_args(argv)
    if args.repeats < 3:
        sys.exit(f"error: --repeats {args.repeats}: the median needs at least 3")
    if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        sys.exit(
            f"error: --hf-dir {args.hf_dir} has no config.json: make one with tools/make_tiny_model.py "
            "(see this file's docstring)"
        )
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
    if "vllm" in sys.modules:  # vLLM's external launcher tears down its groups and the default one
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
