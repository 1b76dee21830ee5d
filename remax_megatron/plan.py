"""Layout and memory planner: will this config fit on these GPUs? No GPU needed.

    python -m remax_megatron.plan --config FILE --nodes 1 --gpus-per-node 8 --gpu-mem-gib 80 actor.tp=2
    python -m remax_megatron.plan --config FILE --nodes 2 --gpus-per-node 8 --json     # bytes, for scripts

It runs the trainer's own layout and batch checks (Config.check_world with the
batch divisibility, check_layout, rollout.tp vs KV heads: the owners
remax_megatron/startup.py check_inputs calls) for world = nodes * gpus_per_node, then
prints a per-GPU memory estimate of every pipeline stage; the heaviest stage's
decides whether the job fits, and its rows are the ones printed. When it exceeds
the GPU it warns and suggests up to three changes that fit by their heaviest stage:
candidates (distributed optimizer, recompute, smaller micro-batch, larger TP, PP,
rollout TP, reward-model TP) are tried in a fixed order (fewest changed keys first,
then that key order, then the smallest step), and if nothing fits on this many
GPUs, the same search on 2x, 4x, ... GPUs.
Exit status: 0 fits, 1 does not fit (warning and suggestions printed), 2 bad input.

Closed-form estimate (bytes per GPU; every number is an upper-bound style
estimate, not a measurement):

    D hidden, F ffn, L layers, H heads, KV kv-heads, hd head dim,
    V vocab padded to a multiple of make_vocab_size_divisible_by * actor.tp
    P = V*D * (1 if tied else 2)                        embedding (+ output layer)
      + L * (D*H*hd + 2*D*KV*hd + H*hd*D [+ H*hd + 2*KV*hd qkv bias]    attention
             [+ 2*hd q/k norms] + 3*D*F + 2*D)          SwiGLU MLP, two RMSNorms
      + D                                               final norm
    (a reward model has a [1, D] score head instead of the output layer.) P is counted from the
    model family's tensor rules (models/families), the ones every load and export uses.

    MoE (actor.ep, actor.etp): P = P_dense + P_experts (every expert's fc1 and fc2), and the per-GPU
    share below is P_dense / (tp*pp) + P_experts / (ep*etp*pp); the distributed optimizer shards the
    experts' states over the expert-data-parallel ranks (tp*dp / (ep*etp)).

    P_s = the parameters one rank of pipeline stage s holds (stage_params): its TP shard of the
          matrices, the norms (and router) it replicates, the embedding on the first stage and the
          output layer on the last, its expert-parallel share of the experts (not P / (tp*pp))
    weights     = P_s * bytes(actor.dtype)              bf16/fp16: 2, fp32: 4
    gradients   = P_s * 4                               fp32 grad buffer (grad_reduce_in_fp32)
    optimizer   = P_s * 12                              fp32 main weights + Adam m, v
                  (8 with fp32 params: they are their own main weights)
                  / dp with optim.distributed_optimizer=true (the experts' part / expert-dp)

    seq        = data.max_prompt_tokens + rollout.max_new_tokens
    tokens     = trainer.micro_batch_size * seq                    per micro-batch
                 (trainer.micro_batch_tokens when set: the budget, padding included)
    per-token, per-layer activation elements:
        none      : 4*D/s + ((2*H + 2*KV)*hd + 3*F)/tp + H*seq/tp  (softmax probs kept)
        selective : 4*D/s + ((2*H + 2*KV)*hd + 3*F)/tp             (core attention recomputed)
        full      : D/s per layer, plus one layer's selective set while it is recomputed
      s = tp with actor.sequence_parallel, else 1 (norm in/outputs are replicated in TP)
      MoE: the MLP's 3*F/tp becomes 3*F_expert*k/etp (each token's k experts), plus the dispatcher's
      permuted copies of the token (2*k*D: the experts' input and output)
    activations = bytes(dtype) * tokens * (L/pp * per_layer [+ one layer, full]) * in_flight
      in_flight = min(pp - s, micro-batches per mini-batch)   (1F1B: stage s holds pp - s)
    logits naive = 4 * tokens * V/tp * 3                fp32 logits, softmax, grad (last stage)
    logits fused = 4 * min(tokens * V/tp, 2^24)         one fp32 vocab tile of the fused kernel (last stage)
    reference    = P_s * bytes(dtype)                   when reference.enabled (and no LoRA)
    LoRA (actor.lora_rank = r > 0): gradients and optimizer states count the adapters only, per layer
      on one rank: r * (D + (H + 2*KV)*hd/tp) + r * (H*hd/tp + D) for linear_qkv, linear_proj and
      r * (D + 2*F/tp) + r * (F/tp + D) for linear_fc1, linear_fc2 (whichever are targets), times L/pp;
      the adapters' weights are added to the actor's; no reference model
    reward model = its heaviest stage's P_s at reward.tp x reward.pp * bytes(dtype)   when reward.model
                   (its own layout: reward.tp*reward.pp divides actor.tp*actor.pp, each actor
                   model-parallel group holding replicas of it, or is a multiple of it spanning that
                   many actor model-parallel groups)
    engines      = world / rollout.tp, prompts per engine = ceil(prompts_per_step / engines)
    engine weights = P_hf / rollout.tp * bytes(dtype)   (P_hf: unpadded vocab)
    KV cache     = 2 * L * KV/rollout.tp * hd * prompts_per_engine * (n + 1) * seq * bytes(dtype)

A stage's total counts every row at once (actor, engine, reference, reward model all
resident: no offload), with the fused logits and the configured optimizer; the
estimate's total is the heaviest stage's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
import warnings

from remax_megatron.sizes import ceil_div, round_up, sequence_multiple

GIB = 1 << 30
TILE_ELEMS = 1 << 24  # remax_megatron/kernels/logprobs_torch.py DEFAULT_CHUNK_ELEMS
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@functools.cache  # the suggestion search asks again for the same layouts
def param_count(arch, vocab: int) -> int:
    """P of the module docstring for a causal LM or a reward model with this vocab size, counted from
    the model family's tensor rules (the weight mapping every load and export uses)."""
    from remax_megatron.weights.mapping import WeightMapping

    return WeightMapping(arch, tp=1, pp=1, padded_vocab=vocab).numel()


