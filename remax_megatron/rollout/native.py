"""The native rollout engine: a transformers causal LM with a KV cache, for CPU and small GPU runs.

The model is built from `config.json` alone (no weight download); its weights
arrive through `sync_weights` from the actor's export (one full replica per
rank, so `rollout.tp` must be 1). `generate` runs ONE batched decode loop over
all P * (n + 1) rows of this rank's P prompts: for prompt p the rows
p*(n+1) .. p*(n+1)+n-1 are sampled, row p*(n+1)+n is greedy (argmax). The
prompts are prefilled once and copied into a static KV cache n + 1 times; the
loop (rollout/native_decode.py) reads back to the host only every few tokens,
splits a request that `rollout.kv_cache_gib` cannot hold into waves, and runs
the decode step as a CUDA graph on a GPU.

Sampling (same semantics as vLLM): logits / temperature -> keep the top_k
largest -> keep the smallest set of most likely tokens whose mass reaches
top_p (of the top-k renormalised distribution) -> sample. Greedy rows take argmax of the raw logits. Log-probs follow
the convention in rollout/engine.py. Every draw is rollout/sampling.py's one batched Gumbel-max, its
noise keyed by the row's seed (sample j of prompt p: `seeds[p] + j`, the seed convention of
rollout/engine.py) and the token's index in the completion, so a prompt's samples do not depend on which
other prompts share the batch, nor on a row's place in it.

Routes (MoE with rollout.routing_replay): hooks on transformers' top-k routers (the modules the model's
family names, models/families) record the experts every token fed through the model went to (prompt
tokens in the prefill, then each new token as it is fed; the final token never is), per completion int
[tokens, layers, top_k], as vLLM's `routed_experts`.

Weights: the stream carries the family's HF checkpoint names; the family says where a name lies in
transformers' model when the model does not hold it under that name (MoE experts and routers).

sleep()/wake_up(): the KV cache (and the CUDA graph) lives only inside a generate
call, so between calls the engine holds just its weights; on CUDA sleep() moves them to the CPU
and empties the allocator cache, wake_up() moves them back. On CPU both are
no-ops (there is no separate device memory to free).
"""

from __future__ import annotations

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.initialization import no_init_weights

from remax_megatron.models import families
from remax_megatron.models.families import Family
from remax_megatron.rollout.engine import Completion, PromptRollout, RolloutEngine, SamplingParams
from remax_megatron.rollout.native_decode import attention_for, decode_request


class RouteRecorder:
    """Forward hooks on a transformers MoE model's top-k routers (the modules `family` names, which
    return (logits, scores, indices [tokens, top_k])): `take(b, s)` gives the experts of the last
    forward's b x s tokens, [b, s, layers, top_k] int16, by global layer as vLLM lays them out (-1 at
    dense layers: DeepSeek-style first layers)."""

    def __init__(self, model, family: Family):
        self._last: dict[int, torch.Tensor] = {}
        routers = family.engine_routers(model)
        if not routers:
            raise ValueError(
                f"rollout.routing_replay=true but {type(model).__name__} has no top-k router whose "
                "routes the native engine can record: set rollout.routing_replay=false"
            )
        experts = max(getattr(r, "num_experts", 0) for r in routers)
        if experts > torch.iinfo(torch.int16).max:
            raise ValueError(f"{experts} experts: the native engine keeps routes as int16")
        self.routed = list(family.routed_layers(model.config))  # the routers' global layers
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._hook(layer))
        self.layers = model.config.num_hidden_layers

    def _hook(self, layer: int):
        def record(_module, _args, output):  # a forward hook
            self._last[layer] = output[2]  # [b * s, top_k]

        return record

    def take(self, b: int, s: int, to_host: bool = True) -> torch.Tensor:
        if len(self._last) != len(self.routed):
            raise RuntimeError(f"recorded routes of {len(self._last)} of {len(self.routed)} MoE layers")
        routed = torch.stack([self._last[i] for i in range(len(self.routed))], dim=1)  # [b * s, routed, k]
        out = routed.new_full((routed.shape[0], self.layers, routed.shape[2]), -1)  # [b * s, layers, k]
        out[:, self.routed] = routed
        self._last.clear()
        out = out.view(b, s, self.layers, -1).to(torch.int16)  # expert ids < 32768: 1/4 of long
        return out.cpu() if to_host else out


def _eos_ids(hf_dir: str, config) -> set[int]:
    ids = []
    try:
        ids.append(GenerationConfig.from_pretrained(hf_dir).eos_token_id)
    except OSError:
        pass
    ids.append(getattr(config, "eos_token_id", None))
    out = set()
    for item in ids:
        if isinstance(item, int):
            out.add(item)
        elif item:
            out.update(int(i) for i in item)
    return out


