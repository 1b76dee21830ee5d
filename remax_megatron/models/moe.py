"""Mixture-of-experts pieces the trainer owns, read off megatron's routers by forward hooks: the
load-balancing loss with the policy loss's global normalisation, and the experts' load.

    balance = LoadBalancing(actor, kind="aux", coef=1e-3, groups=groups)
    balance.begin_update(global_tokens, global_sequences)   # before each optimizer update
    ... megatron's forward-backward schedule (the hooks add the loss's gradient) ...
    metrics = balance.end_update()   # {"moe/aux_loss": ..., "moe/expert_load": ...}, every rank

The loss (the switch / GShard form, megatron's `switch_load_balancing_loss_func`), per MoE layer,
over the valid (non-padding) tokens T of a micro-batch, E experts, k per token:

    aux = E * sum_e f_e * P_e,    f_e = |tokens routed to e| / (k |T|),   P_e = mean_{t in T} softmax(logits_t)_e

kind "aux": the update's loss is the token-weighted mean over its micro-batches and DP ranks,
sum_mb |T_mb| aux_mb / sum_mb |T_mb| (f and P are batch statistics: the same micro-batches give
the same loss whichever ranks run them). kind "seq_aux": the same per sequence, averaged over the
update's sequences (DeepSeek-V3's form; independent of the grouping). The trainer adds
coef * (sum over MoE layers) to the policy loss; `moe/aux_loss` logs the mean over layers (1.0 for a
perfectly balanced router). megatron's own aux loss is off (hf_config._moe_kwargs): its gradient
scale follows megatron's per-micro-batch token counts, not this trainer's global normalisation.

Each hook recomputes the router's logits from its input (one [tokens, hidden] x [hidden, experts]
GEMM, small beside the experts') so that P_e carries the router's gradient; with sequence
parallelism the counts are summed over TP and each rank's P covers its shard of the sequence. The
hooks act only in a training forward with gradients (so a fully recomputed layer counts once).

`moe/expert_load`: over the update's valid tokens, the most loaded expert's token count over the
mean count, the maximum over layers (1.0 = perfectly balanced). `moe/route_mismatch_frac` (routing replay
only): of the token-layers routed where the engine did, the fraction whose live router would have chosen
other experts (the train/inference routing mismatch the replay removed).

Routing replay (rollout.routing_replay; Rollout Routing Replay, R3): `replay_routes(model, routes)` hands
each router the experts the engine chose for the micro-batch's tokens (megatron's RouterReplay,
REPLAY_FORWARD): the forward routes every token there, with the probabilities the live router gives
those experts (renormalised as its routing does), so the router keeps its gradient. Positions the engine
gave no route (padding, the final token) get experts 0..k-1: their outputs are neither trained nor read.
`end_replay(model)` returns the routers to their own routing. `own_routes(model, batch)` records the
experts the model itself routes a batch's tokens to (the engine's side of the comparison).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from remax_megatron.parallel.layout import all_reduce_cpu
from remax_megatron.sizes import sequence_multiple

AUX_KINDS = ("aux", "seq_aux", "none")


class _AddLoss(torch.autograd.Function):
    """Returns `activation` unchanged; its backward also starts the backward of `loss` (gradient 1):
    how a loss computed inside a layer joins the step's loss wherever the layer sits in the pipeline."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return activation

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def has_dense_layers(config) -> bool:
    """Whether a MoE TransformerConfig has dense layers among the routed ones (megatron's moe_layer_freq
    list: 0 dense, 1 MoE; DeepSeek-style first dense layers)."""
    return bool(config.num_moe_experts) and isinstance(config.moe_layer_freq, list) and 0 in config.moe_layer_freq


def stage_layer_specs(config, spec, pp_rank: int | None) -> list:
    """The layer specs of pipeline stage `pp_rank` (None: megatron's global PP rank) from the local spec
    `spec` of a layer: `spec` itself for every layer, except that layers moe_layer_freq marks dense get
    megatron's local dense MLP (ColumnParallel fc1, RowParallel fc2) in place of the routed one."""
    import dataclasses

    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    count = get_num_layers_to_build(config, pp_rank=pp_rank)
    if not has_dense_layers(config):
        return [spec] * count
    dense_mlp = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=None).submodules.mlp
    dense = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=dense_mlp))
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    return [spec if config.moe_layer_freq[offset + i] else dense for i in range(count)]


