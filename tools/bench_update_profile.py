"""Where the update's time goes: MFU of the update alone and a torch.profiler breakdown of it.

    python tools/bench_update_profile.py [--shapes 0.89b-144,0.89b-2048] [--small] [--updates 3]
        [--dtype bfloat16|float32] [--json OUT] [key=value ...]

One process (world 1; under torchrun every rank runs it and rank 0 reports) builds a randomly initialised
Llama actor (megatron, this project's spec), its DDP wrapper and optimizer as the trainer does, and runs
`Updater.train_on` (micro-batches through megatron's schedule, the fused log-prob kernel with its gradient
hint, the ReMax loss, the optimizer step) on a synthetic batch: random token rows, the response after the
first `prompt_tokens`, random rewards against a zero greedy baseline. Per shape:

1. one warm-up update, timed alone (`first_update_s`: compilation, autotuning, allocator growth,
   optimizer state allocation);
2. `--updates` (>= 3) updates without the profiler: `update_s` is their median; `tflops` = 3 forward
   passes' model FLOPs (remax_megatron.flops.forward_flops: forward + backward, no recompute) / update_s;
   `mfu` = tflops / the device's peak (None on CPU or an unknown GPU; `trainer.peak_tflops=X` sets it);
3. one update under torch.profiler, its time split into categories (`breakdown_s`, `breakdown_frac`):

   - `attention_core`: scores, softmax and values (the layers' core_attention modules), forward and backward;
   - `attention_linear`: the rest of self-attention: QKV and output projections, RoPE;
   - `mlp`: the MLP modules: fc1 / fc2 GEMMs and the activation;
   - `logprob_kernel`: fused_logprobs (output layer GEMMs, softmax statistics) and its backward;
   - `optimizer`: the optimizer step (grad norm, clipping, Adam);
   - `all_reduce`: collectives (all_reduce, reduce_scatter, all_gather: gloo / NCCL), wherever they run;
   - `other_ops`: every other op (embedding, norms, residual adds, the loss, grad accumulation);
   - `python` (CPU) / `device_idle` (CUDA): on CPU, host time inside the update with no op running;
     on CUDA, the profiled update's wall time minus the kernels' summed time (the GPU waiting on the
     host; approximate where kernels overlap).

   Forward ops are labelled by module hooks (record_function ranges); a backward op takes the label of
   the forward op that created its autograd node (the profiler's sequence numbers). On CPU an op's time is
   its self CPU time, on CUDA the self device time of the kernels it launched. The categories add up to the
   profiled update's wall time (`profiled_update_s`, with the profiler's overhead; `sum_of_categories_s`).

Shapes: `0.89b-144` (hidden 2048, 16 layers, 16 / 8 heads, ffn 5632, vocab 32003; 128 rows x 144 tokens, 16
prompt tokens, the first GPU run's batch), `0.89b-2048` (9 rows x 2048 tokens: the same 18432 tokens),
`small` (hidden 64, 2 layers: CPU-sized; `--small` runs it alone), `mid` (hidden 256, 4 layers, 8 / 4 heads,
ffn 688, vocab 32003; 4 rows x 512 tokens: about 25 s on 2 CPU cores). Extra `key=value` arguments override the
trainer config (e.g. `trainer.micro_batch_size=8`). One JSON object: `{"shapes": [row, ...]}`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "0.89b": dict(hidden=2048, layers=16, heads=16, kv_heads=8, ffn=5632, vocab=32003),
    "small": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512),
    "mid": dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=688, vocab=32003),
}
SHAPES = {
    "0.89b-144": dict(model="0.89b", rows=128, row_tokens=144, prompt_tokens=16, micro_batch_size=16),
    "0.89b-2048": dict(model="0.89b", rows=9, row_tokens=2048, prompt_tokens=256, micro_batch_size=1),
    "small": dict(model="small", rows=8, row_tokens=48, prompt_tokens=8, micro_batch_size=4),
    "mid": dict(model="mid", rows=4, row_tokens=512, prompt_tokens=64, micro_batch_size=2),
}
CATEGORIES = ("attention_core", "attention_linear", "mlp", "logprob_kernel", "optimizer", "all_reduce", "other_ops")
_LABEL = "remax::"
_ROOT_LABEL = _LABEL + "update"
_COLLECTIVES = ("all_reduce", "allreduce", "reduce_scatter", "all_gather", "allgather", "nccl:", "gloo:", "c10d::")
_BACKWARD = "autograd::engine::evaluate_function: "


def _arch(model: str):
    from remax_megatron.models.arch import ModelArch

    m = MODELS[model]
    return ModelArch(
        architecture="LlamaForCausalLM",
        family="llama",
        task="causal_lm",
        hidden_size=m["hidden"],
        ffn_hidden_size=m["ffn"],
        num_layers=m["layers"],
        num_heads=m["heads"],
        num_kv_heads=m["kv_heads"],
        head_dim=m["hidden"] // m["heads"],
        vocab_size=m["vocab"],
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        rope_scaling_factor=None,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        pad_token_id=None,
        torch_dtype="bfloat16",
    )


def _batch(shape: dict, vocab: int, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    rows, width, prompt = shape["rows"], shape["row_tokens"], shape["prompt_tokens"]
    ids = torch.randint(4, vocab, (rows, width), generator=g)
    labels = torch.roll(ids, -1, 1)
    mask = torch.zeros(rows, width)
    mask[:, prompt - 1 : width - 1] = 1  # labels of the response tokens
    labels[mask == 0] = -100
    rewards = torch.randn(rows, generator=g)
    return dict(input_ids=ids, labels=labels, response_mask=mask, rewards=rewards, baseline=torch.zeros(rows))


def _trainer(arch, dtype, overrides: list[str]):
    """A Trainer over a randomly initialised DDP actor and the trainer's optimizer (Updater.train_on only)."""
    from types import SimpleNamespace

    from remax_megatron.config import load_config
    from remax_megatron.models import build_policy
    from remax_megatron.optimizer import attach_to_schedule, build_optimizer, build_scheduler, wrap_ddp
    from remax_megatron.parallel import ParallelLayout, init_distributed
    from remax_megatron.trainer import Trainer

    _, world = init_distributed()
    groups = ParallelLayout(tp=1, pp=1, world_size=world).initialize(seed=0)
    cfg = load_config(None, ["reward.functions=[exact_match]", *overrides])
    recompute = None if cfg.actor.recompute == "none" else cfg.actor.recompute
    actor = build_policy(arch, tp=1, pp=1, params_dtype=dtype, recompute_granularity=recompute)
    ddp = wrap_ddp(actor, cfg.optim.distributed_optimizer)
    opt = build_optimizer(ddp, cfg.optim, dtype, groups)
    attach_to_schedule(ddp, opt)
    parts = SimpleNamespace(
        cfg=cfg,
        groups=groups,
        actor=ddp,
        optimizer=opt,
        scheduler=build_scheduler(opt, cfg.optim, 1000),
        kl=SimpleNamespace(coef=0.0),
    )
    return Trainer(parts, logger=None), actor, cfg


