"""Rollout: engine protocol, native (transformers) and vLLM engines, bucketed weight sync,
prompt padding for decoding and the engine-vs-actor log-prob monitor (see engine.py). The training
batch the rollouts become is remax_megatron.batching's."""

from remax_megatron.rollout.engine import Completion, PromptRollout, RolloutEngine, SamplingParams, stream_seed
from remax_megatron.rollout.factory import ENGINES, build_engine, check_rollout, register_engine
from remax_megatron.rollout.monitor import LogprobMismatchWarning, logprob_mismatch
from remax_megatron.rollout.sequences import flatten_rollouts, left_pad
from remax_megatron.rollout.weight_sync import WeightSync, sync_weights

__all__ = [
    "Completion",
    "LogprobMismatchWarning",
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
    "sync_weights",
]