@functools.cache  # the suggestion search asks again for the same layouts
def expert_param_count(arch) -> int:
    """The experts' parameters of a MoE model (every expert's fc1 and fc2), 0 for a dense one."""
    from remax_megatron.weights.mapping import WeightMapping

    mapping = WeightMapping(arch, tp=1, pp=1, padded_vocab=arch.vocab_size)
    return sum(math.prod(shape) for s in mapping.specs if s.expert is not None for shape in s.shapes)


@functools.cache  # the suggestion search asks again for the same layouts
def active_param_count(arch, vocab: int) -> int:
    """Parameters one token passes through: P minus the experts it is not routed to (top_k of them)."""
    experts = expert_param_count(arch)
    return param_count(arch, vocab) - experts + (experts * arch.moe_top_k // arch.num_experts if experts else 0)


@functools.cache  # the suggestion search asks again for the same layouts
def stage_params(arch, vocab: int, tp: int, pp: int, ep: int = 1, etp: int = 0) -> tuple[tuple[int, int], ...]:
    """Per pipeline stage, the parameters one of its ranks holds, as (dense, experts): its TP shard of the
    matrices, the norms and router it replicates, the embedding on the first stage and the output layer
    on the last (a tied model's last stage holds its own copy), its expert-parallel share of the experts;
    from the model family's tensor rules (the weight mapping every load and export uses)."""
    from remax_megatron.weights.mapping import WeightMapping

    mapping = WeightMapping(arch, tp=tp, pp=pp, padded_vocab=vocab, ep=ep, etp=etp or tp)
    out = []
    for stage in range(pp):
        dense = expert = 0
        for spec in mapping.stage_specs(stage):
            if spec.expert is None:
                dense += math.prod(mapping.shard_shape(spec))
            else:  # every expert's spec is listed: this rank holds 1/ep of them
                expert += math.prod(mapping.shard_shape(spec)) // mapping.ep
        out.append((dense, expert))
    return tuple(out)


def heaviest_stage_params(arch, vocab: int, tp: int, pp: int, ep: int = 1, etp: int = 0) -> int:
    """Parameters per rank on the pipeline stage that holds the most (stage_params)."""
    return max(d + e for d, e in stage_params(arch, vocab, tp, pp, ep, etp))


def validate(cfg, arch, world: int, max_tp: int | None = None) -> dict:
    """The trainer's layout and batch checks for `world` processes; returns the derived sizes."""
    from remax_megatron.models.arch import expert_options
    from remax_megatron.models.hf_config import check_layout, check_run_length
    from remax_megatron.rollout.factory import check_rollout

    cfg.check_world(world)
    check_layout(arch, cfg.actor.tp, cfg.actor.pp, "actor", ep=cfg.actor.ep)
    expert_options(cfg, arch, this_machine=False)
    longest, how = cfg.longest_sequence()
    check_run_length(arch, longest, f"actor.model {cfg.actor.model}", how)
    check_rollout(cfg.rollout, arch, cfg.rollout_world(world), this_machine=False)
    if max_tp is not None and cfg.actor.tp > max_tp:
        # only for suggestions: TP across nodes is legal but far too slow to propose
        raise ValueError(f"actor.tp={cfg.actor.tp} exceeds {max_tp} GPUs per node")
    train_world = cfg.train_world(world)  # rollout.placement=separate: the rest run the engines
    dp = train_world // (cfg.actor.tp * cfg.actor.pp)  # batch divisibility is checked in cfg.check_world
    t = cfg.trainer
    local = t.prompts_per_step // dp * cfg.rollout.n
    # A token budget makes as many micro-batches as the lengths need: at most one row each (the bound used).
    per_micro = 1 if t.micro_batch_tokens else t.micro_batch_size
    return dict(
        world=world,
        train_world=train_world,
        rollout_world=cfg.rollout_world(world),
        dp=dp,
        seqs_per_rank=local,
        micro_batches=local // (t.mini_batches * per_micro),
    )


def lora_adapter_params(arch, actor) -> int:
    """LoRA adapter parameters one TP rank holds over all layers (0 without LoRA): a column-parallel target
    keeps A [r, in] whole and B [out/tp, r] split, a row-parallel one A [r, in/tp] split and B [out, r] whole."""
    r, tp = actor.lora_rank, actor.tp
    if not r:
        return 0
    d, hd, h, kv, f = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.ffn_hidden_size
    per_target = {
        "linear_qkv": r * (d + (h + 2 * kv) * hd / tp),
        "linear_proj": r * (h * hd / tp + d),
        "linear_fc1": r * (d + 2 * f / tp),
        "linear_fc2": r * (f / tp + d),
    }
    if arch.is_mla:  # column parallel, the down projections too (their output rows split over TP)
        nope, rope, v, q_lora, kv_lora = (
            arch.qk_head_dim,
            arch.qk_pos_emb_head_dim,
            arch.v_head_dim,
            arch.q_lora_rank or 0,
            arch.kv_lora_rank,
        )
        per_target.update(
            linear_proj=r * (h * v / tp + d),
            linear_q_proj=r * (d + h * (nope + rope) / tp),
            linear_q_down_proj=r * (d + q_lora / tp),
            linear_q_up_proj=r * (q_lora + h * (nope + rope) / tp),
            linear_kv_down_proj=r * (d + (kv_lora + rope) / tp),
            linear_kv_up_proj=r * (kv_lora + h * (nope + v) / tp),
        )
    return int(arch.num_layers * sum(per_target[t] for t in actor.lora_targets))


def activation_elements(cfg, arch, seq: int) -> float:
    """Activation elements one token keeps over the layers of one pipeline stage during the backward (the
    module docstring's per_token: recompute none / selective / full; MoE's experts and dispatch)."""
    a, tp, pp = cfg.actor, cfg.actor.tp, cfg.actor.pp
    etp = a.etp or tp
    d, hd, h, kv, f = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.ffn_hidden_size
    s = sequence_multiple(tp, a.sequence_parallel)
    routed = 3 * arch.moe_ffn_hidden_size * arch.moe_top_k / etp + 2 * arch.moe_top_k * d
    routed += 3 * arch.moe_shared_ffn_hidden_size / tp  # shared experts: a dense MLP over TP
    # per layer, averaged over the routed and the (DeepSeek-style first) dense layers
    mlp = (arch.moe_layers * routed + (arch.num_layers - arch.moe_layers) * 3 * f / tp) / arch.num_layers
    selective = 4 * d / s + (2 * h + 2 * kv) * hd / tp + mlp
    layers = arch.num_layers // pp
    if a.recompute == "none":
        return layers * (selective + h * seq / tp)
    if a.recompute == "selective":
        return layers * selective
    return layers * d / s + selective


def rollout_memory(cfg, arch, sizes: dict, seq: int, nbytes: int) -> tuple[int, int, int, float, float]:
    """(engines, prompts per engine, sequences per engine, KV-cache bytes, engine weight bytes) of one
    rollout engine's rank."""
    engines = sizes["rollout_world"] // cfg.rollout.tp
    per_engine = ceil_div(cfg.trainer.prompts_per_step, engines)
    kv_cache = arch.num_layers * _kv_cache_per_token(cfg, arch) * per_engine * (cfg.rollout.n + 1) * seq * nbytes
    seqs = per_engine * (cfg.rollout.n + 1)
    engine_weights = param_count(arch, arch.vocab_size) / cfg.rollout.tp * nbytes
    return engines, per_engine, seqs, kv_cache, engine_weights


def _kv_cache_per_token(cfg, arch) -> float:
    """KV-cache elements one token keeps per layer on one rollout rank: k and v of its KV heads; with
    multi-latent attention the latent and the shared rope key (kv_lora + rope, on every TP rank), which
    vLLM and transformers 5's model (the native engine: keys [B, 1, s, kv_lora], values [B, 1, s, rope])
    both cache."""
    if getattr(arch, "is_mla", False):
        return arch.kv_lora_rank + arch.qk_pos_emb_head_dim
    return 2 * arch.num_kv_heads / cfg.rollout.tp * arch.head_dim


def reward_model_bytes(cfg, rm_arch, nbytes: int) -> int:
    """The reward model's weights on its heaviest pipeline stage at reward.tp x reward.pp (0 without one)."""
    from remax_megatron.models.hf_config import check_layout, padded_vocab_size

    if rm_arch is None:
        return 0
    check_layout(rm_arch, cfg.reward.tp, cfg.reward.pp, "reward")
    rm_vocab = padded_vocab_size(rm_arch.vocab_size, cfg.reward.tp, cfg.actor.make_vocab_size_divisible_by)
    return heaviest_stage_params(rm_arch, rm_vocab, cfg.reward.tp, cfg.reward.pp) * nbytes


def _actor_rows(cfg, dense: int, expert: int, adapters: int, dp: int, expert_dp: int, nbytes: int) -> list[tuple]:
    """The weights, gradients and optimizer rows (key, label, bytes, counted) of one rank of a stage holding
    `dense` + `expert` parameters (LoRA: `adapters` per rank, the only trainable ones)."""
    held = dense + expert
    state = 12 if nbytes < 4 else 8
    # LoRA: the adapters are the only trainable parameters (gradients, optimizer); the base stays as it is.
    trained, dense_trained, expert_trained = (adapters, adapters, 0) if adapters else (held, dense, expert)
    return [
        ("weights", "actor weights" + (" (+ LoRA adapters)" if adapters else ""), (held + adapters) * nbytes, True),
        ("gradients", "actor gradients (fp32)" + (", adapters only" if adapters else ""), trained * 4, True),
        ("optimizer", "optimizer states", trained * state, not cfg.optim.distributed_optimizer),
        (
            "optimizer_distributed",
            "optimizer states, distributed (/dp)",
            (dense_trained / dp + expert_trained / expert_dp) * state,
            cfg.optim.distributed_optimizer,
        ),
    ]


def estimate(cfg, arch, rm_arch, sizes: dict) -> dict:
    """Per-GPU bytes of every row in the module docstring, on each pipeline stage; the rows and the total
    are the heaviest stage's (`counted` rows sum to the total): what decides whether the job fits."""
    a, tp, pp = cfg.actor, cfg.actor.tp, cfg.actor.pp
    from remax_megatron.models.hf_config import padded_vocab_size

    vocab = padded_vocab_size(arch.vocab_size, tp, a.make_vocab_size_divisible_by)
    params = param_count(arch, vocab)
    experts = expert_param_count(arch)
    ep, etp = a.ep, a.etp or tp
    nbytes = DTYPE_BYTES[a.dtype]
    expert_dp = tp * sizes["dp"] // (ep * etp)

    seq, _ = cfg.longest_sequence()
    tokens = cfg.trainer.micro_batch_tokens or cfg.trainer.micro_batch_size * seq
    per_token = activation_elements(cfg, arch, seq)
    v_local = vocab / tp

    separate = cfg.rollout.placement == "separate"  # the engines live on their own ranks, not beside the actor
    engines, per_engine, seqs, kv_cache, engine_weights = rollout_memory(cfg, arch, sizes, seq, nbytes)
    adapters = lora_adapter_params(arch, a) // pp  # per rank of a stage (layers split evenly)
    reference = cfg.reference.enabled and not a.lora_rank  # a LoRA actor is its own reference
    rm_bytes = reward_model_bytes(cfg, rm_arch, nbytes)
    stages = []
    for stage, (dense, expert) in enumerate(stage_params(arch, vocab, tp, pp, ep, etp)):
        held = dense + expert
        # 1F1B: stage k holds the activations of min(pp - k, micro-batches) micro-batches; the last holds the logits
        in_flight = min(pp - stage, sizes["micro_batches"])
        last = stage == pp - 1
        # (key, label, bytes, counted in the total)
        rows = _actor_rows(cfg, dense, expert, adapters, sizes["dp"], expert_dp, nbytes) + [
            (
                "activations",
                f"activations (recompute={a.recompute}, x{in_flight} in flight)",
                nbytes * tokens * per_token * in_flight,
                True,
            ),
            ("logits_naive", "logits, naive (fp32 x3)", 4 * tokens * v_local * 3 if last else 0, False),
            (
                "logits_fused",
                "logits, fused (one vocab tile)",
                4 * min(tokens * v_local, TILE_ELEMS) if last else 0,
                last,
            ),
            ("reference", "reference weights", held * nbytes if reference else 0, reference),
            ("reward_model", "reward model weights", rm_bytes, rm_arch is not None),
            ("engine_weights", "rollout engine weights", engine_weights, not separate),
            ("kv_cache", f"rollout KV cache ({seqs} seqs x {seq} tokens)", kv_cache, not separate),
        ]
        rows = [dict(key=k, name=n, bytes=int(round(b)), counted=c) for k, n, b, c in rows]
        stages.append(
            dict(stage=stage, params=held, rows=rows, total_bytes=sum(r["bytes"] for r in rows if r["counted"]))
        )
    heaviest = max(stages, key=lambda st: st["total_bytes"])
    # rollout.placement=separate: a rollout rank holds its engine's share and one received sync bucket
    rollout_rows = (
        [
            dict(key=k, name=n, bytes=int(round(b)), counted=True)
            for k, n, b in (
                ("engine_weights", "rollout engine weights", engine_weights),
                ("kv_cache", f"rollout KV cache ({seqs} seqs x {seq} tokens)", kv_cache),
                ("sync_bucket", "weight-sync receive bucket", cfg.rollout.sync_bucket_mb * 2**20),
            )
        ]
        if separate
        else []
    )
    rollout_total = sum(r["bytes"] for r in rollout_rows)
    return dict(
        params=params,
        padded_vocab=vocab,
        seq_len=seq,
        engines=engines,
        prompts_per_engine=per_engine,
        rows=heaviest["rows"],
        train_bytes=heaviest["total_bytes"],
        rollout_rows=rollout_rows,
        rollout_bytes=rollout_total,
        total_bytes=max(heaviest["total_bytes"], rollout_total),
        heaviest_stage=heaviest["stage"],
        heaviest_stage_params=max(st["params"] for st in stages),
        stage_totals=[st["total_bytes"] for st in stages],
        expert_params=experts,
        active_params=active_param_count(arch, vocab),
    )


# ---- suggestions -----------------------------------------------------------------------------


def _doublings(start: int, limit: int) -> list[int]:
    out, v = [], start * 2
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _choices(cfg, arch, gpus_per_node: int) -> list[tuple[str, list]]:
    """Per key, the values to try after the current one, in the fixed priority order."""
    halves, m = [], cfg.trainer.micro_batch_size
    while m > 1:
        m //= 2
        halves.append(m)
    batch_key = "trainer.micro_batch_size"
    if cfg.trainer.micro_batch_tokens:  # the budget sizes the micro-batch: halve it, down to one longest row
        batch_key, halves, m = "trainer.micro_batch_tokens", [], cfg.trainer.micro_batch_tokens
        row = round_up(cfg.longest_sequence()[0], sequence_multiple(cfg.actor.tp, cfg.actor.sequence_parallel))
        while m // 2 >= row:
            m //= 2
            halves.append(m)
    recompute = (
        ["selective", "full"]
        if cfg.actor.recompute == "none"
        else ["full"]
        if cfg.actor.recompute == "selective"
        else []
    )
    return [
        ("optim.distributed_optimizer", [] if cfg.optim.distributed_optimizer else [True]),
        ("actor.recompute", recompute),
        (batch_key, halves),
        ("actor.tp", _doublings(cfg.actor.tp, gpus_per_node)),
        ("actor.pp", _doublings(cfg.actor.pp, arch.num_layers)),
        ("rollout.tp", _doublings(cfg.rollout.tp, min(gpus_per_node, arch.num_kv_heads))),
        ("actor.ep", _doublings(cfg.actor.ep, arch.num_experts) if arch.is_moe else []),
        ("reward.tp", _doublings(cfg.reward.tp, gpus_per_node) if cfg.reward.model else []),
    ]


def _apply(cfg, change: dict):
    """A copy of cfg with dotted keys changed (the reward model keeps its own layout: it still nests in
    an actor layout whose tp or pp doubled)."""
    sections = {}
    for key, value in change.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v) for s, v in sections.items()})