class NativeEngine(RolloutEngine):
    """transformers AutoModelForCausalLM + a hand-written batched decode loop."""

    name = "native"

    def __init__(
        self,
        cfg=None,
        *,
        hf_dir: str,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        max_model_len: int | None = None,  # noqa: ARG002 - the factory's keyword; the model's limit applies
        device: str | torch.device | None = None,
        routes: bool | None = None,
    ):
        super().__init__(seed)

        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.hf_dir, self.dtype, self.device = hf_dir, dtype, torch.device(device)
        config = AutoConfig.from_pretrained(hf_dir)
        # the family whose HF names the weight stream carries (config.json's one architecture)
        architecture = (getattr(config, "architectures", None) or [None])[0]
        self.family = families.lookup(str(architecture), f"{hf_dir}/config.json")[0]
        with no_init_weights():
            attention = attention_for(getattr(transformers, str(architecture), None))
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
        model.tie_weights()  # no_init_weights also skips tying (transformers 5)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.eos_token_ids = _eos_ids(hf_dir, config)
        pad = getattr(config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else min(self.eos_token_ids, default=0)
        self._tokenizer = None
        # parameters and persistent buffers (a MoE router's correction bias): what the weight stream fills
        persistent = self.model.state_dict(keep_vars=True)
        self._params = dict(self.model.named_parameters()) | {
            name: b for name, b in self.model.named_buffers() if name in persistent
        }
        self.synced = False
        self.last_update: dict[str, int] = {}  # the last update's tensors written in place / copied
        self.routes = bool(getattr(cfg, "routing_replay", False)) if routes is None else routes
        # the static KV cache of one request may take this much; more rows decode in waves (0: no limit)
        self.kv_cache_bytes = int(float(getattr(cfg, "kv_cache_gib", 0.0) or 0.0) * 2**30)
        self.decode_pool: torch.Tensor | None = None  # the CPU decode's KV storage, kept between requests
        self._recorder = RouteRecorder(self.model, self.family) if self.routes else None

    @staticmethod
    def check_config(cfg, arch, world_size: int) -> None:  # noqa: ARG004 - the engine interface
        if cfg.tp != 1:
            raise ValueError(
                f"rollout.tp={cfg.tp} needs rollout.engine=vllm: the native engine keeps one "
                "full replica per rank; set rollout.tp=1"
            )
        guided = next((k for k in ("guided_regex", "guided_json") if getattr(cfg, k, "")), None)
        if guided:
            raise ValueError(
                f"rollout.{guided} needs rollout.engine=vllm (vLLM's structured outputs): the native "
                f"engine decodes without constraints; unset rollout.{guided} or use vLLM"
            )

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
        return self._tokenizer

    # ---- weights -------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, buckets) -> None:
        if self.asleep:
            self._wake(fresh=True)  # every parameter is about to be overwritten: no upload of the old ones
        self.synced = False
        loaded: dict[str, set[str]] = {}  # parameter -> tensors copied
        pieces: dict[str, int] = {}  # parameter -> tensors it takes
        in_place = copied = 0
        for bucket in buckets:
            copies = []  # (engine tensor, bucket tensor): one torch._foreach_copy_ per bucket
            for name, tensor in bucket:
                key, target, needed = self._target(name)
                pieces[key] = needed
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"weight {name}: shape {tuple(tensor.shape)} but the engine has "
                        f"{tuple(target.shape)}: does {self.hf_dir}/config.json match the actor?"
                    )
                if _same_memory(target, tensor):  # the export wrote it in place (weight_destination)
                    in_place += 1
                else:
                    copies.append((target, tensor))
                loaded.setdefault(key, set()).add(name)
            if copies:  # before the next bucket: its views may reuse this one's buffer
                torch._foreach_copy_([t for t, _ in copies], [b for _, b in copies])
                copied += len(copies)
        missing = sorted(k for k in self._params if len(loaded.get(k, ())) < pieces.get(k, 1))
        if missing:
            raise ValueError(
                f"weight sync left {len(missing)} engine parameters unset (e.g. {missing[:3]}): "
                "the exported stream does not cover the model"
            )
        self.last_update = {"in_place": in_place, "copied": copied}
        self.synced = True

    def weight_destination(self, name: str) -> torch.Tensor | None:
        """The engine tensor HF weight `name` lives in, for an export that writes it there directly (a
        colocated actor of the same layout and dtype: weight_sync.WeightSync); None while asleep (its
        storage is about to be replaced) or for a name the model does not hold."""
        if self.asleep:
            return None
        try:
            return self._target(name)[1]
        except ValueError:
            return None

    def _target(self, name: str) -> tuple[str, torch.Tensor, int]:
        """An HF checkpoint tensor's place in the model: (parameter name, the tensor to copy it into, how
        many checkpoint tensors fill that parameter). Its own parameter when the model has one, else
        where the family puts it (e.g. one expert's slice of transformers' fused experts)."""
        param = self._params.get(name)
        if param is not None:
            return name, param, 1
        place = self.family.engine_tensor(name)
        param = self._params.get(place.param) if place is not None else None
        if param is not None and place.expert is None:
            return place.param, param, 1
        if param is not None and place.select is not None and place.expert < param.shape[0]:
            return place.param, place.select(param), place.parts * param.shape[0]
        if param is not None and place.expert < param.shape[0]:
            rows = param.shape[1] // place.parts  # one block of [gate; up]
            block = param[place.expert, place.part * rows : (place.part + 1) * rows]
            return place.param, block, place.parts * param.shape[0]
        raise ValueError(
            f"weight {name!r} has no parameter in the native engine's {type(self.model).__name__}: "
            f"is the actor the same architecture as {self.hf_dir}?"
        )

    # ---- memory --------------------------------------------------------------------------
    def sleep(self) -> None:
        if self.device.type == "cuda" and not self.asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.asleep = True

    def wake_up(self) -> None:
        self._wake(fresh=False)

    def _wake(self, fresh: bool) -> None:
        """Back on the device; fresh: the parameters get new uninitialised storage there instead of an upload
        of the CPU copy (a weight update that overwrites them all follows)."""
        if self.device.type == "cuda" and self.asleep:
            if fresh:
                for param in self._params.values():  # tied parameters are one object: one allocation
                    param.data = torch.empty(param.shape, dtype=param.dtype, device=self.device)
            self.model.to(self.device)  # the buffers (rotary tables); parameters already there stay
        self.asleep = False

    # ---- generation ----------------------------------------------------------------------
    def _check_weights(self) -> None:
        if not self.synced:
            raise RuntimeError(
                "native engine: generate before any sync_weights; its weights are "
                "uninitialised (call sync_weights(engine, export_hf_weights(actor), ...) first)"
            )

    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams, seeds: list[int]
    ) -> list[PromptRollout]:
        if not prompts:
            return []
        self._check_lengths(prompts, [sampling.max_new_tokens] * len(prompts), sampling)
        per = n + 1
        row_seeds = [s for seed in seeds for s in [seed + j for j in range(n)] + [seed]]  # sample j: seeds[p] + j
        greedy = ([False] * n + [True]) * len(prompts)  # (the greedy row's seed is not drawn from)
        rows = self._decode(prompts, per, greedy, row_seeds, sampling, [sampling.max_new_tokens] * len(greedy))
        return [
            PromptRollout(sampled=rows[p * per : p * per + n], greedy=rows[p * per + n]) for p in range(len(prompts))
        ]

    def _generate_rows(
        self, contexts: list[list[int]], greedy: list[bool], sampling: SamplingParams, seeds: list[int], limits
    ) -> list[Completion]:
        if not contexts:
            return []
        self._check_lengths(contexts, limits, sampling)
        return self._decode(contexts, 1, greedy, seeds, sampling, limits)

    def _check_lengths(self, prompts: list[list[int]], limits: list[int], sampling: SamplingParams) -> None:
        if sampling.guided:
            raise ValueError("guided decoding needs the vLLM engine: the native engine decodes without constraints")
        limit = getattr(self.model.config, "max_position_embeddings", None)
        longest = max(len(p) + m for p, m in zip(prompts, limits))
        if limit is not None and longest > limit:
            raise ValueError(
                f"a context of {longest - max(limits)} tokens + max_new_tokens ({max(limits)}) exceeds the model's "
                f"max_position_embeddings={limit}: lower data.max_prompt_tokens, rollout.max_new_tokens or "
                "rollout.max_total_tokens"
            )

    @torch.no_grad()
    def _decode(
        self,
        prompts: list[list[int]],
        per: int,
        greedy: list[bool],
        seeds: list[int],
        sampling: SamplingParams,
        limits: list[int],
    ) -> list[Completion]:
        """The one engine request: P prompts -> P * per completions (row r continues prompt r // per), row r
        greedy or drawing from stream seeds[r], at most limits[r] tokens (rollout/native_decode.py)."""
        completions = decode_request(self, prompts, per, greedy, seeds, sampling, limits)
        self.decoded_tokens += sum(len(c.token_ids) for c in completions)
        return completions

    def _hits_stop(self, token_ids: list[int], stop: list[str]) -> bool:
        # Earlier steps found no stop string, so only one ending in the new text can be new:
        # look at the tail that could hold it.
        text = self.tokenizer.decode(token_ids[-max(len(s) for s in stop) - 8 :], skip_special_tokens=True)
        return any(s in text for s in stop)

    # ---- scoring (parity checks, benchmark) ----------------------------------------------
    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Teacher-forced log-probs: input_ids [B, S] right-padded, labels [B, S] (-100 ignored)
        -> [B, S] float32, log softmax(logits[b, t] / temperature)[labels[b, t]], 0 where ignored."""
        logits = self.model(input_ids=input_ids.to(self.device)).logits.float() / temperature  # [B, S, V]
        logp = torch.log_softmax(logits, dim=-1)
        lab = labels.to(self.device)
        out = logp.gather(-1, lab.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return out.masked_fill(lab < 0, 0.0)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same elements of the same storage (views of one parameter included)."""
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape and a.dtype == b.dtype
