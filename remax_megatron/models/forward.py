"""Forward-only passes through megatron's pipeline schedule (any PP), e.g. for
reference log-probs, reward-model scores and parity checks."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from remax_megatron.models.gpt import check_sequence_length
from remax_megatron.parallel import cpu_compat
from remax_megatron.parallel.layout import comm_device


def run_schedule(model, step_fn: Callable, micro_batches: list[dict], *, forward_only: bool, wrapped=None) -> list:
    """megatron's pipeline schedule (any PP, on `model`'s own process groups) over micro-batches
    with [b, s] `input_ids` (the model's input rows); returns the loss functions' outputs (last stage;
    [] elsewhere). Micro-batches of several shapes (token budgets, packed rows) run with megatron's
    `variable_seq_lengths`: the stages send each activation's shape before it.

    step_fn(data_iterator, module) -> (output, loss_fn) is megatron's forward_step_func; `wrapped`:
    the module the schedule runs (the DDP wrapper when training), default `model`.
    """
    shapes = {tuple(mb["input_ids"].shape) for mb in micro_batches}
    for _, s in shapes:
        check_sequence_length(model, s)
    b, s = micro_batches[0]["input_ids"].shape
    config = model.config
    variable = config.variable_seq_lengths
    config.variable_seq_lengths = len(shapes) > 1
    try:
        return cpu_compat.forward_backward_func(pp_size=model.pp_group.size())(
            forward_step_func=step_fn,
            data_iterator=iter(micro_batches),
            model=[wrapped or model],
            num_microbatches=len(micro_batches),
            seq_length=s,
            micro_batch_size=b,
            forward_only=forward_only,
            **schedule_groups(model),
        )
    finally:
        config.variable_seq_lengths = variable


@torch.no_grad()
def forward_only(
    model,
    micro_batches: list[dict],
    head: Callable[[object, torch.Tensor, dict], object],
    inputs: Callable[[dict], tuple[torch.Tensor, dict]] | None = None,
) -> list:
    """Run micro-batches (dicts with `input_ids` [b, s]) through all stages.

    On the last stage `head(model, output [b, s, ...], batch)` turns the model output
    into what the caller wants (log-probs, scores, logits); returns the list of those
    on the last stage and [] on the other stages. `inputs(batch)` -> (input_ids, keyword
    arguments of the model's forward), e.g. packed rows' attention boundaries (default:
    `input_ids`, causal attention).
    """
    if not micro_batches:
        return []
    results: list = []

    def step(data_iterator, module):
        batch = to_model_device(next(data_iterator), model)

        def collect(output):
            results.append(head(model, output, batch))
            return torch.zeros((), device=output.device), {}

        input_ids, kwargs = inputs(batch) if inputs is not None else (batch["input_ids"], {})
        return module.run(input_ids, **kwargs), collect

    run_schedule(model, step, micro_batches, forward_only=True)
    return results


def schedule_groups(model) -> dict:
    """The schedule's process groups: those the model was built on (megatron's global ones or its own layout)."""
    return dict(
        p2p_communicator=P2PCommunicator(pp_group=model.pp_group, config=model.config),
        pg_collection=model.pg_collection,
    )


def to_model_device(batch: dict, model) -> dict:
    """The micro-batch's tensors on the model's device (batches are assembled on the CPU)."""
    device = next(model.parameters()).device
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def broadcast_from_last_stage(tensor: torch.Tensor | None, shape, dtype, device="cpu") -> torch.Tensor:
    """Give every pipeline stage the last stage's `tensor` (others pass None and get it on `device`)."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    group = ps.get_pipeline_model_parallel_group()
    on_wire = comm_device(group)  # NCCL: through the GPU, whatever device the caller uses
    buffer = torch.empty(shape, dtype=dtype, device=on_wire) if tensor is None else tensor.contiguous().to(on_wire)
    dist.broadcast(buffer, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
    return tensor if tensor is not None else buffer.to(device)