def search(cfg, arch, rm_arch, world: int, gpus_per_node: int, gpu_bytes: int):
    """The changes that fit on `world` GPUs by the heaviest pipeline stage, in order: fewest keys, then key
    priority, then smallest step (a generator of {change, total_bytes})."""
    choices = _choices(cfg, arch, gpus_per_node)
    # every key takes either its current value (index 0) or one of its candidate values
    options = [[None] + values for _, values in choices]
    combos = sorted(
        itertools.product(*[range(len(o)) for o in options]),
        key=lambda idx: (sum(i > 0 for i in idx), [-(i > 0) for i in idx], sum(idx), idx),
    )
    for idx in combos:
        change = {choices[k][0]: options[k][i] for k, i in enumerate(idx) if i}
        if not change:
            continue
        try:
            cand = _apply(cfg, change)
            est = estimate(cand, arch, rm_arch, validate(cand, arch, world, gpus_per_node))
        except ValueError:
            continue
        if est["total_bytes"] <= gpu_bytes:
            yield dict(change=change, total_bytes=est["total_bytes"])


def suggest(cfg, arch, rm_arch, nodes: int, gpus_per_node: int, gpu_bytes: int, count: int = 3) -> list[dict]:
    """Up to `count` changes on this many GPUs, else on the smallest multiple of the GPU count where one
    fits; each fits by its heaviest pipeline stage."""
    for factor in (1, 2, 4, 8, 16, 32, 64):
        g = gpus_per_node
        while factor > 1 and g * 2 <= max(8, gpus_per_node) and g * 2 <= gpus_per_node * factor:
            g *= 2  # fill nodes up to 8 GPUs before adding nodes
        n = nodes * gpus_per_node * factor // g
        found = []
        if factor > 1:
            try:
                est = estimate(cfg, arch, rm_arch, validate(cfg, arch, n * g, g))
                if est["total_bytes"] <= gpu_bytes:
                    found.append(dict(change={}, total_bytes=est["total_bytes"]))
            except ValueError:
                pass
        found += list(itertools.islice(search(cfg, arch, rm_arch, n * g, g, gpu_bytes), count - len(found)))
        if found:
            return [dict(hint, nodes=n, gpus_per_node=g) for hint in found]
    return []