@contextlib.contextmanager
def labelled(actor, updater):
    """record_function ranges around the categories' modules and calls (module docstring)."""
    import torch
    from torch.autograd.profiler import record_function

    import remax_megatron.models.gpt as gpt

    handles, stack = [], []

    def enter(name):
        def hook(*_):
            rf = record_function(_LABEL + name)
            rf.__enter__()
            stack.append(rf)

        return hook

    def leave(*_):
        stack.pop().__exit__(None, None, None)

    def label(module, name):
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))

    for module in actor.modules():
        if isinstance(getattr(module, "self_attention", None), torch.nn.Module):
            label(module.self_attention, "attention_linear")
            core = getattr(module.self_attention, "core_attention", None)
            if isinstance(core, torch.nn.Module):
                label(core, "attention_core")
        if isinstance(getattr(module, "mlp", None), torch.nn.Module):
            label(module.mlp, "mlp")

    fused, step = gpt.fused_logprobs, updater._optimizer_step

    def fused_labelled(*args, **kwargs):
        with record_function(_LABEL + "logprob_kernel"):
            return fused(*args, **kwargs)

    def step_labelled(*args, **kwargs):
        with record_function(_LABEL + "optimizer"):
            return step(*args, **kwargs)

    gpt.fused_logprobs, updater._optimizer_step = fused_labelled, step_labelled
    try:
        yield
    finally:
        gpt.fused_logprobs = fused
        del updater._optimizer_step  # the instance attribute; the method shows again
        for h in handles:
            h.remove()


def _is_collective(name: str) -> bool:
    low = name.lower()
    return any(c in low for c in _COLLECTIVES)


