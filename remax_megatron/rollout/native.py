"""The native rollout engine: a transformers causal LM with a KV cache, for CPU and small GPU runs.

The model is built from `config.json` alone (no weight download); its weights
arrive through `sync_weights` from the actor's export (one full replica per
rank, so `rollout.tp` must be 1). `generate` runs ONE batched decode loop over
all P * (n + 1) rows of this rank's P prompts: for prompt p the rows
p*(n+1) .. p*(n+1)+n-1 are sampled, row p*(n+1)+n is greedy (argmax). The
prompts are prefilled once (left-padded, positions start at each prompt's
first token) and the KV cache is repeated n + 1 times; finished rows leave
the batch.

Sampling (same semantics as vLLM): logits / temperature -> keep the top_k
largest -> keep the smallest set of most likely tokens whose mass reaches
top_p (of the top-k renormalised distribution) -> sample. Greedy rows take argmax of the raw logits. Log-probs follow
the convention in rollout/engine.py. Sample j of prompt p draws from its own
generator seeded `seeds[p] + j` (the seed convention of rollout/engine.py), so a
prompt's samples do not depend on which other prompts share the batch.

Routes (MoE with rollout.routing_replay): hooks on transformers' top-k routers (the modules the model's
family names, models/families) record the experts every token fed through the model went to (prompt
tokens in the prefill, then each new token as it is fed; the final token never is), per completion int
[tokens, layers, top_k], as vLLM's `routed_experts`.

Weights: the stream carries the family's HF checkpoint names; the family says where a name lies in
transformers' model when the model does not hold it under that name (MoE experts and routers).

sleep()/wake_up(): the KV cache lives only inside a generate call, so between
calls the engine holds just its weights; on CUDA sleep() moves them to the CPU
and empties the allocator cache, wake_up() moves them back. On CPU both are
no-ops (there is no separate device memory to free).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.initialization import no_init_weights

from remax_megatron.models import families
from remax_megatron.models.families import Family
from remax_megatron.rollout.engine import Completion, PromptRollout, RolloutEngine, SamplingParams
from remax_megatron.rollout.sequences import left_pad


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """scaled logits [B, V] -> the same with tokens outside top-k / top-p set to -inf.

    top-k first (k largest; ties at the k-th value are kept), then top-p on the
    renormalised rest: a token is kept when the mass of the tokens ranked above
    it is < top_p, so the most likely token always survives.
    """
    out = scaled
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]  # [B, 1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)  # [B, V]
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    top_k: int,
    top_p: float,
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step.

    logits [B, V] float32, temperature [B] (1.0 on greedy rows), greedy [B] bool,
    generators [B] (each sampled row draws from its own stream; None on greedy rows)
    -> (tokens [B] long, logprobs [B] float32 of log softmax(logits / temperature)[token]).
    """
    scaled = logits / temperature.unsqueeze(-1)
    logprobs = torch.log_softmax(scaled, dim=-1)  # [B, V]
    tokens = logits.argmax(-1)
    sampled_rows = (~greedy).nonzero().squeeze(-1)
    if sampled_rows.numel():
        probs = filter_logits(scaled[sampled_rows], top_k, top_p).softmax(-1)  # [B_sampled, V]
        draws = torch.cat(
            [torch.multinomial(probs[i], 1, generator=generators[row]) for i, row in enumerate(sampled_rows.tolist())]
        )
        tokens = tokens.index_copy(0, sampled_rows, draws)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class RouteRecorder:
    """Forward hooks on a transformers MoE model's top-k routers (the modules `family` names, which
    return (logits, scores, indices [tokens, top_k])): `take(b, s)` gives the experts of the last
    forward's b x s tokens, [b, s, layers, top_k] int16, in layer order."""

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
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._hook(layer))
        self.layers = len(routers)

    def _hook(self, layer: int):
        def record(_module, _args, output):  # a forward hook
            self._last[layer] = output[2]  # [b * s, top_k]

        return record

    def take(self, b: int, s: int) -> torch.Tensor:
        if len(self._last) != self.layers:
            raise RuntimeError(f"recorded routes of {len(self._last)} of {self.layers} MoE layers")
        out = torch.stack([self._last[layer] for layer in range(self.layers)], dim=1)  # [b * s, layers, k]
        self._last.clear()
        return out.view(b, s, self.layers, -1).to(torch.int16).cpu()  # expert ids < 32768: 1/4 of long


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


