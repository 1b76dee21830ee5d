"""The vLLM rollout engine (GPU): vLLM's `LLM` in-process under torchrun, no Ray.

Engine groups: vLLM's "external launcher" mode builds its TP groups from the
torch world, tp fastest, so ranks [k * rollout.tp, (k + 1) * rollout.tp) form
engine k (vLLM calls the k axis "external data parallel"). Every rank calls
`generate` with ITS OWN prompts; the ranks of one engine gather their prompts
(gloo, object all-gather), issue ONE identical `LLM.generate` call (external
launcher requires identical requests on the ranks of an engine, which then
decode in lockstep), and each rank keeps the results of its own prompts. Give
each rank a distinct prompt shard; the engine groups then decode different
prompts in parallel.

Created with load_format="dummy" (weights come from `sync_weights`),
enable_sleep_mode=True, logprobs_mode="processed_logprobs" (log-probs after
temperature: see the convention in rollout/engine.py), prefix caching on,
max_model_len left to vLLM (the model's max_position_embeddings).
Weights are loaded bucket by bucket through the model's own `load_weights`
(HF names; vLLM fuses q/k/v and gate/up and keeps this rank's TP shard) via
`LLM.collective_rpc`, which with the external launcher runs in this process.
The prefix cache is reset after every weight update.

sleep(): vLLM level-2 sleep (weights and KV cache discarded: the next sync
rewrites every weight). A sync wakes only the weights, and generate the KV
cache, so the two are never both allocated needlessly.

Written against vLLM 0.33.0's source (LLM, collective_rpc, sleep/wake_up tags,
reset_prefix_cache, SamplingParams); not yet run on a GPU. Lazily imported:
CPU installs never import vLLM. `build_requests` and
`parse_outputs` are pure and unit-tested on CPU.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist

from remax_megatron.rollout.engine import Completion, PromptRollout, RolloutEngine, SamplingParams, \
    world_size_and_rank

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def call_seed(base_seed: int, engine_index: int, call_index: int) -> int:
    """A 31-bit seed for one generate call of one engine group (same on its ranks)."""
    digest = hashlib.sha256(f"{base_seed}/{engine_index}/{call_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def build_requests(prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams, seed: int,
                   params_cls) -> tuple[list[dict], list]:
    """The single vLLM request: (prompts, per-prompt SamplingParams), 2 entries per prompt.

    Entry 2p: prompt p, n sampled completions (vLLM seeds its children seed + j);
    entry 2p + 1: prompt p, one greedy completion (temperature 0 = argmax).
    n = 0 (greedy-only eval): the greedy entry alone, one per prompt (vLLM refuses n=0).
    params_cls: vllm.SamplingParams (a stand-in with the same keywords in tests).
    """
    prompts, params = [], []
    for p, ids in enumerate(prompt_token_ids):
        common = dict(max_tokens=sampling.max_new_tokens, stop=list(sampling.stop) or None, logprobs=0,
                      include_stop_str_in_output=True, skip_special_tokens=True)
        if n > 0:
            prompts.append({"prompt_token_ids": list(ids)})
            params.append(params_cls(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                                     top_k=sampling.top_k, seed=(seed + p * n) & 0x7FFFFFFF, **common))
        prompts.append({"prompt_token_ids": list(ids)})
        params.append(params_cls(n=1, temperature=0.0, **common))
    return prompts, params


def _completion(output) -> Completion:
    token_ids = [int(t) for t in output.token_ids]
    if output.logprobs is None or len(output.logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no per-token log-probs: the request must set logprobs=0")
    logprobs = [float(step[tok].logprob) for step, tok in zip(output.logprobs, token_ids)]
    reason = output.finish_reason
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a completion with reason {reason!r} (expected stop or length)")
    return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=reason)


def parse_outputs(outputs: list, n: int) -> list[PromptRollout]:
    """vLLM RequestOutputs of `build_requests` (2 per prompt in order; 1 when n = 0) -> PromptRollouts."""
    per_prompt = 2 if n > 0 else 1
    if len(outputs) % per_prompt:
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for requests that come in pairs")
    rollouts = []
    for p in range(len(outputs) // per_prompt):
        sampled = sorted(outputs[2 * p].outputs, key=lambda o: o.index) if n > 0 else []
        greedy = outputs[per_prompt * p + per_prompt - 1].outputs
        if len(sampled) != n or len(greedy) != 1:
            raise RuntimeError(f"prompt {p}: vLLM returned {len(sampled)} sampled / {len(greedy)} greedy "
                               f"completions, expected {n} / 1")
        rollouts.append(PromptRollout(sampled=[_completion(o) for o in sampled], greedy=_completion(greedy[0])))
    return rollouts


def _load_on_worker(worker, weights, config_context):
    """Runs inside vLLM's worker (this process): the model's own HF-name loader."""
    with config_context(worker.vllm_config):
        worker.get_model().load_weights(weights)


def _default_llm_factory(**kwargs):
    try:
        from vllm import LLM
    except ImportError as e:
        raise ImportError(f"rollout.engine=vllm needs vLLM ({e}): install the [gpu] extra "
                          "(pip install -e .[gpu]) or set rollout.engine=native") from None
    return LLM(**kwargs)


def _vllm_classes():
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.config import set_current_vllm_config

    return VllmSamplingParams, set_current_vllm_config


class VllmEngine(RolloutEngine):
    """vLLM `LLM` with the external launcher; see the module docstring."""

    name = "vllm"

    def __init__(self, cfg, *, hf_dir: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                 llm_factory=None, vllm_classes=None):
        super().__init__()
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"engine dtype {dtype} is not supported: use one of {sorted(map(str, _DTYPE_NAMES))}")
        world, rank = world_size_and_rank()
        if world % cfg.tp:
            raise ValueError(f"rollout.tp={cfg.tp} does not divide the world size {world}")
        self.cfg, self.hf_dir, self.dtype, self.seed = cfg, hf_dir, dtype, int(seed)
        self.tp, self.rank = cfg.tp, rank
        self.engine_index = rank // cfg.tp
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self._params_cls, self._config_context = (vllm_classes or _vllm_classes)()
        self._group = self._engine_groups(world) if cfg.tp > 1 else None
        self._calls = 0
        self._weights_asleep = False
        self._weights_valid = False  # dummy weights until the first sync; discarded by sleep()
        self.llm = (llm_factory or _default_llm_factory)(
            model=hf_dir,
            tensor_parallel_size=cfg.tp,
            distributed_executor_backend="external_launcher",
            load_format="dummy",
            dtype=_DTYPE_NAMES[dtype],
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_sleep_mode=True,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            seed=self.seed,
        )

    def _engine_groups(self, world: int):
        # Every rank must create every group, in the same order (torch.distributed rule).
        mine = None
        for k in range(world // self.tp):
            ranks = list(range(k * self.tp, (k + 1) * self.tp))
            group = dist.new_group(ranks, backend="gloo")
            if k == self.engine_index:
                mine = group
        return mine

    # ---- generation ----------------------------------------------------------------------
    def _check_weights(self) -> None:
        if not self._weights_valid:
            raise RuntimeError("vllm engine: generate without valid weights (none synced yet, or sleep() "
                               "discarded them): call sync_weights(engine, export_hf_weights(actor), ...) first")

    def _generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[PromptRollout]:
        if self._group is not None:
            gathered: list = [None] * self.tp
            dist.all_gather_object(gathered, prompts, group=self._group)
        else:
            gathered = [prompts]
        counts = [len(g) for g in gathered]
        everything = [p for g in gathered for p in g]
        mine_start = sum(counts[: self.rank % self.tp])
        if not everything:
            return []
        seed = sampling.seed if sampling.seed is not None else call_seed(self.seed, self.engine_index, self._calls)
        self._calls += 1
        request_prompts, request_params = build_requests(everything, n, sampling, seed, self._params_cls)
        outputs = self.llm.generate(request_prompts, request_params, use_tqdm=False)
        self.num_requests += 1
        return parse_outputs(outputs, n)[mine_start:mine_start + len(prompts)]

    # ---- weights -------------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        if self.asleep and self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc(_load_on_worker, args=(named_tensors, self._config_context))

    def finish_weight_update(self) -> None:
        self.llm.reset_prefix_cache()
        self._weights_valid = True

    # ---- memory --------------------------------------------------------------------------
    def sleep(self) -> None:
        if not self.asleep:
            self.llm.sleep(level=2)
            self.asleep, self._weights_asleep, self._weights_valid = True, True, False

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"] if not self._weights_asleep else None)
            self.asleep, self._weights_asleep = False, False
            self.llm.reset_prefix_cache()


def null_config_context(_config):
    """Stand-in for vllm.config.set_current_vllm_config in CPU tests."""
    return contextlib.nullcontext()
