"""One optimizer step on fixed gradients through `build_optimizer`, for comparing its two paths.

    python -m tests.gpu.optimizer_step --model-dir M --dtype bfloat16 --out step.pt
    CUDA_VISIBLE_DEVICES= python -m tests.gpu.optimizer_step ...     # forces the CPU path

With CUDA this is megatron's DistributedOptimizer (mixed precision, fp32 main weights);
without, CpuAdamW. Single process, TP=PP=DP=1. The gradients are drawn per parameter
name from a fixed seed and written into the DDP grad buffers (main_grad), so both paths
step on the same numbers. Writes {"before", "grads", "after"} (name -> CPU tensor),
"grad_norm" and "optimizer" (the class that stepped).
"""

import argparse
import zlib

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from remax_megatron.config import load_config
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.optimizer import build_optimizer, wrap_ddp
    from remax_megatron.parallel import ParallelLayout, init_distributed
    from remax_megatron.weights import load_hf_weights

    init_distributed()
    ParallelLayout(tp=1, pp=1, world_size=1).initialize(seed=0)
    dtype = DTYPES[args.dtype]
    cfg = load_config(
        None,
        [
            "reward.functions=[exact_match]",
            "optim.lr=1e-3",
            "optim.grad_clip=1.0",
            "optim.weight_decay=0.1",
            "optim.distributed_optimizer=true",
        ],
    )
    actor = build_policy(read_hf_config(args.model_dir), tp=1, pp=1, params_dtype=dtype, init_weights=False)
    load_hf_weights(actor, args.model_dir)
    ddp = wrap_ddp(actor, cfg.optim.distributed_optimizer)
    optimizer = build_optimizer(ddp, cfg.optim, dtype)
    optimizer.zero_grad()
    before, grads = {}, {}
    for name, param in ddp.module.named_parameters():
        before[name] = param.detach().cpu().clone()
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        grads[name] = torch.randn(param.shape, generator=g) * 0.01
        param.main_grad.copy_(grads[name].to(param.main_grad.device))
    ok, norm = optimizer.step()
    assert ok, f"the step was skipped (grad norm {norm})"
    after = {name: param.detach().cpu().clone() for name, param in ddp.module.named_parameters()}
    torch.save(
        {
            "before": before,
            "grads": grads,
            "after": after,
            "grad_norm": norm,
            "optimizer": type(optimizer).__name__,
            "cuda": torch.cuda.is_available(),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
