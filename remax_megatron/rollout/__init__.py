"""Rollout: engine protocol, native (transformers) and vLLM engines, bucketed weight sync,
prompt/response packing and the engine-vs-actor log-prob monitor (see engine.py)."""

from remax_megatron.rollout.engine import (
    Completion,
    PromptRollout,
    RolloutEngine,
    SamplingParams,
    stream_seed,
)
from remax_megatron.rollout.factory import ENGINES, build_engine, check_rollout, register_engine
from remax_megatron.rollout.monitor import LogprobMismatchWarning, logprob_mismatch
from remax_megatron.rollout.sequences import (
    PreparedPrompts,
    flatten_rollouts,
    left_pad,
    pack_sequences,
    prepare_prompts,
    tokenize_prompts,
)
from remax_megatron.rollout.weight_sync import WeightSync, sync_weights

__all__ = [
    "Completion",
    "LogprobMismatchWarning",
    "PreparedPrompts",
    "PromptRollout",
    "RolloutEngine",
    "SamplingParams",
    "WeightSync",
    "ENGINES",
    "build_engine",
    "check_rollout",
    "register_engine",
    "stream_seed",
    "flatten_rollouts",
    "left_pad",
    "logprob_mismatch",
    "pack_sequences",
    "prepare_prompts",
    "sync_weights",
    "tokenize_prompts",
]
