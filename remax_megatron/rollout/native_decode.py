"""The native engine's decode loop: a static KV cache, no per-token host sync, the step as a CUDA graph.

    completions = decode_request(engine, prompts, per, greedy, seeds, sampling, limits)   # rollout/native.py

One request = P prompts -> P * per rows (row r continues prompt r // per). The rows are decoded in waves
of as many rows as `rollout.kv_cache_gib` holds (one wave when it is 0); each wave:
- prefill: its prompts once (left-padded, positions from each prompt's first token, a DynamicCache), then
  their keys / values copied into a static cache of [rows, kv_heads, longest prompt + longest limit,
  head_dim] per layer, each row's copy of its prompt's;
- decode: every step feeds every row (finished rows stay in the batch, masked: their tokens are not
  kept), samples with rollout/sampling.py (the row's seed and the token's index in its completion), and
  records token, log-prob, length and the EOS / stop-token / per-row-limit ends on the device. The
  attention mask is the preallocated [rows, cache length] prompt mask AND'ed with "column <= the step's
  slot" on the device (a 4D mask transformers takes as is); positions advance in place.
- host checks: after each of tokens 1 to 8, after 12 and then every 16 (and at the end) one device-to-host copy brings
  the new tokens, log-probs, lengths and stop flags; stop strings are matched there (a row that hit one
  is cut at the token that completed it and marked done on the device); the wave ends when every row has.

On CUDA the decode step (forward, sampler, bookkeeping: fixed shapes, state updated in place) is
captured as one torch.cuda.CUDAGraph after two eager steps and replayed (captured again, after two more
eager steps, when finished rows leave the batch); the graph, like the cache,
lives for one wave, so sleep() / wake_up() between requests (weights moved, storage replaced) never
meet a stale graph. Routing replay records each fed token's experts into a device buffer: that path
runs eagerly (forward hooks do not run inside a replayed graph).

MoE models decode through transformers' grouped-mm experts (its default where torch has grouped_mm:
sorted routes and histc offsets, no data-dependent host sync), not the eager loop over experts.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache, DynamicCache, StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from remax_megatron.rollout.engine import Completion, SamplingParams
from remax_megatron.rollout.sampling import row_keys, sample_tokens
from remax_megatron.rollout.sequences import left_pad

FIRST_CHECKS = (1, 2, 3, 4, 5, 6, 7, 8, 12)  # tokens per row after which the host looks; then every CHECK_EVERY
CHECK_EVERY = 16
GRAPH_AFTER = 2  # eager steps (the warm-up) before the CUDA graph is captured
CUDA_GRAPHS = True  # capture the decode step on CUDA (False: eager, the graph's reference in tests/gpu)


ATTENTION = "remax_decode_sdpa"  # the native engine's attention implementation (registered below)


def decode_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' "sdpa" attention, except on the CPU under a mask with grouped-query attention: there SDPA
    takes the KV heads as they are (enable_gqa) where transformers' own repeats them (repeat_kv: a copy of
    the whole static cache per layer and token, which made the CPU decode 1.5x slower). CUDA keeps
    transformers' path (a masked GQA there would fall to SDPA's math kernel)."""
    if kwargs.get("s_aux") is not None:  # transformers' sdpa would ignore the sinks (gpt-oss), silently
        return _sdpa_with_sinks(query, key, value, attention_mask, scaling, kwargs["s_aux"])
    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or groups == 1 or query.device.type != "cpu":
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask[:, :, :, : key.shape[-2]], scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None  # [B, q, heads, head_dim], no weights


