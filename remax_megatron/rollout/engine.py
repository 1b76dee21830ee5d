"""The rollout-engine protocol: what the trainer calls, whichever engine is behind it.

    engine = build_engine(cfg.rollout, hf_dir=..., arch=arch, seed=cfg.trainer.seed)   # rollout/factory.py
    stats = sync_weights(engine, export_hf_weights(actor), bucket_mb=cfg.rollout.sync_bucket_mb)
    results = engine.generate(prompt_token_ids, n=cfg.rollout.n, sampling=SamplingParams(...),
                              seeds=[stream_seed(cfg.trainer.seed, step, i) for i in prompt_indices])
    engine.sleep()      # free engine memory for training; generate/sync wake it again

This module is the protocol only: it imports no engine. `generate` takes THIS
rank's prompts and returns one `PromptRollout` per prompt, in order: `n`
sampled completions and one greedy completion, all decoded in ONE engine
request (`engine.num_requests` counts them; `engine.decoded_tokens` counts the
tokens the engine decoded for them).

Seeds: `seeds[p]` fixes prompt p's sampling stream; its sample j draws from
stream `seeds[p] + j` (vLLM's convention for the children of an n > 1
request). The trainer derives `seeds[p]` from (trainer.seed, step, the
prompt's index in the step's global batch) with `stream_seed`, so every prompt,
sample and step has its own stream whichever rank or engine decodes it: the
samples do not depend on the layout.

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

Multi-turn rollouts (rollout/agent.py) continue trajectories with `generate_rows`: one completion per
context (the trajectory's exact token ids so far), greedy where asked, else sampled from the row's own
stream; every row of a turn in ONE engine request, as `generate` does for the first turn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def stream_seed(*keys: int) -> int:
    """A 31-bit seed for the stream named by `keys` (e.g. trainer seed, step, prompt index).

    Hashed, so nearby keys give unrelated streams, and `stream_seed(...) + j` for the
    j-th sample of a prompt does not collide with another prompt's stream in practice.
    The one seed derivation of the trainer and the engines.
    """
    digest = hashlib.sha256("/".join(str(int(k)) for k in keys).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x3FFFFFFF  # leaves room for + j below 2**31


@dataclass
class SamplingParams:
    """Sampling of the n sampled rows (the greedy row is always argmax)."""

    temperature: float = 1.0  # > 0; greedy rows ignore it
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1: off
    top_k: int = 0  # keep the k most likely tokens; 0: off
    max_new_tokens: int = 64  # per completion, >= 1
    stop: list[str] = field(default_factory=list)  # stop strings (EOS always stops)
    stop_token_ids: list[int] = field(default_factory=list)  # token ids that end a completion, as EOS does
    seed: int | None = None  # without per-prompt seeds: base of this call's streams (None: the engine's)
    guided_regex: str = ""  # guided decoding, sampled and greedy rows alike: a regex every response matches
    guided_json: str = ""  # ... or a JSON schema (JSON text) every response's JSON matches

    @property
    def guided(self) -> dict | None:
        """The decoding constraint as vLLM's StructuredOutputsParams fields, or None."""
        if self.guided_regex:
            return {"regex": self.guided_regex}
        if self.guided_json:
            return {"json": self.guided_json}
        return None

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(
                f"sampling temperature={self.temperature!r} must be > 0 (the greedy row is argmax already)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p={self.top_p!r} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"sampling top_k={self.top_k!r} must be >= 0 (0: off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens={self.max_new_tokens!r} must be >= 1")
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"sampling stop={self.stop!r} must be non-empty strings")
        if self.guided_regex and self.guided_json:
            raise ValueError("sampling guided_regex and guided_json are both set: give one constraint")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"sampling stop_token_ids={self.stop_token_ids!r} must be token ids >= 0")

    @classmethod
    def from_config(cls, rollout_cfg, seed: int | None = None) -> SamplingParams:
        """The sampling of `RolloutConfig` (temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids,
        guided decoding)."""
        return cls(
            temperature=rollout_cfg.temperature,
            top_p=rollout_cfg.top_p,
            top_k=rollout_cfg.top_k,
            max_new_tokens=rollout_cfg.max_new_tokens,
            stop=list(rollout_cfg.stop),
            stop_token_ids=list(rollout_cfg.stop_token_ids),
            seed=seed,
            guided_regex=rollout_cfg.guided_regex,
            guided_json=rollout_cfg.guided_json,
        )


@dataclass
class Completion:
    """One generated response."""

    token_ids: list[int]  # generated tokens, including the one that ended it
    logprobs: list[float]  # engine log-prob per token (module docstring convention)
    finish_reason: str  # "stop" (EOS / stop string) | "length"
    # MoE with rollout.routing_replay: the experts the engine routed each input token of prompt + response to,
    # int [tokens, layers, top_k] (vLLM's CompletionOutput.routed_experts); None otherwise
    routed_experts: object = None
    # 1 where the token was generated, 0 where it was not (a multi-turn trajectory's observations and chat
    # template glue, rollout/agent.py): only generated tokens are trained. None: every token was generated.
    loss_mask: list[int] | None = None


@dataclass
class PromptRollout:
    """All completions of one prompt, from one request."""

    sampled: list[Completion]  # len n
    greedy: Completion
    # the context the completions continue when it is not the prompt's own token ids (an environment's
    # reset() message, rollout/agent.py); None: the prompt's
    prompt_ids: list[int] | None = None