# ---- report ----------------------------------------------------------------------------------


def _gib(b: float) -> str:
    return f"{b / GIB:8.2f}"


def _rm_placement(cfg) -> str:
    """Where the reward model runs relative to the actor's model-parallel groups (parallel/nested.py)."""
    actor, rm = cfg.actor.tp * cfg.actor.pp, cfg.reward.tp * cfg.reward.pp
    if actor % rm == 0:
        return f"{actor // rm} replica(s) per actor model-parallel group"
    return f"one replica over {rm // actor} actor model-parallel groups"


def render(
    cfg, arch, model_dir: str, nodes: int, gpn: int, gpu_bytes: int, sizes: dict, est: dict, hint: list[dict]
) -> str:
    a, t = cfg.actor, cfg.trainer
    heading = "per-GPU memory" + (
        f" (pipeline stage {est['heaviest_stage']} of {a.pp}, the heaviest)" if a.pp > 1 else ""
    )
    lines = [
        f"model: {arch.architecture} from {model_dir}: {est['params'] / 1e9:.2f} B params "
        f"(vocab {arch.vocab_size} padded to {est['padded_vocab']}), dtype {a.dtype}"
        + (
            f"; {arch.num_experts} experts, {arch.moe_top_k} per token: {est['active_params'] / 1e9:.2f} B active, "
            f"experts split over ep({a.ep}) * etp({a.etp or a.tp})"
            if arch.is_moe
            else ""
        ),
        f"layout: {nodes} node(s) x {gpn} GPUs = world {sizes['world']}; actor tp({a.tp}) * pp({a.pp}) * "
        f"dp({sizes['dp']}); rollout tp {cfg.rollout.tp} -> {est['engines']} engines"
        + (
            f" on {sizes['rollout_world']} separate rollout ranks ({sizes['train_world']} train)"
            if cfg.rollout.placement == "separate"
            else ""
        )
        + (
            f"; reward model tp({cfg.reward.tp}) * pp({cfg.reward.pp}), {_rm_placement(cfg)}"
            if cfg.reward.model
            else ""
        ),
        f"batch: {t.prompts_per_step} prompts/step -> {sizes['seqs_per_rank']} sequences per dp rank, "
        + (
            f"{t.mini_batches} mini-batch(es) x up to {sizes['micro_batches']} micro-batches of <= "
            f"{t.micro_batch_tokens} tokens, "
            if t.micro_batch_tokens
            else f"{t.mini_batches} mini-batch(es) x {sizes['micro_batches']} micro-batches of {t.micro_batch_size}, "
        )
        + f"seq {est['seq_len']} tokens",
        "",
        f"{heading:<58}{'GiB':>8}  counted",
    ]
    for r in est["rows"]:
        lines.append(f"  {r['name']:<56}{_gib(r['bytes'])}  {'yes' if r['counted'] else '-'}")
    lines.append(f"  {'total':<56}{_gib(est['train_bytes'])}  of {gpu_bytes / GIB:.2f} GiB")
    if est["rollout_rows"]:
        lines.append(f"{'per-GPU memory of a rollout rank (rollout.placement=separate)':<58}{'GiB':>8}")
        for r in est["rollout_rows"]:
            lines.append(f"  {r['name']:<56}{_gib(r['bytes'])}  yes")
        lines.append(f"  {'total':<56}{_gib(est['rollout_bytes'])}  of {gpu_bytes / GIB:.2f} GiB")
    if a.pp > 1:
        lines.append(
            "stages: "
            + ", ".join(f"{k}: {b / GIB:.2f}" for k, b in enumerate(est["stage_totals"]))
            + " GiB (the first holds the embedding and the most micro-batches in flight, the last the "
            "output layer and the logits)"
        )
    if cfg.rollout.engine == "vllm":
        rows = {r["key"]: r["bytes"] for r in est["rows"]}
        if cfg.rollout.kv_cache_gib > 0:
            if rows.get("kv_cache", 0) > cfg.rollout.kv_cache_gib * GIB:
                lines.append(
                    f"warning: the rollout's KV cache needs {rows['kv_cache'] / GIB:.2f} GiB but "
                    f"rollout.kv_cache_gib={cfg.rollout.kv_cache_gib}: raise it"
                )
        else:
            need = rows.get("engine_weights", 0) + rows.get("kv_cache", 0)
            budget = cfg.rollout.gpu_memory_utilization * gpu_bytes
            if need > budget:
                lines.append(
                    f"warning: the rollout needs {need / GIB:.2f} GiB but rollout.gpu_memory_utilization="
                    f"{cfg.rollout.gpu_memory_utilization} gives vLLM {budget / GIB:.2f} GiB: raise it"
                )
    if est["total_bytes"] > gpu_bytes:
        lines.append(
            f"warning: estimated {est['total_bytes'] / GIB:.2f} GiB per GPU exceeds the {gpu_bytes / GIB:.2f} GiB GPU"
        )
        lines += [f"suggestion: {describe(h, nodes, gpn)}" for h in hint] or [
            f"suggestion: {describe(None, nodes, gpn)}"
        ]
    else:
        lines.append(f"fits: {est['total_bytes'] / GIB:.2f} of {gpu_bytes / GIB:.2f} GiB per GPU")
    return "\n".join(lines)


