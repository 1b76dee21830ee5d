"""rollout.placement=separate: the torchrun world split into training ranks and rollout ranks.

    split = split_world(rollout_ranks=1, timeout_minutes=30)   # every rank of the torchrun world calls it
    split.role          # "train" (global ranks 0 .. W-K-1) or "rollout" (the last K ranks)
    split.bridge        # training rank 0 + the rollout ranks (bridge rank 0 = training rank 0); None elsewhere

Each side gets its own torch.distributed default group (world W-K or K), so megatron-core, its
checkpoints and every collective of the trainer see only the training ranks, and vLLM's external
launcher sees only the rollout ranks. RANK / WORLD_SIZE in the environment are set to the side's
values (what vLLM and the rank-0 printing read); LOCAL_RANK stays (the GPU of the process).

The bridge is a process group outside torch's registry (a ProcessGroupGloo / ProcessGroupNCCL on the
same rendezvous store): use its own methods (`bridge.broadcast(tensor, root).wait()`), never the
torch.distributed functions with group=bridge. The rendezvous store is the one torchrun's agent hosts
at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE), else global rank 0 hosts it, as torch's
env:// initialisation does.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from remax_megatron.parallel import cpu_compat
from remax_megatron.parallel.layout import check_rollout_tp


@dataclass(frozen=True)
class WorldSplit:
    role: str  # "train" | "rollout"
    global_rank: int
    global_world: int
    rollout_ranks: int  # K: the last K global ranks
    bridge: object | None  # c10d ProcessGroup over [training rank 0] + rollout ranks; None elsewhere

    @property
    def train_world(self) -> int:
        return self.global_world - self.rollout_ranks

    @property
    def side_rank(self) -> int:
        return self.global_rank - (self.train_world if self.role == "rollout" else 0)

    @property
    def bridge_rank(self) -> int:
        """This rank's rank in the bridge (0: training rank 0; 1..K: the rollout ranks)."""
        return 0 if self.role == "train" else 1 + self.side_rank


def check_split(world: int, rollout_ranks: int, rollout_tp: int) -> None:
    """One line naming every factor when the world cannot hold K rollout ranks beside the training ranks."""
    if rollout_ranks < 1 or rollout_ranks >= world:
        raise ValueError(
            f"rollout.ranks({rollout_ranks}) with rollout.placement=separate must be in [1, world({world})"
            f" - 1]: the rest, world({world}) - rollout.ranks, are the training ranks"
        )
    check_rollout_tp(rollout_tp, rollout_ranks, separate=True)


def split_world(rollout_ranks: int, timeout_minutes: int = 30) -> WorldSplit:
    """Collective over the torchrun world: each side's default process group and the bridge."""
    if dist.is_initialized():
        raise RuntimeError("split_world must run before any process group exists")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if "MASTER_ADDR" not in os.environ:
        raise ValueError(
            "rollout.placement=separate needs a launched world: run under torchrun (or "
            "python -m remax_megatron.launch) with --nproc_per_node >= 2"
        )
    train_world = world - rollout_ranks
    role = "rollout" if rank >= train_world else "train"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=None if agent_store else world,
        is_master=not agent_store and rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    backend = "nccl" if cpu_compat.cuda_present() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    side_rank = rank - train_world if role == "rollout" else rank
    side_world = rollout_ranks if role == "rollout" else train_world
    dist.init_process_group(
        backend, store=dist.PrefixStore(f"remax/{role}", store), rank=side_rank, world_size=side_world, timeout=timeout
    )
    bridge = None
    if role == "rollout" or rank == 0:
        bridge_rank = 0 if role == "train" else 1 + side_rank
        bridge_store = dist.PrefixStore("remax/bridge", store)
        if backend == "nccl":  # not run yet (needs 2 GPUs): tools/gpu_check.sh step separate
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            bridge = dist.ProcessGroupNCCL(bridge_store, bridge_rank, rollout_ranks + 1, options)
        else:
            bridge = dist.ProcessGroupGloo(bridge_store, bridge_rank, rollout_ranks + 1, timeout)
    os.environ.update(RANK=str(side_rank), WORLD_SIZE=str(side_world))
    return WorldSplit(role, rank, world, rollout_ranks, bridge)
