"""A second TP x PP layout laid over the actor's (e.g. the reward model), on its own process groups.

    layout.initialize()                      # the actor's layout: megatron's global groups
    rm = nested_groups(tp=1, pp=1)           # collective: every rank calls it, in the same order
    GPTModel(..., pg_collection=rm.collection)

All ranks of one actor model-parallel group (its tp x pp ranks) hold the same
prompts and rollouts. The nested model works on `outer` groups of ranks:

- tp*pp divides the actor's tp*pp: `outer` is the actor's model-parallel group,
  cut into `replicas` = (actor tp*pp) / (tp*pp) nested replicas that split its
  items (no data moves in);
- the actor's tp*pp divides tp*pp (a larger model): `outer` joins
  `actor_replicas` = (tp*pp) / (actor tp*pp) actor model-parallel groups of
  neighbouring DP ranks (so dp must be a multiple of it); their items are
  gathered and scored by the one nested replica there.

Inside `outer` (ranks sorted) each consecutive block of tp*pp ranks is one
replica, tp-fastest (ranks r, r+1 share a TP group when tp=2). megatron-core
>= 0.14 builds GPTModel, its layers and the pipeline schedules on such explicit
groups (`ProcessGroupCollection`). When the layout equals the actor's,
`collection` is None: the model uses megatron's global groups, as it always did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from remax_megatron.sizes import ceil_div

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass(frozen=True)
class NestedGroups:
    collection: ProcessGroupCollection | None  # tp, pp, mp, cp, embd, pos_embd, dp, dp_cp; None: megatron's global
    outer: dist.ProcessGroup  # ranks that score together: one or more whole actor model-parallel groups
    replica: int  # this rank's replica of the nested model within `outer`
    replicas: int  # nested replicas per `outer` group
    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int
    actor_replica: int = 0  # which of the actor model-parallel groups in `outer` this rank belongs to
    actor_replicas: int = 1  # actor model-parallel groups per `outer` group (> 1: items are gathered)

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def share(self, count: int) -> range:
        """The items (of `count`, the same list on every rank of `outer`) this rank's replica handles."""
        per = ceil_div(count, self.replicas)
        return range(min(count, self.replica * per), min(count, (self.replica + 1) * per))


def check_nested(
    tp: int, pp: int, outer_tp: int, outer_pp: int, dp: int, what: str = "reward", outer: str = "actor"
) -> None:
    """One-line error when a (tp, pp) layout fits neither inside the actor's model-parallel groups nor over
    a whole number of them (dp is the actor's data-parallel size)."""
    size, outer_size = tp * pp, outer_tp * outer_pp
    if outer_size % size == 0 or (size % outer_size == 0 and dp % (size // outer_size) == 0):
        return
    raise ValueError(
        f"{what}.tp({tp}) * {what}.pp({pp}) = {size} neither divides {outer}.tp({outer_tp}) * "
        f"{outer}.pp({outer_pp}) = {outer_size} nor is a multiple of it that divides "
        f"{outer_size} * dp({dp}) = {outer_size * dp}: choose {what}.tp * {what}.pp from the divisors "
        f"of {outer_size}, or a multiple of {outer_size} that divides {outer_size * dp}"
    )


def nested_groups(tp: int, pp: int) -> NestedGroups:
    """The groups of a (tp, pp) model nested in the current megatron layout (collective over the world)."""
    from megatron.core import parallel_state as ps

    actor_mp = ps.get_model_parallel_group()
    outer_tp, outer_pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    check_nested(tp, pp, outer_tp, outer_pp, ps.get_data_parallel_world_size())
    if (tp, pp) == (outer_tp, outer_pp):
        return NestedGroups(
            None, actor_mp, 0, 1, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), tp, pp
        )
    from megatron.core.process_groups_config import ProcessGroupCollection

    size, world, me = tp * pp, dist.get_world_size(), dist.get_rank()
    every: list = [None] * world
    dist.all_gather_object(every, sorted(dist.get_process_group_ranks(actor_mp)))
    actor_blocks = sorted({tuple(ranks) for ranks in every})  # every actor model-parallel group
    join = max(1, size // len(actor_blocks[0]))  # actor groups per outer group
    blocks = [tuple(sorted(sum(actor_blocks[i : i + join], ()))) for i in range(0, len(actor_blocks), join)]
    replicas = [b[i : i + size] for b in blocks for i in range(0, len(b), size)]
    # Inside a replica: position k = pp_rank * tp + tp_rank (tp fastest).
    lists = {
        "tp": [r[p * tp : (p + 1) * tp] for r in replicas for p in range(pp)],
        "pp": [r[t::tp] for r in replicas for t in range(tp)],
        "mp": replicas,
        "dp": [tuple(r[k] for r in replicas) for k in range(size)],
        "cp": [(rank,) for rank in range(world)],
        "outer": blocks if join > 1 else [],  # join == 1: the actor's model-parallel groups themselves
    }
    mine = {}
    for name, groups in lists.items():  # new_group is collective: same calls, same order, on every rank
        for ranks in groups:
            group = dist.new_group(list(ranks))
            if me in ranks:
                mine[name] = group
    collection = ProcessGroupCollection(
        tp=mine["tp"],
        pp=mine["pp"],
        mp=mine["mp"],
        cp=mine["cp"],
        dp=mine["dp"],
        dp_cp=mine["dp"],
        embd=None,
        pos_embd=None,
    )
    block = next(b for b in blocks if me in b)
    position = block.index(me)
    k = position % size
    actor_replica = next(i for i, b in enumerate(actor_blocks) if me in b) % join
    return NestedGroups(
        collection,
        mine.get("outer", actor_mp),
        position // size,
        len(block) // size,
        k % tp,
        k // tp,
        tp,
        pp,
        actor_replica,
        join,
    )
