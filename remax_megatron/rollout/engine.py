"""The rollout-engine protocol: what the trainer calls, whichever engine is behind it.

    engine = build_engine(cfg.rollout, hf_dir=cfg.actor.model, arch=arch, seed=cfg.trainer.seed)
    stats = sync_weights(engine, export_hf_weights(actor), bucket_mb=cfg.rollout.sync_bucket_mb)
    results = engine.generate(prompt_token_ids, n=cfg.rollout.n, sampling=SamplingParams(...))
    engine.sleep()      # free engine memory for training; generate/sync wake it again

`generate` takes THIS rank's prompts and returns one `PromptRollout` per prompt,
in order: `n` sampled completions and one greedy completion, all decoded in ONE
engine request (`engine.num_requests` counts them).

Log-prob convention (`Completion.logprobs`, one float per generated token):
    sampled rows: log softmax(logits / temperature)[token], before top-k/top-p
                  truncation (vLLM: exact when top_k=0 and top_p=1; with
                  truncation vLLM reports the renormalised truncated distribution);
    greedy rows:  log softmax(logits)[token] (temperature 1; vLLM's convention).
The actor's log-probs of the sampled rows, `PolicyModel.token_logprobs(hidden,
labels, temperature=rollout.temperature)`, are comparable to the sampled rows'
engine log-probs (rollout/monitor.py); compare greedy rows at temperature 1.

Token ids of a completion include the token that ended it (EOS, or the token
that completed a stop string); `finish_reason` is "stop" for those, "length"
when max_new_tokens ran out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ENGINE_NAMES = ("native", "vllm")


@dataclass
class SamplingParams:
    """Sampling of the n sampled rows (the greedy row is always argmax)."""

    temperature: float = 1.0        # > 0; greedy rows ignore it
    top_p: float = 1.0              # nucleus mass in (0, 1]; 1: off
    top_k: int = 0                  # keep the k most likely tokens; 0: off
    max_new_tokens: int = 64        # per completion, >= 1
    stop: list[str] = field(default_factory=list)  # stop strings (EOS always stops)
    seed: int | None = None         # None: the engine's running stream; int: reproducible call

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"sampling temperature={self.temperature!r} must be > 0 "
                             "(the greedy row is argmax already)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p={self.top_p!r} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"sampling top_k={self.top_k!r} must be >= 0 (0: off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens={self.max_new_tokens!r} must be >= 1")
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"sampling stop={self.stop!r} must be non-empty strings")

    @classmethod
    def from_config(cls, rollout_cfg, seed: int | None = None) -> "SamplingParams":
        """The sampling of `RolloutConfig` (temperature, top_p, top_k, max_new_tokens, stop)."""
        return cls(temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
                   max_new_tokens=rollout_cfg.max_new_tokens, stop=list(rollout_cfg.stop), seed=seed)


@dataclass
class Completion:
    """One generated response."""

    token_ids: list[int]            # generated tokens, including the one that ended it
    logprobs: list[float]           # engine log-prob per token (module docstring convention)
    finish_reason: str              # "stop" (EOS / stop string) | "length"


@dataclass
class PromptRollout:
    """All completions of one prompt, from one request."""

    sampled: list[Completion]       # len n
    greedy: Completion


class RolloutEngine:
    """Base of the engines: the protocol plus the shared input checks.

    Subclasses implement `_generate`, `load_weights`, `sleep`, `wake_up` and may
    override `begin_weight_update` / `finish_weight_update` (weight_sync.py calls
    them around the buckets).
    """

    name = "base"
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")

    def __init__(self):
        self.num_requests = 0       # engine requests issued (one per generate call)
        self.asleep = False

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], n: int,
                 sampling: SamplingParams) -> list[PromptRollout]:
        """n sampled + 1 greedy completion per prompt of this rank, in one engine request."""
        check_generate_args(prompt_token_ids, n, sampling)
        self._check_weights()
        if self.asleep:
            self.wake_up()
        return self._generate([list(map(int, p)) for p in prompt_token_ids], n, sampling)

    def _generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[PromptRollout]:
        raise NotImplementedError

    def _check_weights(self) -> None:
        """Raise RuntimeError when the engine holds no synced weights (checked before waking up)."""

    # ---- weights -------------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        """Called once before the first bucket of a sync."""

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of full HF-named tensors (engine dtype/device) into the engine."""
        raise NotImplementedError

    def finish_weight_update(self) -> None:
        """Called once after the last bucket of a sync."""

    # ---- memory --------------------------------------------------------------------------
    def sleep(self) -> None:
        raise NotImplementedError

    def wake_up(self) -> None:
        raise NotImplementedError


def check_generate_args(prompt_token_ids, n: int, sampling) -> None:
    """One-line ValueErrors for the inputs of `generate`."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n={n!r} sampled responses per prompt must be an integer >= 0 "
                         "(rollout.n; 0 = greedy only, e.g. for eval)")
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling={sampling!r} must be a remax_megatron.rollout.SamplingParams")
    for i, prompt in enumerate(prompt_token_ids):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} has no tokens: drop empty prompts before generate")


def check_rollout_layout(cfg, arch, world_size: int) -> None:
    """rollout.engine / rollout.tp against the world and the model (one-line errors)."""
    if cfg.engine not in ENGINE_NAMES:
        raise ValueError(f"rollout.engine={cfg.engine!r} is not one of {', '.join(ENGINE_NAMES)}")
    if cfg.tp < 1:
        raise ValueError(f"rollout.tp={cfg.tp!r} must be >= 1")
    if cfg.engine == "native" and cfg.tp != 1:
        raise ValueError(f"rollout.tp={cfg.tp} needs rollout.engine=vllm: the native engine keeps one "
                         "full replica per rank; set rollout.tp=1")
    if world_size % cfg.tp:
        raise ValueError(f"rollout.tp={cfg.tp} does not divide the world size {world_size}: choose "
                         f"rollout.tp from the divisors of {world_size}")
    if arch is not None:
        for what, heads in (("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads)):
            if heads % cfg.tp:
                raise ValueError(f"rollout.tp={cfg.tp} does not divide {what}={heads}: choose rollout.tp "
                                 f"from the divisors of {heads}")


def world_size_and_rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def build_engine(cfg, *, hf_dir: str, arch=None, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device | None = None, replica: int | None = None) -> RolloutEngine:
    """The engine named by `cfg.engine` (a RolloutConfig), its weights still to be synced.

    hf_dir: the HF model directory (config.json and tokenizer; weights are not read).
    arch:   the ModelArch of hf_dir (read from it when None) for the layout checks.
    seed:   trainer.seed; every replica derives its own sampling stream from it.
    replica: the data-parallel replica this rank serves (native engine: ranks of one replica
            sample identically); default the global rank.
    dtype:  the engine's weight dtype (weight sync casts to it).
    """
    world, _ = world_size_and_rank()
    if arch is None and cfg.engine in ENGINE_NAMES:
        from remax_megatron.models import read_hf_config

        arch = read_hf_config(hf_dir)
    check_rollout_layout(cfg, arch, world)
    if cfg.engine == "native":
        from remax_megatron.rollout.native import NativeEngine

        return NativeEngine(hf_dir, seed=seed, dtype=dtype, device=device, replica=replica)
    from remax_megatron.rollout.vllm_engine import VllmEngine

    return VllmEngine(cfg, hf_dir=hf_dir, seed=seed, dtype=dtype)
