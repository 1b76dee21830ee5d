"""Training batching: a step's rollouts -> the rows and micro-batches the actor trains on.

Two words, two things: *pad* (padding.py) lays each (prompt, completion) out as one right-padded row
with its labels and masks; *pack* (micro_batches.py, trainer.pack_sequences) puts several sequences in
one row under a token budget, and plans the micro-batches and the DP balance.
"""

from remax_megatron.batching.micro_batches import (
    MicroBatch,
    assemble,
    exchange_rows,
    fixed_micro_batches,
    model_inputs,
    model_labels,
    plan_step,
    take_rows,
    to_rows,
    to_sequences,
)
from remax_megatron.batching.padding import pad_routes, pad_sequences, rollout_batch
from remax_megatron.sizes import round_up

__all__ = [
    "MicroBatch",
    "assemble",
    "exchange_rows",
    "fixed_micro_batches",
    "model_inputs",
    "model_labels",
    "pad_routes",
    "pad_sequences",
    "plan_step",
    "rollout_batch",
    "round_up",
    "take_rows",
    "to_rows",
    "to_sequences",
]
