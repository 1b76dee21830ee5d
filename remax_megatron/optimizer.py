"""The actor's optimizer behind one interface: megatron's on GPU, a small AdamW path on CPU.

    ddp_model = wrap_ddp(actor, use_distributed_optimizer)   # megatron DDP (grad buffers, DP reduce)
    opt = build_optimizer(ddp_model, cfg.optim, total_updates)
    attach_to_schedule(ddp_model, opt)   # what megatron's schedule calls: grad finalisation, loss scaling, no_sync
    ok, grad_norm = opt.step()      # skips (ok=False) when the grad norm is not finite
    opt.zero_grad()

GPU: megatron-core's `get_megatron_optimizer` (DistributedOptimizer when
`optim.distributed_optimizer`), mixed precision with fp32 main weights.
CPU: megatron's optimizers assert CUDA tensors (PITFALLS.md), so `CpuAdamW`
runs torch AdamW over the DDP-reduced main grads, with megatron's rule for the
global grad norm (TP-duplicate and PP-shared parameters counted once).
Both use megatron's OptimizerParamScheduler (warmup, then constant/linear/cosine).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from remax_megatron.parallel import ProcessGroups


def wrap_ddp(model, use_distributed_optimizer: bool):
    """megatron DistributedDataParallel: grads in fp32 buffers, summed over DP (loss is globally normalised)."""
    model.config.calculate_per_token_loss = True  # DDP sums over DP; the loss carries the global 1/N
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=torch.cuda.is_available(),
        use_distributed_optimizer=use_distributed_optimizer and torch.cuda.is_available(),
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def finalize_grads(model_chunks, num_tokens=None, **kwargs):  # noqa: ARG001 - the schedule passes num_tokens
    """megatron's finalize_model_grads without its 1/num_tokens scaling (our loss already has it)."""
    return finalize_model_grads(model_chunks, None, **{k: v for k, v in kwargs.items() if k == "pg_collection"})


def attach_to_schedule(ddp_model, optimizer) -> None:
    """Set what megatron's forward-backward schedule reads from the model config: grad finalisation
    (the DP / TP / PP reductions, finalize_grads), the loss scaling of `optimizer` (fp16 on GPU) and
    DDP's no_sync (one grad reduction per step, not per micro-batch)."""
    config = ddp_model.module.config
    config.finalize_model_grads_func = finalize_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp_model.no_sync