class RolloutEngine:
    """Base of the engines: the protocol plus the shared input checks.

    Subclasses implement `_generate`, `update_weights`, `sleep` and `wake_up` (and `shutdown` when
    they hold resources beyond the process's life: threads, process groups).
    An engine class may define `check_config(cfg, arch, world_size)` (a staticmethod
    raising one-line ValueErrors) that the factory runs before any work.
    """

    name = "base"
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    group_size = 1  # ranks that run one engine together (vLLM: rollout.tp)

    def __init__(self, seed: int = 0):
        self.seed = int(seed)  # trainer.seed: the base of streams when generate gets no seeds
        self.rank = world_size_and_rank()[1]
        self.num_requests = 0  # engine requests issued (one per generate call)
        self.decoded_tokens = 0  # completion tokens this engine decoded (all ranks of a TP engine count them)
        self.asleep = False

    # ---- generation ----------------------------------------------------------------------
    def generate(
        self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams, seeds: list[int] | None = None
    ) -> list[PromptRollout]:
        """n sampled + 1 greedy completion per prompt of this rank, in one engine request.

        seeds: one per prompt (module docstring); None: derived from `sampling.seed` (or the
        engine's own seed and call count), this rank and the prompt's position.
        """
        check_generate_args(prompt_token_ids, n, sampling)
        if seeds is None:
            base = (self.seed, self.num_requests) if sampling.seed is None else (sampling.seed,)
            seeds = [stream_seed(*base, self.rank, p) for p in range(len(prompt_token_ids))]
        elif len(seeds) != len(prompt_token_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_token_ids)} prompts: give one seed per prompt")
        self._check_weights()
        if self.asleep:
            self.wake_up()
        rollouts = self._generate([list(map(int, p)) for p in prompt_token_ids], n, sampling, [int(s) for s in seeds])
        self.num_requests += 1
        return rollouts

    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams, seeds: list[int]
    ) -> list[PromptRollout]:
        raise NotImplementedError

    def generate_rows(
        self,
        contexts: list[list[int]],
        greedy: list[bool],
        sampling: SamplingParams,
        seeds: list[int],
        max_new_tokens: list[int] | None = None,
    ) -> list[Completion]:
        """One completion per context, all in one engine request: argmax where greedy[i], else sampled from
        stream seeds[i] (sampling's temperature, top-k, top-p, stops). max_new_tokens: a per-row limit (at
        most sampling.max_new_tokens; default that). Every rank of an engine that decodes in lockstep (a
        rollout.tp vLLM engine, the remote engine's training ranks) calls it, with no rows too."""
        limits = [sampling.max_new_tokens] * len(contexts) if max_new_tokens is None else list(max_new_tokens)
        check_generate_args(contexts, 0, sampling)
        if not len(greedy) == len(seeds) == len(limits) == len(contexts):
            raise ValueError(
                f"generate_rows: {len(contexts)} contexts, {len(greedy)} greedy flags, {len(seeds)} seeds and "
                f"{len(limits)} limits: give one of each per context"
            )
        if any(not 1 <= m <= sampling.max_new_tokens for m in limits):
            raise ValueError(f"generate_rows: max_new_tokens={limits} must be in [1, {sampling.max_new_tokens}]")
        self._check_weights()
        if self.asleep:
            self.wake_up()
        rows = [list(map(int, c)) for c in contexts]
        out = self._generate_rows(rows, [bool(g) for g in greedy], sampling, [int(s) for s in seeds], limits)
        self.num_requests += 1
        return out

    def _generate_rows(
        self, contexts: list[list[int]], greedy: list[bool], sampling: SamplingParams, seeds: list[int], limits
    ) -> list[Completion]:
        raise NotImplementedError(f"the {self.name} engine cannot continue trajectories (rollout.env)")

    def submit(
        self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams, seeds: list[int] | None = None
    ):
        """Start a request; `collect(ticket)` gives its rollouts. A local engine decodes here, so nothing
        runs meanwhile; the remote engine (rollout/remote.py) returns at once and decodes on other ranks."""
        return self.generate(prompt_token_ids, n, sampling, seeds)

    def collect(self, ticket) -> list[PromptRollout]:
        """The rollouts of a `submit` (waits for them)."""
        return ticket

    def _check_weights(self) -> None:
        """Raise RuntimeError when the engine holds no synced weights (checked before waking up)."""

    # ---- weights -------------------------------------------------------------------------
    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """One weight update: every full HF-named tensor (engine dtype/device), bucket by bucket.

        The stream is consumed in this one call (it may be produced lazily by collectives
        while the engine loads); a bucket's tensors may be reused once the next is requested.
        """
        raise NotImplementedError

    # ---- memory --------------------------------------------------------------------------
    def sleep(self) -> None:
        raise NotImplementedError

    def wake_up(self) -> None:
        raise NotImplementedError

    # ---- end of run ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release the engine at the end of a run, before the process groups are destroyed
        (remax_megatron.train). Nothing to release by default."""


def check_generate_args(prompt_token_ids, n: int, sampling) -> None:
    """One-line ValueErrors for the inputs of `generate`."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(
            f"n={n!r} sampled responses per prompt must be an integer >= 0 (rollout.n; 0 = greedy only, e.g. for eval)"
        )
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling={sampling!r} must be a remax_megatron.rollout.SamplingParams")
    for i, prompt in enumerate(prompt_token_ids):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} has no tokens: drop empty prompts before generate")


def world_size_and_rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0