def freeze_expert_bias(model) -> None:
    """Stop megatron's routers counting tokens per expert for their correction bias (its aux-loss-free
    update, off here: hf_config._moe_kwargs says why). The bias still steers the routing. megatron-core
    0.16.1's counting also breaks under a padding mask (it ands the [tokens] mask with the [tokens, experts]
    routing map)."""
    for router in routers(model):
        router.enable_expert_bias = False


def routers(model) -> list:
    """megatron's TopKRouter modules of `model`, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class LoadBalancing:
    """Forward hooks on every router of `model`; see the module docstring."""

    def __init__(self, model, kind: str, coef: float, tp_group, dp_group, pp_group):
        if kind not in AUX_KINDS:
            raise ValueError(f"algo.moe_aux_loss={kind!r} is not one of {', '.join(AUX_KINDS)}")
        self.kind, self.coef = kind, float(coef)
        self.tp_group = tp_group if dist.get_world_size(tp_group) > 1 else None
        self.dp_group, self.pp_group = dp_group, pp_group
        self.routers = routers(model)
        self.num_layers = routed_layers(model.config)  # DeepSeek-style models start with dense layers
        self._norm: float | None = None  # 1 / global tokens ("aux") or sequences ("seq_aux")
        self._segments: torch.Tensor | None = None  # packed rows: the sequence of each token [b, s], -1 padding
        self._aux = torch.zeros(len(self.routers), dtype=torch.float64)  # this rank's weighted share per layer
        self._counts = torch.zeros(len(self.routers), model.config.num_moe_experts, dtype=torch.float64)
        self._replayed = torch.zeros(2, dtype=torch.float64)  # replayed token-layers: [live router differs, all]
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(index))

    @property
    def active(self) -> bool:
        return self.kind != "none" and self.coef > 0

    def begin_update(self, global_tokens: float, global_sequences: float) -> None:
        """The update's normalisation: valid tokens (aux) or sequences (seq_aux) over every DP rank."""
        self._norm = 1.0 / max(global_sequences if self.kind == "seq_aux" else global_tokens, 1.0)
        self._aux.zero_()
        self._counts.zero_()
        self._replayed.zero_()

    def set_sequences(self, segments: torch.Tensor | None) -> None:
        """The next forward's packed rows: which sequence each token belongs to ([b, s], -1 padding; None:
        one sequence per row), for seq_aux. Set right before the forward: a full recompute would route
        later, which startup refuses together with packing."""
        self._segments = segments

    def end_update(self) -> dict[str, float]:
        """The update's load-balancing loss (mean over layers) and expert load, the same on every rank."""
        # CPU statistics; all_reduce_cpu carries them through the GPU where the groups are NCCL
        aux, counts, replayed = self._aux, self._counts, self._replayed
        if self.tp_group is not None:  # each TP rank's share of the loss covers its sequence shard
            aux = all_reduce_cpu(aux, group=self.tp_group)
            replayed = all_reduce_cpu(replayed, group=self.tp_group)
        if dist.get_world_size(self.dp_group) > 1:
            aux = all_reduce_cpu(aux, group=self.dp_group)
            counts = all_reduce_cpu(counts, group=self.dp_group)
            replayed = all_reduce_cpu(replayed, group=self.dp_group)
        total = aux.sum().reshape(1)
        load = counts.max(-1).values / counts.mean(-1).clamp(min=1e-12) if len(self.routers) else torch.zeros(1)
        load = load.max().reshape(1) if counts.sum() > 0 else torch.zeros(1, dtype=torch.float64)
        if dist.get_world_size(self.pp_group) > 1:  # each stage holds its own layers
            total = all_reduce_cpu(total, group=self.pp_group)
            load = all_reduce_cpu(load, op=dist.ReduceOp.MAX, group=self.pp_group)
            replayed = all_reduce_cpu(replayed, group=self.pp_group)
        self._norm = None
        metrics = {"moe/aux_loss": total.item() / self.num_layers, "moe/expert_load": load.item()}
        if replayed[1] > 0:  # routing replay: how often the live router would have chosen other experts
            metrics["moe/route_mismatch_frac"] = (replayed[0] / replayed[1]).item()
        return metrics

    def total_loss(self, metrics: dict[str, float]) -> float:
        """What the update added to the loss: coef * sum over layers."""
        return self.coef * metrics["moe/aux_loss"] * self.num_layers if self.active else 0.0

    # ---- the hook ----------------------------------------------------------------------------
    def _hook(self, index: int):
        def hook(router, args, output):
            if not (router.training and torch.is_grad_enabled()) or self._norm is None:
                return None
            hidden = args[0]
            padding = args[1] if len(args) > 1 else None
            probs, routing_map = output  # [T, E] each, T = local s x b (s-major)
            valid = (
                torch.ones(routing_map.shape[0], dtype=torch.bool, device=routing_map.device)
                if padding is None
                else ~padding.reshape(-1)
            )  # [T]
            counts = (routing_map & valid[:, None]).sum(0).double()  # [E], this rank's shard
            if self.tp_group is not None:
                dist.all_reduce(counts, group=self.tp_group)
            self._counts[index] += counts.cpu()
            given = getattr(router, "replay_given", None)
            if given is None and not self.active:
                return None
            logits = router.gating(hidden).reshape(routing_map.shape)  # [T, E], one GEMM
            if given is not None:
                self._replayed += _live_differs(logits.detach(), router.topk, routing_map, given & valid).cpu()
            if not self.active:
                return None
            loss = self._loss(router, hidden, logits, valid, routing_map)
            self._aux[index] += loss.detach().double().cpu() / self.coef
            # fp16 scales the policy loss's gradient (megatron's grad_scale_func): the same here
            scale = router.config.grad_scale_func
            scaled = loss * scale(torch.ones((), device=loss.device)) if scale is not None else loss
            return _AddLoss.apply(probs, scaled.to(probs.dtype)), routing_map

        return hook

    def _loss(self, router, hidden, logits, valid, routing_map) -> torch.Tensor:
        """coef * this rank's share of the layer's weighted load-balancing loss (differentiable in the
        router's weight through the recomputed logits [T, E])."""
        experts, k = routing_map.shape[1], router.topk
        if router.score_function == "sigmoid":  # DeepSeek-V3's form: sigmoid scores normalised per token
            scores = torch.sigmoid(logits.float())
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)  # [T, E]
        else:
            scores = torch.softmax(logits.float(), dim=-1)  # [T, E]
        scores = scores * valid[:, None]
        routed = (routing_map & valid[:, None]).float()
        if self.kind == "aux":
            stats = torch.stack([routed.sum(0), valid.sum().float().expand(experts)])  # [2, E]
            if self.tp_group is not None:
                dist.all_reduce(stats, group=self.tp_group)
            counts, tokens = stats[0], stats[1, 0]
            aux = experts * (counts * scores.sum(0)).sum() / (k * tokens * tokens).clamp(min=1.0)
            # token-weighted: this micro-batch's tokens over the update's
            return self.coef * aux * tokens * self._norm
        sequence, count = self._token_sequences(router, hidden)  # seq_aux: per sequence; [T], int
        keep = (sequence >= 0)[:, None]
        sequence = sequence.clamp(min=0)
        stats = torch.zeros(count, experts + 1, device=routed.device).index_add(
            0, sequence, torch.cat([routed, valid.float()[:, None]], dim=1) * keep
        )  # [n, E + 1]
        if self.tp_group is not None:
            dist.all_reduce(stats, group=self.tp_group)
        counts, tokens = stats[:, :experts], stats[:, experts]
        shares = torch.zeros(count, experts, device=scores.device, dtype=scores.dtype).index_add(
            0, sequence, scores * keep
        )  # [n, E]
        aux = experts * (counts * shares).sum(-1) / (k * tokens * tokens).clamp(min=1.0)  # [n]
        return self.coef * aux[tokens > 0].sum() * self._norm

    def _token_sequences(self, router, hidden) -> tuple[torch.Tensor, int]:
        """The sequence of each of the router's tokens ([s_local * b], s-major as megatron flattens them; -1
        for padding) and the number of sequences: each row's column, or the packed rows' segments."""
        s_local, b = hidden.shape[0], hidden.shape[1]
        if self._segments is None:
            return torch.arange(b, device=hidden.device).repeat(s_local), b
        segments = self._segments.to(hidden.device)
        if self.tp_group is not None and router.config.sequence_parallel:
            tp, rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
            s = segments.shape[1]
            segments = segments[:, rank * s // tp : (rank + 1) * s // tp]
        return segments.transpose(0, 1).reshape(-1), int(self._segments.max()) + 1


def _live_differs(logits, topk: int, routing_map, given) -> torch.Tensor:
    """[tokens whose replayed experts the live router would not have chosen, replayed tokens] among
    `given` [T]: the live choice is the top-k of the router's logits [T, E] (softmax and pre-softmax routers
    pick the same set)."""
    live = torch.zeros_like(routing_map).scatter(1, logits.topk(topk, dim=-1).indices, True)
    differs = (live != routing_map).any(-1) & given
    return torch.stack([differs.sum(), given.sum()]).double()


def padding_mask(
    model, input_ids: torch.Tensor, lengths: torch.Tensor | None = None, *, padding: torch.Tensor | None = None
) -> torch.Tensor:
    """[b, s] True past each row's length (right padding), or `padding` as given (packed rows: where no
    sequence sits), as megatron's MoE routing reads it.

    megatron's GPTModel splits it over the sequence for sequence parallelism on the first pipeline
    stage only; the later stages get their TP rank's slice here."""
    b, s = input_ids.shape
    mask = (
        padding.to(input_ids.device)
        if padding is not None
        else torch.arange(s, device=input_ids.device)[None, :] >= lengths.to(input_ids.device)[:, None]
    )
    config = model.config
    if config.sequence_parallel and not model.pre_process:
        tp, rank = model.tp_group.size(), model.tp_group.rank()
        mask = mask[:, rank * s // tp : (rank + 1) * s // tp]
    return mask


def routed_layers(config) -> int:
    """How many decoder layers route over experts (all but DeepSeek-style dense first layers)."""
    freq = config.moe_layer_freq
    return sum(freq) if isinstance(freq, list) else config.num_layers


def replay_routes(model, routes: torch.Tensor) -> None:
    """routes [b, s, layers, top_k] (global layer index, as vLLM lays them out; -1 where none was given, and
    at dense layers) -> this stage's routers route the micro-batch's tokens there (their [s_local * b, top_k]
    token order; sequence-parallel shard)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    b, s, _, k = routes.shape
    filled = torch.where(routes < 0, torch.arange(k, device=routes.device), routes)
    given = (routes >= 0).all(-1)  # [b, s, layers]
    if model.config.sequence_parallel:
        tp, rank = model.tp_group.size(), model.tp_group.rank()
        filled = filled[:, rank * s // tp : (rank + 1) * s // tp]
        given = given[:, rank * s // tp : (rank + 1) * s // tp]
    for router in routers(model):
        if router.router_replay is None:
            raise RuntimeError("routing replay: the model was built without moe_enable_routing_replay")
        layer = router.layer_number - 1  # megatron's layer numbers are global and 1-based
        router.router_replay.clear_indices()
        router.router_replay.set_target_indices(filled[:, :, layer].transpose(0, 1).reshape(-1, k).contiguous())
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        router.replay_given = given[:, :, layer].transpose(0, 1).reshape(-1)  # [s_local * b]: an engine route


def end_replay(model) -> None:
    for router in routers(model):
        if router.router_replay is not None:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
        router.replay_given = None


@torch.no_grad()
def own_routes(model, batch: dict) -> torch.Tensor:
    """The experts `model` itself routes every token of `batch` (`input_ids` [B, S], `lengths` [B]) to,
    [B, S, layers, top_k] long on every rank, -1 where an engine feeds no token (each row's last token and
    padding) and at dense layers, as an engine's routes are laid out (megatron's RouterReplay, RECORD; the
    model must be built with routing replay). Pipeline stages exchange their layers' routes."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from remax_megatron.models.forward import forward_only

    b, s = batch["input_ids"].shape
    for router in routers(model):
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    forward_only(model, [{"input_ids": batch["input_ids"]}], lambda _model, _hidden, _batch: None)
    device = next(model.parameters()).device  # the groups' device (NCCL)
    routes = torch.zeros((b, s, model.config.num_layers, model.config.moe_router_topk), dtype=torch.long, device=device)
    tp = sequence_multiple(model.tp_group.size(), model.config.sequence_parallel)  # sequence shards
    for router in routers(model):  # this stage's layers, stored + 1 so that the other stages' stay 0
        recorded = router.router_replay.get_recorded_indices().view(s // tp, b, -1)  # [s / tp, b, top_k]
        if tp > 1:  # sequence parallel: each TP rank routed its shard of the sequence
            shards = [torch.empty_like(recorded) for _ in range(tp)]
            dist.all_gather(shards, recorded.contiguous(), group=model.tp_group)
            recorded = torch.cat(shards)
        routes[:, :, router.layer_number - 1] = recorded.transpose(0, 1) + 1
    end_replay(model)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(routes, group=ps.get_pipeline_model_parallel_group())
    routes = routes.cpu() - 1
    fed = torch.arange(s)[None, :] < (batch["lengths"] - 1)[:, None]
    routes[~fed] = -1
    return routes