def describe(hint: dict | None, nodes: int, gpn: int) -> str:
    if hint is None:
        return "nothing tried fits (up to 64x the GPUs): use GPUs with more memory or a smaller model"
    keys = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in hint["change"].items())
    fits = f"(estimated {hint['total_bytes'] / GIB:.2f} GiB per GPU on the heaviest pipeline stage)"
    if (hint["nodes"], hint["gpus_per_node"]) == (nodes, gpn):
        return f"{keys} {fits}"
    return f"--nodes {hint['nodes']} --gpus-per-node {hint['gpus_per_node']} {keys} {fits}".replace("  ", " ")


SHIPPED_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "models")


def largest_fitting(cfg, world: int, gpu_bytes: int, lora_rank: int = 16) -> dict:
    """The largest shipped model (configs/models, causal LMs) that fits per GPU at this config's layout and
    batch, with full fine-tuning and with LoRA (the config's actor.lora_rank, else `lora_rank`):
    {"full": (name, params) | None, "lora": ...}. A shape this layout cannot hold (heads, layers) is skipped."""
    from remax_megatron.models.hf_config import read_hf_config

    rank = cfg.actor.lora_rank or lora_rank
    best: dict = {"full": None, "lora": None}
    for name in sorted(os.listdir(SHIPPED_MODELS)):
        arch = read_hf_config(os.path.join(SHIPPED_MODELS, name))
        if arch.task != "causal_lm":
            continue
        for kind, r in (("full", 0), ("lora", rank)):
            cand = _apply(cfg, {"actor.lora_rank": r})
            try:
                est = estimate(cand, arch, None, validate(cand, arch, world))
            except ValueError:
                continue
            if est["total_bytes"] <= gpu_bytes and (best[kind] is None or est["params"] > best[kind][1]):
                best[kind] = (name, est["params"])
    best["lora_rank"] = rank
    return best