def _sdpa_with_sinks(query, key, value, attention_mask, scaling, sinks):
    """gpt-oss's attention with sinks: one more key per head whose score is the head's sink logit and whose
    value is zero (transformers' eager gpt-oss attention, on SDPA). query [B, heads, q, d], key / value
    [B, kv_heads, k, d], attention_mask bool [B | 1, 1, q, >= k] (True = attend) or None (causal)."""
    b, heads, q, _ = query.shape
    k = key.shape[-2]
    if attention_mask is None:
        rows = torch.arange(q, device=query.device).view(-1, 1) + (k - q)
        allowed = (torch.arange(k, device=query.device).view(1, -1) <= rows)[None, None]
    else:
        allowed = attention_mask[..., :k]
        allowed = allowed if allowed.dtype == torch.bool else allowed == 0  # additive: 0 where attended
    bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(~allowed, float("-inf"))
    bias = torch.cat([bias.expand(b, heads, q, k), sinks.to(query.dtype).view(1, -1, 1, 1).expand(b, heads, q, 1)], -1)
    key = torch.cat([key, key.new_zeros(*key.shape[:2], 1, key.shape[-1])], 2)
    value = torch.cat([value, value.new_zeros(*value.shape[:2], 1, value.shape[-1])], 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, scale=scaling, enable_gqa=key.shape[1] != heads
    )
    return out.transpose(1, 2).contiguous(), None  # [B, q, heads, head_dim], no weights


AttentionInterface.register(ATTENTION, decode_sdpa)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
# transformers refuses an attention whose name contains "sdpa" for a model class that declares no SDPA support
# (gpt-oss, for its sinks, which transformers' sdpa would drop): the same function under another name serves it
SINKS_ATTENTION = "remax_decode_with_sinks"
AttentionInterface.register(SINKS_ATTENTION, decode_sdpa)
AttentionMaskInterface.register(SINKS_ATTENTION, sdpa_mask)


def attention_for(model_class) -> str:
    """The native engine's attention implementation name for a transformers model class."""
    return ATTENTION if getattr(model_class, "_supports_sdpa", True) else SINKS_ATTENTION