def breakdown(events, device: bool) -> tuple[dict, float]:
    """Seconds per category of profiler `events` ({category: s}, the ops' summed time) and the host time no op
    covers. device: CUDA kernel time (each CPU op's self device time: the kernels it launched itself), else self
    CPU time; on CPU a label range's own time is `python`."""
    from torch.autograd import DeviceType

    by_seq = {}  # forward op's sequence number -> its category (for the backward ops of its node)
    memo = {}

    def category(e):
        key = id(e)
        if key in memo:
            return memo[key]
        node, found = e, None
        while node is not None and found is None:
            name = node.name
            if _is_collective(name):
                found = "all_reduce"
            elif name.startswith(_LABEL) and name != _ROOT_LABEL:
                found = name[len(_LABEL) :]
            elif name.startswith(_BACKWARD):
                if "_FusedLogprobsFn" in name:
                    found = "logprob_kernel"
                else:
                    found = by_seq.get(node.sequence_nr, "other_ops")
            node = node.cpu_parent
        memo[key] = found or "other_ops"
        return memo[key]

    ordered = sorted(events, key=lambda e: e.time_range.start)
    for e in ordered:  # forward ops first in time: their categories are known before their backward runs
        if e.sequence_nr >= 0 and not e.name.startswith(_BACKWARD):
            cat = category(e)
            if cat != "other_ops":
                by_seq.setdefault(e.sequence_nr, cat)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    python = 0.0
    for e in ordered:
        if device and e.device_type != DeviceType.CPU:
            continue  # a kernel's own event: counted through the CPU op that launched it
        t = (e.self_device_time_total if device else e.self_cpu_time_total) * 1e-6
        if e.name.startswith(_LABEL) and not device:
            python += t  # host time inside a label that no op covers
        else:
            totals[category(e)] += t
    return totals, python


def measure(name: str, updates: int, dtype_name: str | None, overrides: list[str]) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from remax_megatron.flops import forward_flops, peak_tflops

    shape = SHAPES[name]
    cuda = torch.cuda.is_available()
    dtype = getattr(torch, dtype_name or ("bfloat16" if cuda else "float32"))
    arch = _arch(shape["model"])
    overrides = [f"trainer.micro_batch_size={shape['micro_batch_size']}", "trainer.micro_batch_tokens=0", *overrides]
    trainer, actor, cfg = _trainer(arch, dtype, overrides)
    updater = trainer.updater
    batch = _batch(shape, arch.vocab_size)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def update():
        sync()
        t0 = time.perf_counter()
        updater.train_on({k: v.clone() for k, v in batch.items()}, None, None)
        sync()
        return time.perf_counter() - t0

    first = update()
    times = [update() for _ in range(updates)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with labelled(actor, updater), profile(activities=activities) as prof:
        sync()
        t0 = time.perf_counter()
        with record_function(_ROOT_LABEL):
            updater.train_on({k: v.clone() for k, v in batch.items()}, None, None)
        sync()
        profiled = time.perf_counter() - t0
    ops, python = breakdown(prof.events(), device=cuda)
    parts = dict(ops)
    if cuda:
        parts["device_idle"] = max(0.0, profiled - sum(ops.values()))
    else:
        parts["python"] = python
    update_s = statistics.median(times)
    flops = 3 * forward_flops(arch, [shape["row_tokens"]] * shape["rows"])
    tflops = flops / update_s / 1e12
    peak = peak_tflops(dtype, cfg.trainer.peak_tflops)
    return dict(
        shape=name,
        model=dict(MODELS[shape["model"]]),
        rows=shape["rows"],
        row_tokens=shape["row_tokens"],
        prompt_tokens=shape["prompt_tokens"],
        micro_batch_size=cfg.trainer.micro_batch_size,
        dtype=str(dtype).removeprefix("torch."),
        device=torch.cuda.get_device_name() if cuda else "cpu",
        first_update_s=round(first, 4),
        update_s=round(update_s, 4),
        update_times_s=[round(t, 4) for t in times],
        model_flops_per_update=flops,
        tflops=round(tflops, 6),
        peak_tflops=peak,
        mfu=round(tflops / peak, 4) if peak else None,
        profiled_update_s=round(profiled, 4),
        breakdown_s={k: round(v, 5) for k, v in parts.items()},
        breakdown_frac={k: round(v / profiled, 4) for k, v in parts.items()},
        sum_of_categories_s=round(sum(parts.values()), 5),
    )


def _in_subprocess(name: str, args) -> dict:
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--shapes", name, "--updates", str(args.updates)]
    cmd += ["--dtype", args.dtype] if args.dtype else []
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd + list(args.overrides), env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"shape {name} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["shapes"][0]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="0.89b-144,0.89b-2048", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--small", action="store_true", help="the CPU-sized shape only")
    p.add_argument("--updates", type=int, default=3, help="timed updates after the warm-up (median)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on CUDA, else fp32")
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*", help="trainer config key=value")
    args = p.parse_args(argv)
    if args.updates < 3:
        raise SystemExit(f"--updates: {args.updates} must be >= 3 (update_s is a median)")
    names = ["small"] if args.small else args.shapes.split(",")
    bad = [n for n in names if n not in SHAPES]
    if bad:
        raise SystemExit(f"--shapes: unknown {bad}; choose from {sorted(SHAPES)}")
    if len(names) > 1 and "RANK" not in os.environ:  # one process per shape (one parallel layout each)
        rows = [_in_subprocess(n, args) for n in names]
    else:
        rows = [measure(n, args.updates, args.dtype, args.overrides) for n in names]
    result = {"shapes": rows}
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
