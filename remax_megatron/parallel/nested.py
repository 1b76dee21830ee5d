"""A second TP x PP layout inside each model-parallel group of the actor's layout (e.g. the reward model).

    layout.initialize()                      # the actor's layout: megatron's global groups
    rm = nested_groups(tp=1, pp=1)           # collective: every rank calls it, in the same order
    GPTModel(..., pg_collection=rm.collection)

All ranks of one actor model-parallel group (its tp x pp ranks) hold the same
prompts and rollouts, so a model whose tp x pp divides the actor's can run on
them without moving data: the group's ranks (sorted) are cut into
`replicas` = (actor tp*pp) / (tp*pp) consecutive blocks, each block one replica
of the nested model, tp-fastest inside it (ranks r, r+1 share a TP group when
tp=2). The replicas split the work; `outer` (the actor's model-parallel group)
collects the results. megatron-core >= 0.14 builds GPTModel, its layers and the
pipeline schedules on such explicit groups (`ProcessGroupCollection`).

When the layout equals the actor's, `collection` is None: the model uses
megatron's global groups, as it always did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass(frozen=True)
class NestedGroups:
    collection: ProcessGroupCollection | None  # tp, pp, mp, cp, embd, pos_embd, dp, dp_cp; None: megatron's global
    outer: dist.ProcessGroup    # the actor's model-parallel group: every rank in it holds the same data
    replica: int                # this rank's replica of the nested model within `outer`
    replicas: int               # nested replicas per `outer` group
    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def share(self, count: int) -> range:
        """The items (of `count`, the same list on every rank of `outer`) this rank's replica handles."""
        per = -(-count // self.replicas)
        return range(min(count, self.replica * per), min(count, (self.replica + 1) * per))


def check_nested(tp: int, pp: int, outer_tp: int, outer_pp: int, what: str = "reward", outer: str = "actor") -> None:
    """One-line error when a (tp, pp) layout cannot nest in the actor's model-parallel groups."""
    if (outer_tp * outer_pp) % (tp * pp):
        raise ValueError(f"{what}.tp({tp}) * {what}.pp({pp}) = {tp * pp} does not divide {outer}.tp({outer_tp}) * "
                         f"{outer}.pp({outer_pp}) = {outer_tp * outer_pp}: the {what} model runs inside each "
                         f"{outer} model-parallel group; choose {what}.tp * {what}.pp from the divisors of "
                         f"{outer_tp * outer_pp}")


def nested_groups(tp: int, pp: int) -> NestedGroups:
    """The groups of a (tp, pp) model nested in the current megatron layout (collective over the world)."""
    from megatron.core import parallel_state as ps

    outer = ps.get_model_parallel_group()
    outer_tp, outer_pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    check_nested(tp, pp, outer_tp, outer_pp)
    if (tp, pp) == (outer_tp, outer_pp):
        return NestedGroups(None, outer, 0, 1, ps.get_tensor_model_parallel_rank(),
                            ps.get_pipeline_model_parallel_rank(), tp, pp)
    from megatron.core.process_groups_config import ProcessGroupCollection

    size, world, me = tp * pp, dist.get_world_size(), dist.get_rank()
    every: list = [None] * world
    dist.all_gather_object(every, sorted(dist.get_process_group_ranks(outer)))
    blocks = sorted({tuple(ranks) for ranks in every})           # every actor model-parallel group
    replicas = [b[i : i + size] for b in blocks for i in range(0, len(b), size)]
    # Inside a replica: position k = pp_rank * tp + tp_rank (tp fastest).
    lists = {
        "tp": [r[p * tp : (p + 1) * tp] for r in replicas for p in range(pp)],
        "pp": [r[t::tp] for r in replicas for t in range(tp)],
        "mp": replicas,
        "dp": [tuple(r[k] for r in replicas) for k in range(size)],
        "cp": [(rank,) for rank in range(world)],
    }
    mine = {}
    for name, groups in lists.items():  # new_group is collective: same calls, same order, on every rank
        for ranks in groups:
            group = dist.new_group(list(ranks))
            if me in ranks:
                mine[name] = group
    collection = ProcessGroupCollection(tp=mine["tp"], pp=mine["pp"], mp=mine["mp"], cp=mine["cp"],
                                        dp=mine["dp"], dp_cp=mine["dp"], embd=None, pos_embd=None)
    block = next(b for b in blocks if me in b)
    position = block.index(me)
    k = position % size
    return NestedGroups(collection, outer, position // size, len(block) // size, k % tp, k // tp, tp, pp)
