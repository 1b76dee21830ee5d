"""Megatron GPTModel builders: the actor, a frozen reference, and a reward model.

- `PolicyModel` (actor and reference): a GPTModel whose output layer returns the
  final hidden states instead of logits; log-probs (and entropy) come from the
  fused vocab-parallel kernel, so full [tokens, vocab] logits are never built in
  training. `full_logits` exists for parity checks and step-by-step decoding.
- `RewardModel`: the same trunk with a scalar head (HF `score.weight`), read at
  each sequence's rightmost token that is not the RM's pad id, as HF's
  *ForSequenceClassification does (`RewardModel.score_positions`).

Layer spec: Transformer Engine when it imports and CUDA is present, megatron's
local spec otherwise (CPU, GPUs without TE, LoRA), with torch SDPA as its core
attention (models/attention.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel, gpt_layer_specs
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from torch import nn

from remax_megatron import sizes
from remax_megatron.kernels import fused_logprobs
from remax_megatron.models.attention import TorchDotProductAttention, param_device
from remax_megatron.models.arch import DTYPES, ExpertOptions, LoraOptions, ModelArch, transformer_engine_usable
from remax_megatron.models.hf_config import padded_vocab_size, transformer_config
from remax_megatron.models.lora import apply_lora
from remax_megatron.models.moe import freeze_expert_bias, has_dense_layers, stage_layer_specs
from remax_megatron.parallel import cpu_compat
from remax_megatron.parallel.layout import SumGrad
from remax_megatron.parallel.nested import NestedGroups, nested_groups


class RMSNorm(nn.RMSNorm):
    """torch RMSNorm with megatron's norm signature, for the local (non-TE) spec.

    megatron's own torch wrapper refuses sequence parallel (its weight would miss the TP
    all-reduce of its gradient) and builds fp32 weights whatever params_dtype is. This one
    marks the weight `sequence_parallel` so finalize_model_grads sums its gradient over TP,
    and builds it in params_dtype on the parameters' device (a bf16 model is bf16 throughout,
    on one device, like the TE spec).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=param_device(config))
        self.weight.sequence_parallel = config.sequence_parallel


class HeadRMSNorm(RMSNorm):
    """The per-head query / key RMSNorm (Qwen3's q_norm / k_norm; megatron's q_layernorm / k_layernorm).

    Its input is never split over the sequence (attention sees whole sequences), so its weight is
    not marked sequence_parallel; each TP rank normalises its own heads with the same weight, and
    megatron's finalize_model_grads sums the weight's gradient over TP (config.qk_layernorm).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(config, hidden_size, eps=eps)
        self.weight.sequence_parallel = False


def layer_spec(config, pp_rank: int | None = None, local: bool = False):
    """Transformer Engine spec when usable (and not `local`), else the local (pure megatron-core) spec with
    RMSNorm above and the SDPA core attention (models/attention.py).

    Returns the block spec of pipeline stage `pp_rank` (default: megatron's global PP rank): its
    layers and the final norm. config.qk_layernorm (Qwen3) adds the per-head q/k norms.
    """
    moe = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm)
    if config.multi_latent_attention:
        return _mla_layer_spec(config, pp_rank, moe)
    if transformer_engine_usable() and not local:
        if has_dense_layers(config):  # megatron's own per-layer specs (its moe_layer_freq list)
            return gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True, pp_rank=pp_rank)
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm, **moe)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm, **moe)
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    # SDPA in place of megatron's unfused DotProductAttention (models/attention.py).
    spec.submodules.self_attention.submodules.core_attention = TorchDotProductAttention
    if config.qk_layernorm:
        # megatron's WrappedTorchNorm refuses sequence parallel and builds fp32 weights.
        spec.submodules.self_attention.submodules.q_layernorm = HeadRMSNorm
        spec.submodules.self_attention.submodules.k_layernorm = HeadRMSNorm
    return TransformerBlockSubmodules(layer_specs=stage_layer_specs(config, spec, pp_rank), layer_norm=RMSNorm)


def _mla_layer_spec(config, pp_rank: int | None, moe: dict):
    """Multi-latent attention (DeepSeek-V3): megatron-core's local spec with multi_latent_attention=True
    whatever is installed, SDPA core attention, and the q / kv latents' RMSNorms as RMSNorm above.

    Those norms run on the whole latent (the down projections are gathered over TP first), or on this rank's
    tokens under sequence parallelism: their weight gradient needs a sum over TP exactly when sequence
    parallel is on, which RMSNorm's `sequence_parallel` mark gives. The config leaves qk_layernorm off
    (mla.mla_config_kwargs): under it megatron-core 0.16.1's finalize_model_grads sums every parameter named
    `q_layernorm` over TP, sequence parallel or not, which would double the q-latent norm's (whole, already
    TP-reduced) gradient at TP > 1 without sequence parallel (that the raw gradient is whole there is
    tests/models/test_deepseek_v3.py's; a MoE model cannot train there: megatron's MoE layer refuses TP
    training without sequence parallel)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from remax_megatron.models.families.mla import patch_mla_for_cpu

    patch_mla_for_cpu()
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        normalization="RMSNorm", qk_layernorm=True, multi_latent_attention=True, **moe
    )
    assert spec.submodules.self_attention.module is MLASelfAttention
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = TorchDotProductAttention
    attention.q_layernorm = RMSNorm
    attention.kv_layernorm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=stage_layer_specs(config, spec, pp_rank), layer_norm=RMSNorm)