def largest_sentence(largest: dict) -> str:
    """The planner's last line: largest_fitting's answer as a sentence."""
    full, lora, with_lora = largest["full"], largest["lora"], f"with LoRA r={largest['lora_rank']}"
    where = "fits per GPU at this layout"
    if full is None and lora is None:
        return f"No shipped model (configs/models) {where}, with full fine-tuning or {with_lora}."
    if full is None:
        return (
            f"With full fine-tuning no shipped model (configs/models) {where}; {with_lora} the largest that "
            f"does is {_named(lora)}."
        )
    if lora is None:
        return (
            f"The largest shipped model (configs/models) that {where} is {_named(full)} with full fine-tuning; "
            f"none does {with_lora}."
        )
    return (
        f"The largest shipped model (configs/models) that {where} is {_named(full)} with full fine-tuning "
        f"and {_named(lora)} {with_lora}."
    )


def _named(found: tuple[str, int]) -> str:
    return f"{found[0]} ({found[1] / 1e9:.1f} B parameters)"


def plan(args) -> tuple[int, str]:
    from remax_megatron.config import load_config

    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.gpu_mem_gib <= 0:
        raise ValueError(f"--gpu-mem-gib={args.gpu_mem_gib} must be > 0")
    cfg = load_config(args.config, args.overrides)
    world = args.nodes * args.gpus_per_node
    cfg.check_world(world)  # cheap layout errors before the (slow) model read
    with warnings.catch_warnings():  # megatron/transformers import-time notices are not for the user here
        warnings.simplefilter("ignore")
        from remax_megatron.models.hf_config import read_hf_config
        from remax_megatron.builtin.models import resolve_model

        model_dir = resolve_model(cfg.actor.model, "actor.model", build=False)  # its config is enough
        arch = read_hf_config(model_dir)
        if arch.task != "causal_lm":
            raise ValueError(f"actor.model {model_dir} is a {arch.architecture}: the actor must be a *ForCausalLM")
        from remax_megatron.startup import check_reward_model

        _, rm_arch = check_reward_model(cfg)  # start-up's checks: its task, layout and run length
    sizes = validate(cfg, arch, world)
    est = estimate(cfg, arch, rm_arch, sizes)
    gpu_bytes = int(args.gpu_mem_gib * GIB)
    fits = est["total_bytes"] <= gpu_bytes
    hint = [] if fits else suggest(cfg, arch, rm_arch, args.nodes, args.gpus_per_node, gpu_bytes)
    largest = largest_fitting(cfg, world, gpu_bytes)
    if args.json:
        described = [describe(h, args.nodes, args.gpus_per_node) for h in hint]
        out = json.dumps(
            dict(
                sizes,
                **est,
                gpu_bytes=gpu_bytes,
                fits=fits,
                suggestions=described,
                largest_fitting=largest,
                suggestion=None if fits else (described or [describe(None, 0, 0)])[0],
            ),
            indent=1,
        )
    else:
        out = render(cfg, arch, model_dir, args.nodes, args.gpus_per_node, gpu_bytes, sizes, est, hint)
        out += "\n" + largest_sentence(largest)
    return (0 if fits else 1), out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m remax_megatron.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="YAML config (the one you will train with)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-mem-gib", type=float, default=80.0, help="memory of one GPU (GiB)")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON (bytes) instead")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. actor.tp=2")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the flags
    try:
        code, out = plan(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return code


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