def fp64_norm(grad: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """The 2-norm of `grad` accumulated in fp64, chunk by chunk: torch's fp64 `vector_norm` of an fp32
    tensor first converts all of it (a 128 MiB temporary for a 16M-entry vocab grad, page-faulted
    afresh in a training process: the 60M bench's grad norm took 0.09-0.28 s, 0.07-0.10 s in chunks)."""
    flat = grad.reshape(-1)
    if flat.numel() <= chunk:
        return torch.linalg.vector_norm(flat, dtype=torch.float64)
    parts = torch.stack([torch.linalg.vector_norm(c, dtype=torch.float64) for c in flat.split(chunk)])
    return torch.linalg.vector_norm(parts)


# fused: one pass per parameter, no temporaries. foreach allocated a temporary per moment (64 MiB for a
# vocab-sized one, page-faulted afresh each step): 0.19-0.35 s against 0.04-0.07 s an optimizer step on
# the 60M benchmark model. It rounds differently from the per-parameter loop, within fp32 rounding
# (tests/train/test_optimizer_paths.py holds it to an fp64 AdamW step).
ADAMW_IMPL = {"fused": True, "foreach": None}


class CpuAdamW:
    """torch AdamW over megatron DDP main grads, with megatron's global grad-norm clipping and
    megatron's parameter groups (weight decay skips biases and norm weights).

    Parameters in bf16/fp16 get fp32 main weights, as megatron's mixed-precision optimizers
    keep on GPU: Adam steps the fp32 copy, the model gets it rounded. fp32 parameters are
    their own main weights.
    """

    def __init__(self, ddp_model, cfg, process_groups: ProcessGroups | None = None):
        self.ddp_model, self.clip = ddp_model, cfg.grad_clip
        # megatron's groups: no weight decay on biases and 1-D parameters (norm weights).
        named = [(n, p) for n, p in ddp_model.module.named_parameters() if p.requires_grad]
        no_decay = [p for n, p in named if p.dim() == 1 or n.endswith(".bias")]
        decay = [p for n, p in named if not (p.dim() == 1 or n.endswith(".bias"))]
        self.params = decay + no_decay  # optimizer order: state index i is self.params[i]
        self.main_params = [p if p.dtype == torch.float32 else p.detach().float() for p in self.params]
        groups = [
            {"params": self.main_params[: len(decay)], "wd_mult": 1.0},
            {"params": self.main_params[len(decay) :], "wd_mult": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            **ADAMW_IMPL,
        )
        for group in self.optimizer.param_groups:
            group["weight_decay"] = cfg.weight_decay * group["wd_mult"]
        groups = process_groups or ProcessGroups.current()
        # The grad norm's groups: dense parameters are summed over the model-parallel ranks, MoE experts split
        # over expert parallelism (megatron marks them allreduce=False) over etp x ep x pp, as megatron does.
        self.model_parallel_group = groups.mp
        self.expert_group = groups.expert_mp if any(not getattr(p, "allreduce", True) for p in self.params) else None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @torch.no_grad()
    def grad_norm(self) -> float:
        # fp64 accumulation (an fp32 sum would be off by ~4e-4 relative on 16M-element vocab grads).
        counted = [
            p
            for p in self.params
            if p.main_grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
        ]
        total = torch.zeros((), dtype=torch.float64)
        parts = [(self.model_parallel_group, [p for p in counted if getattr(p, "allreduce", True)])]
        if self.expert_group is not None:  # every rank holds experts (E / ep of them) or none does
            parts.append((self.expert_group, [p for p in counted if not getattr(p, "allreduce", True)]))
        for group, params in parts:
            part = (
                torch.stack([fp64_norm(p.main_grad) for p in params]).square().sum()
                if params
                else torch.zeros((), dtype=torch.float64)
            )
            dist.all_reduce(part, group=group)
            total += part
        return math.sqrt(total.item()) if math.isfinite(total.item()) else float("nan")

    @torch.no_grad()
    def step(self) -> tuple[bool, float]:
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return False, norm
        scale = min(1.0, self.clip / (norm + 1e-6)) if self.clip > 0 else 1.0
        grads = [p.main_grad if p.main_grad.dtype == torch.float32 else p.main_grad.float() for p in self.params]
        for main, grad in zip(self.main_params, grads):
            main.grad = grad.mul_(scale) if scale < 1.0 else grad  # in place: DDP zeroes its buffers after the step
        self.optimizer.step()
        for p, main in zip(self.params, self.main_params):
            if main is not p:
                p.copy_(main)
        return True, norm

    def zero_grad(self) -> None:
        self.ddp_model.zero_grad_buffer()
        for p, main in zip(self.params, self.main_params):
            p.grad = main.grad = None

    @staticmethod
    def scale_loss(loss: torch.Tensor) -> torch.Tensor:
        return loss  # no fp16 loss scaling on the CPU path

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the optimizer's own state (fp32 main weights of low-precision params,
        Adam moments): what an offload must keep."""
        masters = [m for p, m in zip(self.params, self.main_params) if m is not p]
        return masters + [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False) -> dict:
        """Adam moments (and fp32 main weights) as ShardedTensors laid out like their parameters:
        reshardable across TP/PP."""
        for main in self.main_params:
            # torch creates Adam state lazily; zeros at step 0 behave exactly like no state yet.
            if is_loading or not self.optimizer.state[main]:
                self.optimizer.state[main] = {
                    "step": torch.zeros(()),
                    "exp_avg": torch.zeros_like(main),
                    "exp_avg_sq": torch.zeros_like(main),
                }
        state = self.optimizer.state_dict()
        state["state"] = {i: dict(s) for i, s in state["state"].items()}  # torch's are the live dicts
        steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
        assert len(steps) <= 1, "Adam steps differ between parameters"
        for i, (p, main) in enumerate(zip(self.params, self.main_params)):
            if main is not p:
                state["state"][i]["fp32_param"] = main
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, iter(self.params))
        optim_state_to_sharding_state(state, id_map, exclude_keys="step")
        state["state"]["common_step"] = steps.pop() if steps else 0.0
        return state

    def load_sharded_state_dict(self, state: dict) -> None:
        step = state["state"].pop("common_step")
        masters = {i: s.pop("fp32_param") for i, s in state["state"].items() if "fp32_param" in s}
        for param_state in state["state"].values():
            param_state["step"] = torch.tensor(float(step))
        self.optimizer.load_state_dict(state)
        for group in self.optimizer.param_groups:  # torch restores the saved groups' implementation too
            group.update(ADAMW_IMPL)
        with torch.no_grad():
            for i, master in masters.items():
                self.main_params[i].copy_(master)


class MegatronOptimizer:
    """megatron-core's optimizer (GPU), with the same step()/zero_grad() as CpuAdamW."""

    def __init__(self, ddp_model, cfg, params_dtype: torch.dtype):
        config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.beta1,
            adam_beta2=cfg.beta2,
            adam_eps=cfg.eps,
            clip_grad=cfg.grad_clip,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            params_dtype=params_dtype,
            use_distributed_optimizer=cfg.distributed_optimizer,
        )
        self.ddp_model, self.clip = ddp_model, cfg.grad_clip
        self.optimizer = get_megatron_optimizer(config, [ddp_model])
        # megatron's groups carry wd_mult (0 for biases and norms) but no weight_decay, so the torch
        # Adam inside would decay every group at its default until the scheduler's first step.
        for group in self.optimizer.param_groups:
            group["weight_decay"] = cfg.weight_decay * group.get("wd_mult", 1.0)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self) -> tuple[bool, float]:
        if self.optimizer.prepare_grads():  # fp16 loss scaling found inf/nan
            return False, float("nan")
        norm = float(self.optimizer.get_grad_norm())
        if not math.isfinite(norm):
            return False, norm
        if self.clip > 0:
            self.optimizer.clip_grad_norm(self.clip)
        self.optimizer.step_with_ready_grads()
        return True, norm

    def zero_grad(self) -> None:
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times megatron's loss scale (dynamic for fp16, 1 for bf16/fp32): the schedule's
        grad_scale_func. Without it fp16 grads would be unscaled by a scale never applied."""
        return self.optimizer.scale_loss(loss)

    def state_tensors(self) -> list[torch.Tensor]:
        """fp32 main weights (shards under the DistributedOptimizer) and Adam moments of every
        underlying torch/TE/Apex optimizer: what an offload must keep."""
        out = []
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", None)
            if inner is None:  # a stub for a rank without trainable parameters
                continue
            out += [p for group in inner.param_groups for p in group["params"]]
            out += [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]
        return out

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False) -> dict:
        # Fully reshardable: a run saved at one TP/PP/DP layout resumes at another.
        return self.optimizer.sharded_state_dict(
            model_sharded_state_dict,
            is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "fully_reshardable"},
        )

    def load_sharded_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def build_optimizer(ddp_model, cfg, params_dtype: torch.dtype = torch.float32, groups: ProcessGroups | None = None):
    """MegatronOptimizer with CUDA, CpuAdamW without (groups: the model's; default the current layout's)."""
    if torch.cuda.is_available():
        return MegatronOptimizer(ddp_model, cfg, params_dtype)
    return CpuAdamW(ddp_model, cfg, groups)


def build_scheduler(optimizer, cfg, total_updates: int):
    """megatron's OptimizerParamScheduler: linear warmup, then constant / linear / cosine to min_lr.

    At resume its load_state_dict takes only the update count from the checkpoint: the schedule is
    this config's (megatron's default, use_checkpoint_opt_param_scheduler, would keep the checkpoint's
    learning rate and decay length, so a longer resumed run trained at the old schedule's end: lr 0)."""
    warmup = min(cfg.warmup_steps, max(0, total_updates - 1))
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr if cfg.schedule != "constant" else cfg.lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total_updates, warmup + 1),
        lr_decay_style=cfg.schedule,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=max(total_updates, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


# The scheduler's state that the config decides, with the config keys that set it.
SCHEDULE_KEYS = {
    "max_lr": "optim.lr",
    "min_lr": "optim.min_lr",
    "lr_decay_style": "optim.schedule",
    "lr_warmup_steps": "optim.warmup_steps",
    "lr_decay_steps": "trainer.steps * trainer.mini_batches",
    "start_wd": "optim.weight_decay",
}


def restore_config_hyperparameters(optimizer, cfg) -> list[str]:
    """Loading a checkpoint's optimizer state restores its param groups' Adam betas and eps (torch's
    load_state_dict): set this config's again; returns what changed, as schedule_changes does."""
    want = {"betas": ((cfg.beta1, cfg.beta2), "optim.beta1, optim.beta2"), "eps": (cfg.eps, "optim.eps")}
    changes = {}
    for group in optimizer.param_groups:
        for name, (value, key) in want.items():
            saved = tuple(group[name]) if isinstance(group.get(name), (list, tuple)) else group.get(name)
            if name in group and saved != value:
                changes[key] = f"{key} {value} (checkpoint: {saved})"
                group[name] = value
    return list(changes.values())


def schedule_changes(saved: dict, scheduler) -> list[str]:
    """What this run's schedule changes from a checkpoint's (`saved`: its scheduler state_dict), e.g.
    'optim.lr 0.001 (checkpoint: 0.0005)'; [] when they agree."""
    now = scheduler.state_dict()
    constant = now["lr_decay_style"] == saved.get("lr_decay_style") == "constant"  # its length changes nothing
    return [
        f"{key} {now[name]} (checkpoint: {saved[name]})"
        for name, key in SCHEDULE_KEYS.items()
        if name in saved and saved[name] != now[name] and not (constant and name == "lr_decay_steps")
    ]