def reduce_mla_rope_key_grad(model) -> None:
    """Make the gradient of MLA's shared rope key whole over TP (megatron-core 0.16.1, local spec, TP > 1).

    The local spec's linear_kv_down_proj is column parallel; megatron all-gathers its [latent; rope key]
    output over TP and splits it, and the rope key then meets this rank's heads only. The gather's backward
    keeps this rank's columns of the gradient, so the rope columns' owner gets its own heads' part of the rope
    key's gradient, never the other ranks' (the latent's part is whole: linear_kv_up_proj's backward reduces
    it). Found by a TP2 update that differed from world 1's in kv_a_proj_with_mqa only.

    A forward hook on each linear_kv_down_proj hands megatron the whole output (the else branch of
    get_query_key_value_tensors, which TE's duplicated linear takes): gathered over TP, then under sequence
    parallelism split over the sequence again, where megatron's own sequence gather of the rope key
    reduce-scatters its gradient over TP; without sequence parallelism the rope key passes through
    parallel.layout.SumGrad, whose backward all-reduces it. Values are unchanged."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    for attention in (m for m in model.modules() if isinstance(m, MLASelfAttention)):
        proj = attention.linear_kv_down_proj
        if proj.tp_group.size() > 1:
            proj.register_forward_hook(_whole_kv_down_output(attention.config.kv_lora_rank))


def _whole_kv_down_output(kv_lora_rank: int):
    def hook(module, _args, output):
        out, bias = output  # [s, b, (kv_lora + rope) / tp]
        out = tensor_parallel.gather_from_tensor_model_parallel_region(out, group=module.tp_group)
        if module.sequence_parallel:
            return tensor_parallel.scatter_to_sequence_parallel_region(out, group=module.tp_group), bias
        latent, rope = out.split([kv_lora_rank, out.shape[-1] - kv_lora_rank], dim=-1)
        return torch.cat([latent, SumGrad.apply(rope, module.tp_group)], dim=-1), bias  # [s, b, kv_lora + rope]

    return hook


def _gpt_kwargs(
    arch: ModelArch, config, tp: int, divisible_by: int, layout: NestedGroups | None = None, local_spec: bool = False
) -> dict:
    """GPTModel arguments; `layout` places the model on explicit groups (None: megatron's global ones)."""
    pp_rank, pp = (
        (layout.pp_rank, layout.pp_size)
        if layout is not None
        else (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size())
    )
    return dict(
        transformer_layer_spec=layer_spec(config, pp_rank, local=local_spec),
        vocab_size=padded_vocab_size(arch.vocab_size, tp, divisible_by),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        pg_collection=layout.collection if layout is not None else None,
        parallel_output=True,
        position_embedding_type="yarn" if arch.yarn is not None and not arch.is_mla else "rope",
        rotary_base=int(arch.rope_theta),
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        rotary_percent=arch.rotary_percent,
    )


def _mark_tensor_parallel(model) -> None:
    """Set megatron's TP attributes on sharded weights when their init was skipped.

    megatron-core sets `tensor_model_parallel` / `partition_dim` only inside its
    weight-init functions, so with `perform_initialization=False` (weights loaded
    right after) grad-norm clipping would count TP shards as duplicates.
    """
    dims = {
        tensor_parallel.ColumnParallelLinear: 0,
        tensor_parallel.RowParallelLinear: 1,
        tensor_parallel.VocabParallelEmbedding: 0,
    }
    for module in model.modules():
        dim = next((d for cls, d in dims.items() if isinstance(module, cls)), None)
        weight = getattr(module, "weight", None)
        if dim is not None and weight is not None and not hasattr(weight, "tensor_model_parallel"):
            tensor_parallel.set_tensor_model_parallel_attributes(weight, True, dim, 1)


def _position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    # Sequences are right-padded, so every one starts at position 0.  # [b, s]
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)


