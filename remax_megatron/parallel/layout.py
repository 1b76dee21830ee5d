"""The parallel layout (TP x PP x DP, and EP x ETP for MoE experts) and process-group set-up under torchrun.

    layout = ParallelLayout(tp=2, pp=2, world_size=8)   # dp = 2, validated
    layout = ParallelLayout(tp=1, pp=1, world_size=2, ep=2)   # MoE: experts split over 2 ranks
    init_distributed(timeout_minutes=30)                 # NCCL with CUDA, gloo without
    groups = layout.initialize()                         # megatron parallel_state

Megatron orders ranks tp-fastest: with tp=2, pp=2, dp=2 ranks 0,1 form one TP
group, ranks {0,2} hold the two pipeline stages of one replica, etc. Experts are
laid out over the same ranks as etp x ep x edp x pp (megatron carves EP x ETP
from each stage's TP x DP ranks), so an expert-parallel group may span data-
parallel replicas.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from remax_megatron.parallel import cpu_compat


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    world_size: int
    ep: int = 1  # expert parallel (MoE)
    etp: int = 0  # expert tensor parallel; 0: tp (megatron's default)

    def __post_init__(self):
        for name in ("tp", "pp", "world_size", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not isinstance(self.etp, int) or self.etp < 0:
            raise ValueError(f"etp={self.etp!r} must be a positive integer (0: the tp size)")
        if self.world_size % (self.tp * self.pp) != 0:
            raise ValueError(
                f"tp({self.tp}) * pp({self.pp}) = {self.tp * self.pp} does not divide "
                f"world({self.world_size}): choose tp*pp from the divisors of {self.world_size} "
                f"or launch a multiple of {self.tp * self.pp} processes"
            )
        ep, etp, ranks = self.ep, self.expert_tp, self.tp * self.dp
        if etp not in (1, self.tp):
            raise ValueError(
                f"etp({etp}) with tp({self.tp}): expert tensor parallel must be 1 (whole experts) or equal to tp"
            )
        if ranks % (ep * etp):
            raise ValueError(
                f"ep({ep}) * etp({etp}) = {ep * etp} does not divide tp({self.tp}) * dp({self.dp}) = "
                f"{ranks}, the ranks of a pipeline stage megatron carves the experts from: choose "
                f"ep * etp from the divisors of {ranks}"
            )
        if ep == 1 and etp < self.tp:
            raise ValueError(
                f"etp({etp}) < tp({self.tp}) with ep(1): experts whole on every TP rank need ep > 1 "
                "(megatron only sums expert gradients over TP through expert parallelism): set "
                f"etp={self.tp} or ep > 1"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @staticmethod
    def smallest_world(tp: int, pp: int, ep: int = 1, etp: int = 0) -> int:
        """The fewest processes that hold this layout: tp * pp * dp with ep * etp dividing tp * dp."""
        experts = ep * (etp or tp)
        return tp * pp * (experts // math.gcd(experts, tp))

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    def __str__(self) -> str:
        moe = f", ep({self.ep}) * etp({self.expert_tp})" if self.ep > 1 or self.expert_tp != self.tp else ""
        return f"tp({self.tp}) * pp({self.pp}) * dp({self.dp}) = world({self.world_size}){moe}"

    def initialize(self, seed: int = 0, timeout_minutes: int = 30) -> ProcessGroups:
        """Initialise megatron's parallel_state and RNG trackers for this layout; return the groups."""
        from megatron.core import parallel_state

        if not dist.is_initialized():
            raise RuntimeError("call init_distributed() before ParallelLayout.initialize()")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"layout {self} but torch.distributed has world {dist.get_world_size()}")
        cpu_compat.install()
        cpu_compat.install_moe()
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.expert_tp,
            distributed_timeout_minutes=timeout_minutes,
            create_gloo_process_groups=cpu_compat.cuda_present(),
        )
        cpu_compat.model_parallel_seed(seed)
        return ProcessGroups.current()