@dataclass
class _Rows:
    """What each output row of one request has produced so far (lists indexed by output row)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish: list[str | None]  # "stop" once a row stopped; None: still running or ran to length
    routes: list[list[torch.Tensor]] | None  # per row, pieces of [tokens, layers, top_k]; None: not recorded

    @classmethod
    def empty(cls, total: int, routes: bool) -> _Rows:
        return cls([[] for _ in range(total)], [[] for _ in range(total)], [None] * total, [] if routes else None)

    def completions(self) -> list[Completion]:
        return [
            Completion(
                token_ids=self.tokens[r],
                logprobs=self.logprobs[r],
                finish_reason=self.finish[r] or "length",
                routed_experts=torch.cat(self.routes[r]) if self.routes is not None else None,
            )
            for r in range(len(self.tokens))
        ]


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
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.tie_weights()  # no_init_weights also skips tying (transformers 5)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.eos_token_ids = _eos_ids(hf_dir, config)
        pad = getattr(config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else min(self.eos_token_ids, default=0)
        self._tokenizer = None
        self._params = dict(self.model.named_parameters())
        self.synced = False
        self.routes = bool(getattr(cfg, "routing_replay", False)) if routes is None else routes
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
            self.wake_up()
        loaded: dict[str, set[str]] = {}  # parameter -> tensors copied
        pieces: dict[str, int] = {}  # parameter -> tensors it takes
        for bucket in buckets:
            for name, tensor in bucket:
                key, target, needed = self._target(name)
                pieces[key] = needed
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"weight {name}: shape {tuple(tensor.shape)} but the engine has "
                        f"{tuple(target.shape)}: does {self.hf_dir}/config.json match the actor?"
                    )
                target.copy_(tensor)
                loaded.setdefault(key, set()).add(name)
        missing = sorted(k for k in self._params if len(loaded.get(k, ())) < pieces.get(k, 1))
        if missing:
            raise ValueError(
                f"weight sync left {len(missing)} engine parameters unset (e.g. {missing[:3]}): "
                "the exported stream does not cover the model"
            )
        self.synced = True

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
        if self.device.type == "cuda" and self.asleep:
            self.model.to(self.device)
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
        dev = self.device
        generators = []  # per output row: sample j of prompt p draws from seeds[p] + j, the greedy row from none
        for seed in seeds:
            generators += [torch.Generator(device=dev).manual_seed(seed + j) for j in range(n)] + [None]
        greedy = ([False] * n + [True]) * len(prompts)
        rows = self._decode(prompts, per, greedy, generators, sampling, [sampling.max_new_tokens] * len(greedy))
        return [
            PromptRollout(sampled=rows[p * per : p * per + n], greedy=rows[p * per + n]) for p in range(len(prompts))
        ]

    def _generate_rows(
        self, contexts: list[list[int]], greedy: list[bool], sampling: SamplingParams, seeds: list[int], limits
    ) -> list[Completion]:
        if not contexts:
            return []
        self._check_lengths(contexts, limits, sampling)
        dev = self.device
        generators = [None if g else torch.Generator(device=dev).manual_seed(s) for g, s in zip(greedy, seeds)]
        return self._decode(contexts, 1, greedy, generators, sampling, limits)

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
        generators: list,
        sampling: SamplingParams,
        limits: list[int],
    ) -> list[Completion]:
        """The one engine request: P prompts -> P * per completions (row r continues prompt r // per), row r
        greedy or drawing from generators[r], at most limits[r] tokens."""
        dev = self.device
        cache, logits, mask, next_pos, rows = self._prefill(prompts, per)
        greedy = torch.tensor(greedy, device=dev)
        temperature = torch.where(greedy, 1.0, float(sampling.temperature)).to(torch.float32)
        active = torch.arange(len(prompts) * per, device=dev)  # batch row -> output row
        eos = torch.tensor(sorted(self.eos_token_ids | set(sampling.stop_token_ids)), dtype=torch.long, device=dev)
        longest = max(limits)
        for step in range(longest):
            tok, lp = sample_next(
                logits,
                temperature,
                greedy,
                sampling.top_k,
                sampling.top_p,
                [generators[row] for row in active.tolist()],
            )
            done = torch.isin(tok, eos) if eos.numel() else torch.zeros_like(greedy)
            done_list = self._append_step(rows, active, tok, lp, done, sampling.stop)
            if step == longest - 1:
                break
            # a row at its own limit ends there ("length")
            keep = ~torch.tensor([d or step + 1 >= limits[r] for d, r in zip(done_list, active.tolist())], device=dev)
            if not keep.any():
                break
            if not keep.all():
                index = keep.nonzero().squeeze(-1)
                cache.batch_select_indices(index)
                active, tok, mask, next_pos = active[index], tok[index], mask[index], next_pos[index]
                greedy, temperature = greedy[index], temperature[index]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            logits = self._feed(tok, mask, next_pos, cache, active, rows)
            next_pos = next_pos + 1
        completions = rows.completions()
        self.decoded_tokens += sum(len(c.token_ids) for c in completions)
        return completions

    def _prefill(self, prompts: list[list[int]], per: int):
        """All prompts through the model once, then everything repeated per output row (n + 1 per prompt):
        (KV cache, last logits [B, V] float32, attention mask [B, L], next positions [B], the rows' record
        with the prompt tokens' routes)."""
        ids, mask, pos = left_pad(prompts, self.pad_token_id, self.device)  # [P, L] each
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        rows = _Rows.empty(len(prompts) * per, self.routes)
        if self.routes:
            prefill = self._recorder.take(*ids.shape)  # [P, L, layers, k]
            for p, prompt in enumerate(prompts):
                rows.routes += [[prefill[p, ids.shape[1] - len(prompt) :]] for _ in range(per)]
        cache = out.past_key_values
        cache.batch_repeat_interleave(per)
        logits = out.logits[:, -1].float().repeat_interleave(per, 0)  # [B, V]
        return cache, logits, mask.repeat_interleave(per, 0), pos[:, -1].repeat_interleave(per) + 1, rows

    def _append_step(
        self,
        rows: _Rows,
        active: torch.Tensor,
        tok: torch.Tensor,
        lp: torch.Tensor,
        done: torch.Tensor,
        stop: list[str],
    ) -> list[bool]:
        """One step's token and log-prob onto each active row; which rows finished (EOS, a stop token or
        a stop string), their finish reason set."""
        tok_list, lp_list, done_list = tok.tolist(), lp.tolist(), done.tolist()
        for i, row in enumerate(active.tolist()):
            rows.tokens[row].append(tok_list[i])
            rows.logprobs[row].append(lp_list[i])
            if not done_list[i] and stop and self._hits_stop(rows.tokens[row], stop):
                done_list[i] = True
            if done_list[i]:
                rows.finish[row] = "stop"
        return done_list

    def _feed(
        self, tok: torch.Tensor, mask: torch.Tensor, next_pos: torch.Tensor, cache, active: torch.Tensor, rows: _Rows
    ) -> torch.Tensor:
        """The active rows' new tokens through the model (their routes recorded) -> next logits [B, V] float32."""
        out = self.model(
            input_ids=tok.unsqueeze(-1),
            attention_mask=mask,
            position_ids=next_pos.unsqueeze(-1),
            past_key_values=cache,
            use_cache=True,
        )
        if self.routes:
            fed = self._recorder.take(tok.shape[0], 1)  # [B, 1, layers, k]
            for i, row in enumerate(active.tolist()):
                rows.routes[row].append(fed[i])
        return out.logits[:, -1].float()

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