class HiddenStatesOutputLayer(tensor_parallel.ColumnParallelLinear):
    """The output layer, minus the GEMM: hands the (sequence-gathered) hidden states on.

    Keeps its weight (`output_layer.weight`) so checkpoints and weight export see
    megatron's usual names; the log-prob kernel consumes that weight.
    """

    def forward(self, input_, weight=None, runtime_gather_output=None):  # noqa: ARG002 - megatron passes both
        if self.sequence_parallel:
            # The fused kernel all-reduces the hidden-state gradient over TP itself,
            # so the backward here only splits (tensor_parallel_output_grad=False).
            input_ = tensor_parallel.gather_from_sequence_parallel_region(
                input_, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return input_, None


class ScalarHead(nn.Module):
    """Reward head: [s, b, h] -> [s, b, 1], replicated on every TP rank (HF `score`)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool, tp_group, device):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group

    def forward(self, input_, weight=None, runtime_gather_output=None):  # noqa: ARG002 - megatron passes both
        if self.sequence_parallel:
            input_ = tensor_parallel.gather_from_sequence_parallel_region(input_, group=self.tp_group)
        return input_ @ self.weight.t(), None


class PolicyModel(GPTModel):
    """The actor / reference: GPTModel returning hidden states [b, s, h] on the last stage.

    Log-probs come from the fused vocab-parallel kernel (`token_logprobs`).
    """

    arch: ModelArch
    lora: LoraOptions | None  # the actor's adapters (models/lora.py); None: none

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Forward this stage: the first stage takes input_ids [b, s] (right-padded, or packed rows with
        their `attention_mask` / `packed_seq_params`: batching.model_inputs)."""
        return self(input_ids, _position_ids(input_ids), attention_mask=attention_mask, **kwargs)

    def output_weight(self) -> torch.Tensor:
        """This rank's shard of the (padded) vocab-parallel output weight: [V_padded / tp, h]."""
        return (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else self.output_layer.weight
        )

    def token_logprobs(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        grad_hint: torch.Tensor | None = None,
    ):
        """hidden [b, s, h], labels [b, s] (-100 ignored) -> (logprobs [b, s], entropy [b, s] | None).

        Vocab padding rows are left out of the softmax (valid_vocab), so these equal
        the HF model's / rollout engine's log-probs. grad_hint [b, s]: the loss's gradient w.r.t.
        the log-probs when known in advance (fused_logprobs).
        """
        b, s, h = hidden.shape
        logprobs, entropy = fused_logprobs(
            hidden.reshape(b * s, h),
            self.output_weight(),
            labels.reshape(b * s),
            temperature=temperature,
            tp_group=self.tp_group,
            with_entropy=with_entropy,
            valid_vocab=self.arch.vocab_size,
            grad_hint=grad_hint.reshape(b * s) if grad_hint is not None else None,
        )
        return logprobs.view(b, s), (entropy.view(b, s) if entropy is not None else None)

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [b, s, h] -> logits [b, s, vocab] gathered over TP (parity checks and decoding only)."""
        local = (hidden @ self.output_weight().t()).contiguous()  # [b, s, V_padded / tp]
        tp = dist.get_world_size(self.tp_group)
        parts = [local]
        if tp > 1:
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local, group=self.tp_group)
        return torch.cat(parts, dim=-1)[..., : self.arch.vocab_size]


class RewardModel(GPTModel):
    """Frozen reward model: the GPT trunk whose last stage returns per-token values [b, s, 1]."""

    arch: ModelArch
    layout: NestedGroups  # its TP x PP groups inside the actor's model-parallel group

    run = PolicyModel.run

    @staticmethod
    def score_positions(input_ids: torch.Tensor, lengths: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
        """input_ids [b, s] (right-padded), lengths [b] -> the position HF reads the score at [b].

        transformers' *ForSequenceClassification takes the rightmost token that is not the RM
        config's `pad_token_id` (argmax of position * non-pad, so 0 when every token is pad), and
        the last token when the config has no pad id. Applied to each sequence alone (positions
        >= its length are the batch's padding), so a trailing run of pad tokens inside the
        sequence is skipped: an RM whose pad id is EOS scores the token before the final EOS run.
        """
        if (lengths < 1).any():
            raise ValueError("reward model got an empty sequence (length 0)")
        if pad_token_id is None:
            return lengths - 1
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        real = (input_ids != pad_token_id) & (positions < lengths.to(input_ids.device).view(-1, 1))
        return (positions * real).argmax(-1)

    @staticmethod
    def scores(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """values [b, s, 1], positions [b] (from `score_positions`) -> the values there [b]."""
        index = positions.to(values.device).view(-1, 1, 1)
        return values.gather(1, index).view(-1).float()


def build_policy(
    arch: ModelArch,
    *,
    tp: int,
    pp: int,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    recompute_granularity: str | None = None,
    make_vocab_size_divisible_by: int = 128,
    init_weights: bool = True,
    trainable: bool = True,
    experts: ExpertOptions | None = None,
    lora: LoraOptions | None = None,
) -> PolicyModel:
    """The actor (trainable=True) or the frozen reference model (trainable=False). experts: how a MoE
    model's experts run (EP must match the layout's expert_model_parallel_size). lora: adapters on the
    actor, base frozen (models/lora.py); its layers use megatron's local spec, whose Column/RowParallelLinear
    the adapters wrap (TE fuses the input norm into linear_qkv / linear_fc1)."""
    if arch.task != "causal_lm":
        raise ValueError(f"{arch.architecture} is a reward model; the actor and reference need a *ForCausalLM")
    config = transformer_config(
        arch,
        tp=tp,
        pp=pp,
        params_dtype=params_dtype,
        sequence_parallel=sequence_parallel,
        recompute_granularity=recompute_granularity,
        init_weights=init_weights,
        experts=experts,
    )
    with cpu_compat.redirect_cuda():
        model = PolicyModel(
            config=config,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            # gpt-oss: the local spec everywhere (models/attention.py runs its sinks and per-layer windows;
            # Transformer Engine's attention is not checked for them here)
            **_gpt_kwargs(
                arch, config, tp, make_vocab_size_divisible_by, local_spec=lora is not None or arch.attention_sinks
            ),
        )
    model.arch, model.lora = arch, lora
    _mark_tensor_parallel(model)
    if config.multi_latent_attention:
        reduce_mla_rope_key_grad(model)
    freeze_expert_bias(model)
    if model.post_process:
        # Same parameters, no logits GEMM (see HiddenStatesOutputLayer).
        model.output_layer.__class__ = HiddenStatesOutputLayer
    if lora is not None:
        if not trainable:
            raise ValueError("LoRA adapters belong on the actor, not on a frozen model")
        apply_lora(model, lora)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    return model


def build_reward_model(
    arch: ModelArch,
    *,
    tp: int,
    pp: int,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    make_vocab_size_divisible_by: int = 128,
    init_weights: bool = True,
) -> RewardModel:
    """Frozen reward model: GPT trunk + scalar head; `scores(values, score_positions(...))` reads HF's token.

    (tp, pp) may differ from the actor's layout when tp * pp divides the actor's tp * pp: the model
    is then built on its own groups inside each actor model-parallel group (collective: every rank
    calls this).
    """
    if arch.task != "reward":
        raise ValueError(
            f"{arch.architecture} is not a reward model: use a *ForSequenceClassification checkpoint with num_labels=1"
        )
    layout = nested_groups(tp, pp)
    config = transformer_config(
        arch, tp=tp, pp=pp, params_dtype=params_dtype, sequence_parallel=sequence_parallel, init_weights=init_weights
    )
    with cpu_compat.redirect_cuda():
        model = RewardModel(
            config=config,
            share_embeddings_and_output_weights=False,
            **_gpt_kwargs(arch, config, tp, make_vocab_size_divisible_by, layout),
        )
    model.arch, model.layout = arch, layout
    _mark_tensor_parallel(model)
    if model.post_process:
        model.output_layer = ScalarHead(
            arch.hidden_size, params_dtype, config.sequence_parallel, model.tp_group, device=param_device(config)
        )
    model.requires_grad_(False)
    model.eval()
    return model


def sequence_multiple(model) -> int:
    """Batches for `model` need a sequence length that is a multiple of this (TP with sequence parallel)."""
    config = model.config
    return sizes.sequence_multiple(config.tensor_model_parallel_size, config.sequence_parallel)


def check_sequence_length(model, seq_length: int) -> None:
    """Raise before a schedule starts (on every rank alike) when sequence parallel cannot split `seq_length`."""
    multiple = sequence_multiple(model)
    if seq_length % multiple:
        raise ValueError(
            f"sequence length {seq_length} is not a multiple of tp={multiple}, which sequence "
            f"parallel needs: pad batches to a multiple of {multiple} (batching.pad_sequences(pad_to_multiple=))"
        )


def params_dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported: use one of {sorted(DTYPES)}")
    return DTYPES[name]