@dataclass(frozen=True)
class ProcessGroups:
    """The groups and ranks code that communicates is handed explicitly."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    mp: dist.ProcessGroup  # model-parallel: the tp x pp ranks of one replica
    embedding: dist.ProcessGroup | None
    tp_rank: int
    pp_rank: int
    dp_rank: int
    mp_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    # MoE experts: expert-parallel group (this stage's ranks holding the other experts; may span DP
    # replicas) and the group an expert gradient's norm is summed over (etp x ep x pp)
    ep: dist.ProcessGroup | None = None
    expert_mp: dist.ProcessGroup | None = None
    ep_rank: int = 0
    ep_size: int = 1
    etp_size: int = 1

    @property
    def mp_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def current(cls) -> ProcessGroups:
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_group(),
            pp=ps.get_pipeline_model_parallel_group(),
            dp=ps.get_data_parallel_group(),
            mp=ps.get_model_parallel_group(),
            embedding=ps.get_embedding_group(check_initialized=False),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            mp_rank=dist.get_rank(group=ps.get_model_parallel_group()),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_size=ps.get_data_parallel_world_size(),
            ep=ps.get_expert_model_parallel_group(),
            expert_mp=ps.get_expert_tensor_model_pipeline_parallel_group(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
        )


def check_rollout_tp(tp: int, ranks: int, separate: bool = False) -> None:
    """rollout.tp divides the ranks that run engines (one engine per rollout.tp consecutive ranks): the world,
    or rollout.ranks with rollout.placement=separate (`separate`). One line naming both."""
    if ranks % tp == 0:
        return
    if separate:
        raise ValueError(
            f"rollout.tp({tp}) does not divide rollout.ranks({ranks}): the rollout ranks run "
            f"rollout.ranks / rollout.tp engines; choose rollout.tp from the divisors of {ranks}"
        )
    raise ValueError(
        f"rollout.tp={tp} does not divide the world size {ranks}: choose rollout.tp from the divisors of {ranks}"
    )


def init_distributed(timeout_minutes: int = 30) -> tuple[int, int]:
    """Init torch.distributed from torchrun's environment; (rank, world_size).

    Without torchrun (no RANK/WORLD_SIZE) this is a single-process world, so
    `python -m remax_megatron.train` and the converters run as plain scripts.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "MASTER_ADDR" not in os.environ:
        if world != 1:
            raise ValueError(
                f"WORLD_SIZE={world} but MASTER_ADDR is not set: launch with torchrun "
                "(it sets the rendezvous) or export MASTER_ADDR and MASTER_PORT"
            )
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if cpu_compat.cuda_present() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=timeout_minutes)
        )
    except dist.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        raise ValueError(port_in_use(os.environ["MASTER_PORT"])) from None
    return rank, world


def port_in_use(port: str) -> str:
    """The one line for a rendezvous port another process already listens on (the launcher's too)."""
    return (
        f"MASTER_PORT {port} is already in use on this host (EADDRINUSE): another job listens there; "
        "give this one a free port (torchrun / remax_megatron.launch --master_port=N, or MASTER_PORT=N)"
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def comm_device(group=None) -> torch.device:
    """Where a tensor must live for a collective on `group`: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_cpu(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """all_reduce of a small CPU tensor (metrics, flags) on any backend; returns a new CPU tensor.

    NCCL only reduces GPU tensors, so the tensor travels through the current GPU there.
    """
    out = tensor.to(comm_device(group), copy=True)
    dist.all_reduce(out, op=op, group=group)
    return out.cpu()


class SumGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over `group` (an input every rank of the group
    holds whole). `SumGrad.apply(x, group)`. megatron-core 0.16.1's copy_to_tensor_model_parallel_region would
    do it, but its _reduce all-reduces `grad.contiguous()` and returns `grad`: a non-contiguous gradient (a
    slice of torch.cat's) comes back unreduced, silently."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