class SlotLayer(StaticLayer):
    """transformers' StaticLayer (K and V of every slot preallocated, [B, kv_heads, length, head_dim]) written
    at the decoder's shared slot tensor ([1], advanced once per step) rather than at its own running length
    (an arange, an add and an add_ per layer and token: the CPU decode felt them). Its get_seq_length is
    not kept: the decoder always passes positions and a 4D mask. `visible` (a host int, eager steps only):
    attention reads the first `visible` slots, not the whole storage (a captured graph needs fixed shapes,
    so it reads all of them, masked)."""

    def __init__(self, length: int, slot: torch.Tensor):
        super().__init__(length)
        self.slot = slot
        self.visible: int | None = None

    def attach(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Take keys / values [B, kv_heads, length, head_dim] as the layer's storage (what transformers'
        lazy_initialization would allocate)."""
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.batch_size, self.num_heads, _, self.k_head_dim = keys.shape
        self.v_head_dim = values.shape[-1]
        self.is_initialized = True

    def update(self, key_states, value_states, *_args, **_kwargs):  # transformers' signature
        self.keys.index_copy_(2, self.slot, key_states)
        self.values.index_copy_(2, self.slot, value_states)
        if self.visible is None:
            return self.keys, self.values
        return self.keys[:, :, : self.visible], self.values[:, :, : self.visible]


def next_check(produced: int) -> int:
    """The token count of the host check after `produced` tokens: 1, 2, ..., 8, 12, 16, 32, 48, ...
    (dense early, where short answers end: each check saves the steps a finished batch would run on; on
    CPU a short-answer request ran 1.06x the old per-token loop's time with checks at 5 and 7 left out)"""
    for k in FIRST_CHECKS:
        if produced < k:
            return k
    return (produced // CHECK_EVERY + 1) * CHECK_EVERY


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes in the cache of every layer (multi-latent attention: its latent and
    the shared rope key, what transformers caches)."""
    if getattr(config, "kv_lora_rank", None):
        per_layer = config.kv_lora_rank + config.qk_rope_head_dim
        return config.num_hidden_layers * per_layer * torch.empty((), dtype=dtype).element_size()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def plan_waves(rows: int, row_bytes: int, budget_bytes: int) -> list[range]:
    """Consecutive output rows per wave: as many as `budget_bytes` holds (all when the budget is 0)."""
    if budget_bytes <= 0:
        return [range(rows)]
    per_wave = budget_bytes // row_bytes
    if per_wave < 1:
        raise ValueError(
            f"rollout.kv_cache_gib={budget_bytes / 2**30:.4g} holds no row of this request (one row's KV cache "
            f"takes {row_bytes / 2**30:.4g} GiB): raise rollout.kv_cache_gib or lower rollout.max_new_tokens"
        )
    return [range(start, min(start + per_wave, rows)) for start in range(0, rows, per_wave)]


def attention_windows(config) -> dict[str, int | None]:
    """Mask kind -> sliding window (None: full attention) of the model's layers, as transformers names the
    kinds in `layer_types` (a model whose layers all slide, e.g. Mistral, names none)."""
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or [])
    if not kinds:
        return {"full_attention": window}
    return {kind: (window if kind == "sliding_attention" else None) for kind in kinds}


def decode_request(
    engine,
    prompts: list[list[int]],
    per: int,
    greedy: list[bool],
    seeds: list[int],
    sampling: SamplingParams,
    limits: list[int],
) -> list[Completion]:
    """P prompts -> P * per completions (row r continues prompt r // per), row r greedy or sampled from
    stream seeds[r], at most limits[r] tokens; in waves that fit engine.kv_cache_bytes."""
    model = engine.model
    total = len(prompts) * per
    longest = max(len(p) for p in prompts) + max(limits)
    row_bytes = kv_bytes_per_token(model.config, engine.dtype) * longest
    out: list[Completion] = []
    for wave in plan_waves(total, row_bytes, engine.kv_cache_bytes):
        firsts = sorted({r // per for r in wave})  # the prompts this wave continues
        decoder = WaveDecoder(
            engine,
            [prompts[p] for p in firsts],
            [firsts.index(r // per) for r in wave],
            [greedy[r] for r in wave],
            [seeds[r] for r in wave],
            sampling,
            [limits[r] for r in wave],
        )
        out += decoder.run()
    return out


class WaveDecoder:
    """One wave: its prompts prefilled, its rows decoded over one static cache (module docstring)."""

    def __init__(
        self,
        engine,
        prompts: list[list[int]],
        row_prompt: list[int],
        greedy: list[bool],
        seeds: list[int],
        sampling: SamplingParams,
        limits: list[int],
    ):
        self.engine, self.model, self.sampling = engine, engine.model, sampling
        self.prompts, self.row_prompt, self.limits = prompts, row_prompt, limits
        self.longest = max(limits)
        dev = self.device = engine.device
        rows = self.rows = len(row_prompt)
        self.recorder = engine._recorder if engine.routes else None
        self.use_graph = CUDA_GRAPHS and dev.type == "cuda" and self.recorder is None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager_steps = 0
        # finished rows leave the batch at a host check once they are this share of it (CPU: any; CUDA: half,
        # as the graph is captured again for the smaller batch)
        self.compact_share = 0.0 if dev.type != "cuda" else 0.5
        self.active = list(range(rows))  # batch row -> wave row
        # per batch row, fixed for the wave: [B]
        self.greedy = torch.tensor(greedy, device=dev)
        self.all_greedy = all(greedy)  # an eval request: the sampler makes no noise
        self.temperature = torch.where(self.greedy, 1.0, float(sampling.temperature)).to(torch.float32)
        self.keys = row_keys(seeds).to(dev)
        self.limit = torch.tensor(limits, device=dev)
        stops = sorted(engine.eos_token_ids | set(sampling.stop_token_ids))
        self.stop_ids = torch.tensor(stops, dtype=torch.long, device=dev).view(1, -1)  # [1, E]
        # decode state, updated in place (a CUDA graph replays on these very tensors)
        self.step = torch.zeros(1, dtype=torch.long, device=dev)  # the next token's index in its completion
        self.tokens = torch.zeros(rows, self.longest, dtype=torch.long, device=dev)
        self.logprobs = torch.zeros(rows, self.longest, dtype=torch.float32, device=dev)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)
        self.stopped = torch.zeros(rows, dtype=torch.bool, device=dev)  # ended by EOS / a stop token
        self.done = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.fed = torch.zeros(rows, 1, dtype=torch.long, device=dev)  # the token the next forward feeds
        # host side: what each row has so far
        self.host_tokens: list[list[int]] = [[] for _ in range(rows)]
        self.host_logprobs: list[list[float]] = [[] for _ in range(rows)]
        self.finish: list[str | None] = [None] * rows  # "stop" / "length" once the host saw the row end
        self.host_routes: list[torch.Tensor | None] = [None] * rows  # routes of rows that left the batch
        self.copied = 0  # tokens per row the host has looked at

    # ---- prefill -------------------------------------------------------------------------
    def _prefill(self) -> torch.Tensor:
        """The prompts through the model once; the static cache, mask and positions of the rows
        -> the last logits of each row [B, V] float32."""
        ids, mask, pos = left_pad(self.prompts, self.engine.pad_token_id, self.device)  # [U, L] each
        prefill_cache = DynamicCache()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=prefill_cache,
            use_cache=True,
            logits_to_keep=1,
        )
        index = torch.tensor(self.row_prompt, device=self.device)  # row -> prompt
        width = self.width = ids.shape[1]
        self.length = width + self.longest  # cache slots: the padded prompt, then one per new token
        self.slot = torch.full((1,), width, dtype=torch.long, device=self.device)  # the fed token's cache slot
        self.cache = Cache(layers=[SlotLayer(self.length, self.slot) for _ in prefill_cache.layers])
        first = prefill_cache.layers[0]
        # [B, kv_heads, length, head_dim] for K and V apart: their widths may differ (transformers' multi-latent
        # attention caches its latent [B, 1, length, kv_lora] as "keys" and the shared rope key as "values")
        shapes = [(self.rows, t.shape[1], self.length, t.shape[3]) for t in (first.keys, first.values)]
        self.kv = self._kv_storage(len(prefill_cache.layers), shapes, first.keys.dtype)  # K's, V's: [layers, B, ...]
        for k, (static, dynamic) in enumerate(zip(self.cache.layers, prefill_cache.layers)):
            static.attach(self.kv[0][k], self.kv[1][k])
            static.keys[:, :, :width].copy_(dynamic.keys.index_select(0, index))
            static.values[:, :, :width].copy_(dynamic.values.index_select(0, index))
        self.position = (pos[:, -1] + 1).index_select(0, index).view(-1, 1)  # [B, 1]
        self.prompt_mask = torch.ones(self.rows, self.length, dtype=torch.bool, device=self.device)
        self.prompt_mask[:, :width] = mask.index_select(0, index).bool()
        self.columns = torch.arange(self.length, device=self.device)
        self.windows = {  # a window that covers the whole cache is full attention
            kind: (w if w is not None and w < self.length else None)
            for kind, w in attention_windows(self.model.config).items()
        }
        self.additive_mask = None
        if self.model.config._attn_implementation == "eager":
            dtype = self.model.dtype
            low = torch.finfo(dtype).min
            self.additive_mask = torch.full((self.rows, 1, 1, self.length), low, dtype=dtype, device=self.device)
        if self.recorder is not None:
            prompt_routes = self.recorder.take(*ids.shape)  # [U, L, layers, k] on the host
            self.prompt_routes = [prompt_routes[u, width - len(p) :] for u, p in enumerate(self.prompts)]
            layers, top_k = prompt_routes.shape[2:]
            self.routes = torch.zeros(self.rows, self.longest, layers, top_k, dtype=torch.int16, device=self.device)
        return out.logits[:, -1].float().index_select(0, index)

    def _kv_storage(self, count: int, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        """[count, *shape] storage for each of `shapes` (K's, V's). CPU: views of one buffer the engine keeps
        between requests (fresh zeroed pages for every request's cache were a fifth of a short CPU request);
        what it holds from an earlier request is finite and lies only in slots the mask hides (weight exactly
        0). CUDA: fresh zeros (the caching allocator reuses blocks, and sleep() empties it)."""
        sizes = [count * torch.Size(shape).numel() for shape in shapes]
        if self.device.type != "cpu":
            return [torch.zeros(count, *shape, dtype=dtype, device=self.device) for shape in shapes]
        pool = self.engine.decode_pool
        if pool is None or pool.dtype != dtype or pool.numel() < sum(sizes):
            pool = self.engine.decode_pool = torch.zeros(sum(sizes), dtype=dtype)
        parts = pool[: sum(sizes)].split(sizes)
        return [part.view(count, *shape) for part, shape in zip(parts, shapes)]

    # ---- one step, all on the device -----------------------------------------------------
    def _attention_mask(self, length: int):
        """[B, 1, 1, length] over the first `length` cache slots: the row's prompt tokens and every new token
        up to this step's slot (as transformers' SDPA takes it: True = attend; eager attention takes it
        additive); a dict per layer kind for models with sliding layers."""
        columns = self.columns[:length]
        seen = self.prompt_mask[:, :length] & (columns <= self.slot)
        masks = {}
        for kind, window in self.windows.items():
            mask = (seen if window is None else seen & (columns > self.slot - window))[:, None, None, :]
            if self.additive_mask is not None:  # eager attention: 0 where seen, the dtype's min elsewhere
                mask = self.additive_mask[..., :length].masked_fill(mask, 0.0)
            masks[kind] = mask
        return masks if len(masks) > 1 or "full_attention" not in masks else masks["full_attention"]

    def _sample(self, logits: torch.Tensor) -> None:
        """Draw every row's next token from logits [B, V]; keep it where the row is still running."""
        batch = self.fed.shape[0]
        positions = self.step.expand(batch)
        sampling = self.sampling
        tok, lp = sample_tokens(
            logits, self.temperature, self.greedy, self.keys, positions, sampling.top_k, sampling.top_p, self.all_greedy
        )
        live = ~self.done
        column = self.step.view(1, 1).expand(batch, 1)
        self.tokens.scatter_(1, column, torch.where(live, tok, 0).unsqueeze(-1))
        self.logprobs.scatter_(1, column, torch.where(live, lp, 0.0).unsqueeze(-1))
        self.lengths.add_(live.long())
        hit = live & (tok.unsqueeze(-1) == self.stop_ids).any(-1)
        self.stopped.logical_or_(hit)
        self.done.logical_or_(hit | (self.lengths >= self.limit))
        self.fed.copy_(tok.unsqueeze(-1))
        self.step.add_(1)

    def _forward_and_sample(self, visible: int | None = None) -> None:
        """Feed every row's last token, sample the next; attention over the first `visible` cache slots (a
        host int: eager steps) or all of them (None: what a captured graph replays)."""
        for layer in self.cache.layers:
            layer.visible = visible
        logits = (
            self.model(
                input_ids=self.fed,
                attention_mask=self._attention_mask(visible or self.length),
                position_ids=self.position,
                past_key_values=self.cache,
                use_cache=True,
            )
            .logits[:, -1]
            .float()
        )
        if self.recorder is not None:  # the fed token's experts, [B, 1, layers, k], at its index
            self.routes.index_copy_(1, self.step - 1, self.recorder.take(self.fed.shape[0], 1, to_host=False))
        self.position.add_(1)
        self.slot.add_(1)
        self._sample(logits)

    def decode_step(self) -> None:
        """One token for every row: the CUDA graph's replay once captured, else eager (attention over the
        slots written so far and the fed token's: the prompt width + the tokens produced)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._forward_and_sample(self.width + self.produced)
            self.eager_steps += 1

    def _capture(self) -> None:
        """The decode step as a CUDA graph (after the eager warm-up steps); capturing runs nothing."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._forward_and_sample()
        self.graph = graph

    # ---- host checks ---------------------------------------------------------------------
    def host_check(self, produced: int) -> bool:
        """Bring the tokens since the last check to the host (one copy), match stop strings there, let
        finished rows leave the batch (compact_share); True when every row has ended."""
        lo = self.copied
        packed = torch.cat(  # [B, 2 * new + 2] in float64: token ids, log-probs, lengths, flags all exact
            [
                self.tokens[:, lo:produced].double(),
                self.logprobs[:, lo:produced].double(),
                self.lengths.double().unsqueeze(-1),
                self.stopped.double().unsqueeze(-1),
            ],
            dim=1,
        ).tolist()
        self.copied = produced
        new = produced - lo
        cut = []  # batch rows a stop string ended: done on the device too
        for b, (r, row) in enumerate(zip(self.active, packed)):
            length, stopped = int(row[-2]), bool(row[-1])
            for i in range(max(0, min(new, length - lo))):
                self.host_tokens[r].append(int(row[i]))
                self.host_logprobs[r].append(row[new + i])
                if self.sampling.stop and self.engine._hits_stop(self.host_tokens[r], self.sampling.stop):
                    self.finish[r] = "stop"
                    cut.append(b)
                    break
            if self.finish[r] is None and (stopped or length >= self.limits[r]):
                self.finish[r] = "stop" if stopped else "length"
        if all(f is not None for f in self.finish):
            return True
        keep = [b for b, r in enumerate(self.active) if self.finish[r] is None]
        if len(self.active) - len(keep) >= max(1, int(len(self.active) * self.compact_share)):
            self._compact(keep)
        elif cut:
            self.done.index_fill_(0, torch.tensor(cut, device=self.device), True)
        return False

    def _compact(self, keep: list[int]) -> None:
        """Only the batch rows `keep` go on: every per-row tensor and the cache index-selected (new
        shapes, so a captured graph is captured again, after warm-up steps as the first was)."""
        index = torch.tensor(keep, device=self.device)
        if self.recorder is not None:  # the leaving rows' routes, to the host now
            gone = [b for b in range(len(self.active)) if b not in set(keep)]
            routes = self.routes.index_select(0, torch.tensor(gone, device=self.device)).cpu()
            for b, leaving in zip(gone, routes):
                self.host_routes[self.active[b]] = leaving
            self.routes = self.routes.index_select(0, index)
        for name in ("greedy", "temperature", "keys", "limit", "tokens", "logprobs", "lengths", "stopped", "done"):
            setattr(self, name, getattr(self, name).index_select(0, index))
        self.fed, self.position = self.fed.index_select(0, index), self.position.index_select(0, index)
        self.prompt_mask = self.prompt_mask.index_select(0, index)
        self._keep_cache_rows(index)
        if self.additive_mask is not None:  # every row the same
            self.additive_mask = self.additive_mask[: len(keep)]
        self.active = [self.active[b] for b in keep]
        if self.graph is not None:  # captured again after eager warm-up steps at the new batch size
            self.graph, self.eager_steps = None, 0

    def _keep_cache_rows(self, index: torch.Tensor) -> None:
        """The static cache of every layer keeps only the batch rows `index` (ascending): one gather for all
        layers' K and one for their V. CPU: the slots written so far (the prompt and every fed token; the rest
        stays hidden by the mask until written) moved to the front of the same storage (a fresh copy of the
        cache costs page faults there); CUDA: a fresh copy (the caching allocator reuses blocks)."""
        if self.device.type == "cpu":
            rows, written = index.numel(), self.width + self.produced - 1
            for storage in self.kv:  # [layers, B, heads, length, head_dim]
                storage[:, :rows, :, :written] = storage[:, index, :, :written]
            self.kv = [storage[:, :rows] for storage in self.kv]
        else:
            self.kv = [storage.index_select(1, index) for storage in self.kv]
        for k, layer in enumerate(self.cache.layers):
            layer.attach(self.kv[0][k], self.kv[1][k])

    # ---- the wave ------------------------------------------------------------------------
    def run(self) -> list[Completion]:
        self._sample(self._prefill())
        self.produced = 1  # tokens sampled per row (the host's count: no sync)
        check = next_check(0)
        while True:
            if self.produced in (check, self.longest):
                if self.host_check(self.produced) or self.produced == self.longest:
                    break
                check = next_check(self.produced)
            if self.use_graph and self.graph is None and self.eager_steps >= GRAPH_AFTER:
                self._capture()  # once per wave and batch size (it synchronises: torch.cuda.graph does)
            self.decode_step()
            self.produced += 1
        return self._completions()

    def _completions(self) -> list[Completion]:
        if self.recorder is not None:  # [B, longest, layers, k] of the rows still in the batch
            for r, routes in zip(self.active, self.routes.cpu()):
                self.host_routes[r] = routes
        out = []
        for r in range(self.rows):
            experts = None
            if self.recorder is not None:  # the prompt's tokens, then every generated token but the last
                fed = self.host_routes[r][: len(self.host_tokens[r]) - 1]
                experts = torch.cat([self.prompt_routes[self.row_prompt[r]], fed])
            out.append(
                Completion(
                    token_ids=self.host_tokens[r],
                    logprobs=self.host_logprobs[r],
                    finish_reason=self.finish[r] or "length",
                    routed_experts=experts,
                )
            )
        return out
