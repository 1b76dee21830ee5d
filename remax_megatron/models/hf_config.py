"""Hugging Face `config.json` -> the architecture facts megatron needs -> TransformerConfig.

The model-family registry (models/families) says which architectures are served: Llama, Qwen2,
Qwen3 and Mistral, each as *ForCausalLM and as *ForSequenceClassification with one label (a reward
model), and the MoE families Qwen3-MoE, Mixtral, GLM-4.5, gpt-oss and DeepSeek-V3 as *ForCausalLM only.
Anything else is refused by name, with the registry's families listed, before a model is built; so is
a setting a family cannot run exactly (its file names it).
"""

from __future__ import annotations

import importlib.util
import json
import os

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from remax_megatron.models import families
from remax_megatron.models.arch import ExpertOptions, ModelArch, check_expert_bias
from remax_megatron.models.families.mla import check_mla_tp, mla_config_kwargs
from remax_megatron.sizes import round_up


def read_hf_config(model_dir: str) -> ModelArch:
    """Read and check `model_dir/config.json`; raises ValueError naming what is unsupported."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: point the model path at a Hugging Face model directory")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): fix or re-download it") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not an object: fix or re-download it")
    archs = raw.get("architectures") or []
    if len(archs) != 1:
        raise ValueError(
            f"{path} names {len(archs)} architectures ({archs or raw.get('model_type')!r}): "
            f"remax-megatron needs exactly one of {', '.join(families.supported_architectures())}"
        )
    family, task = families.lookup(archs[0], path)
    try:
        cfg = AutoConfig.from_pretrained(model_dir)
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"{path} could not be read by transformers ({type(e).__name__}: {reason})") from None
    if task == families.REWARD and getattr(cfg, "num_labels", 1) != 1:
        raise ValueError(f"reward model {path} has num_labels={cfg.num_labels}; a scalar reward needs 1")
    fields = _common_fields(cfg, path)
    fields.update(family.features(cfg, path))
    return ModelArch(
        architecture=archs[0],
        family=family.name,
        task=task,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)) and task == families.CAUSAL_LM,
        **fields,
    )


def _common_fields(cfg, path: str) -> dict:
    """The ModelArch fields every family reads alike (a decoder with RMSNorm, RoPE and GQA)."""
    if getattr(cfg, "mlp_bias", False):
        raise ValueError(f"mlp_bias=True in {path} is not supported (Llama-shaped checkpoints have none)")
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    rope_theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", "default")
    scaling = None
    if rope_type == "llama3":
        # megatron-core hard-codes llama3's low/high frequency factors and original length.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if float(rope.get(key, value)) != value:
                raise ValueError(
                    f"rope_parameters.{key}={rope[key]} in {path} is not supported (megatron uses {value})"
                )
        scaling = float(rope["factor"])
    elif rope_type == "yarn" and (getattr(cfg, "kv_lora_rank", None) or cfg.model_type == "gpt_oss"):
        pass  # the family's own YaRN (models/families/mla.py, gpt_oss.py read it)
    elif rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} in {path} is not supported: use 'default' or 'llama3'")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "float32"
    return dict(
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling_factor=scaling,
        max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=getattr(cfg, "pad_token_id", None),
        torch_dtype=str(dtype).replace("torch.", ""),
    )


def check_run_length(arch: ModelArch, longest: int, what: str, how: str) -> None:
    """A one-line error when the run's longest sequence (`longest` tokens, spelled out in `how`) is longer
    than the model `what` has positions for (a sliding window is no limit: the attention applies it)."""
    if longest > arch.max_position_embeddings:
        raise ValueError(
            f"{how} = {longest} exceeds {what}'s max_position_embeddings="
            f"{arch.max_position_embeddings}: lower one of them"
        )


def check_layout(arch: ModelArch, tp: int, pp: int, what: str = "actor", ep: int = 1) -> None:
    """One-line errors for a TP/PP/EP layout the model cannot be split into.

    `what` names the setting: a config section ("actor" -> actor.tp) or a command-line prefix
    ("--" -> --tp).
    """
    tp_name, pp_name = (f"{what}tp", f"{what}pp") if what.endswith("-") else (f"{what}.tp", f"{what}.pp")
    ep_name = f"{what}ep" if what.endswith("-") else f"{what}.ep"
    if ep > 1 and not arch.is_moe:
        raise ValueError(
            f"{ep_name}={ep} but {arch.architecture} has no experts: expert parallelism needs a "
            f"mixture-of-experts model (set {ep_name}=1)"
        )
    if arch.is_moe and arch.num_experts % ep:
        raise ValueError(
            f"{ep_name}={ep} does not divide the {arch.num_experts} experts of {arch.architecture}: "
            f"choose ep from the divisors of {arch.num_experts}"
        )
    check_tp_heads(arch, tp, tp_name)
    if arch.num_layers % pp:
        raise ValueError(
            f"{pp_name}={pp} does not divide num_hidden_layers={arch.num_layers}: "
            f"choose pp from the divisors of {arch.num_layers}"
        )


def check_tp_heads(arch: ModelArch, tp: int, tp_name: str) -> None:
    """Tensor parallelism `tp` (the setting `tp_name`: actor.tp, rollout.tp, --tp) splits whole attention heads
    and whole KV heads (query groups): tp divides both."""
    for what, heads in (("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads)):
        if heads % tp:
            raise ValueError(
                f"{tp_name}={tp} does not divide {what}={heads}: choose {tp_name.lstrip('-')} from "
                f"the divisors of {heads}"
            )
    if getattr(arch, "is_mla", False):  # callers may pass any object with the head counts
        check_mla_tp(arch, tp, tp_name)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocab: a multiple of divisible_by * tp (rows past vocab_size are padding)."""
    multiple = divisible_by * tp
    return round_up(vocab_size, multiple)


def transformer_config(
    arch: ModelArch,
    *,
    tp: int,
    pp: int,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    recompute_granularity: str | None = None,
    init_weights: bool = True,
    experts: ExpertOptions | None = None,
):
    """The megatron TransformerConfig of `arch` at this layout (see PITFALLS: TP/PP sizes must be set)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    experts = experts or ExpertOptions()
    check_layout(arch, tp, pp, ep=experts.ep)
    check_expert_bias(arch, experts.etp, "expert tensor parallel size (actor.etp, --etp)")
    cuda = torch.cuda.is_available()
    config_class = MLATransformerConfig if arch.is_mla else TransformerConfig
    attention = mla_config_kwargs(arch) if arch.is_mla else {"qk_layernorm": arch.qk_layernorm}
    kwargs = dict(
        **(_moe_kwargs(arch, experts) if arch.is_moe else {}),
        **attention,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        recompute_granularity=recompute_granularity,
        recompute_method="uniform" if recompute_granularity == "full" else None,
        recompute_num_layers=1 if recompute_granularity == "full" else None,
        use_cpu_initialization=not cuda,
        perform_initialization=init_weights,
        # Fusions: the jit ones need a GPU; the masked softmax needs megatron's compiled extension
        # (built with Megatron-LM / Apex): without it, bf16 attention would fail to import it.
        bias_activation_fusion=cuda,
        masked_softmax_fusion=cuda and importlib.util.find_spec("scaled_masked_softmax_cuda") is not None,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=cuda,
    )
    kwargs.update(_window_kwargs(arch), **_gpt_oss_kwargs(arch))
    config = config_class(**kwargs)
    if arch.yarn is not None and not arch.is_mla:
        # GPTModel's position_embedding_type="yarn" reads these (no TransformerConfig field holds them); its
        # attention multiplies RoPE's cos / sin by YaRN's concentration factor when yarn_rotary_scaling_factor
        # is there (as transformers does), though GPTModel's forward drops the factor the table returns
        yarn = dict(arch.yarn)
        config.yarn_rotary_scaling_factor = yarn["factor"]
        config.yarn_original_max_position_embeddings = int(yarn["original_max_position_embeddings"])
        config.yarn_beta_fast, config.yarn_beta_slow = yarn["beta_fast"], yarn["beta_slow"]
        config.yarn_mscale = config.yarn_mscale_all_dim = None  # the concentration factor of `factor` alone
        config.yarn_correction_range_round_to_int = bool(yarn["truncate"])
    return config


def _window_kwargs(arch: ModelArch) -> dict:
    """Sliding windows: megatron's one `window_size` (HF W -> (W - 1, 0): a query sees itself and W - 1 keys
    before it) on the layers `window_attn_skip_freq` lists (1 = windowed; megatron's is_layer_window_attention),
    which models/attention.py and Transformer Engine's attention apply; {} when no layer slides."""
    windows = [w for w in arch.layer_windows or () if w is not None]
    if not windows:
        return {}
    if len(set(windows)) > 1:
        raise ValueError(
            f"{arch.architecture}: sliding windows of {sorted(set(windows))} tokens in one model; megatron-core "
            "has one window_size for all windowed layers"
        )
    return dict(window_size=(windows[0] - 1, 0), window_attn_skip_freq=[int(w is not None) for w in arch.layer_windows])


def _gpt_oss_kwargs(arch: ModelArch) -> dict:
    """TransformerConfig fields of gpt-oss's features (models/families/gpt_oss.py); {} for other models:
    sinks as softmax_type "learnable" (the `softmax_offset` parameter), the clamped SwiGLU and biases on every
    linear (add_bias_linear: o_proj, router, experts). Its windows are _window_kwargs'."""
    from remax_megatron.models.families import gpt_oss

    kwargs = {}
    if arch.attention_sinks:
        kwargs["softmax_type"] = "learnable"
    if arch.swiglu_limit is not None:
        kwargs.update(gpt_oss.activation_kwargs({"swiglu_limit": arch.swiglu_limit}))
    if arch.linear_bias:
        kwargs["add_bias_linear"] = True
    return kwargs


def _moe_kwargs(arch: ModelArch, experts: ExpertOptions) -> dict:
    """megatron's MoE settings for `arch`: HF's routing (softmax or sigmoid scores, top-k, renormalised
    unless moe_pre_softmax; group-limited, scaled) computed in fp32, no capacity limit (no token dropped),
    and megatron's own load-balancing loss off: the trainer adds its own, globally normalised (models/moe.py).

    DeepSeek-style models (GLM-4.5, DeepSeek-V3): dense first layers as megatron's per-layer
    `moe_layer_freq` list, shared experts, and the routing correction bias (HF `e_score_correction_bias`,
    megatron's `expert_bias` buffer) kept FROZEN: megatron's aux-loss-free update (bias += rate *
    sign(mean load - load) after every step) is off (rate 0). RL batches are small and skewed toward
    one prompt set, so that update would chase their noise, and the rollout engine must route as the
    actor does: the bias is synced to it with the weights, and a frozen one keeps both on the
    published routing."""
    return dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_top_k,
        moe_router_pre_softmax=arch.moe_pre_softmax,
        moe_router_score_function=arch.moe_score_function,
        moe_layer_freq=([0] * arch.first_dense_layers + [1] * arch.moe_layers if arch.first_dense_layers else 1),
        moe_shared_expert_intermediate_size=arch.moe_shared_ffn_hidden_size or None,
        moe_router_enable_expert_bias=arch.moe_expert_bias,
        moe_router_bias_update_rate=0.0,  # frozen (see above)
        moe_router_num_groups=arch.moe_num_groups,
        moe_router_group_topk=arch.moe_group_topk,
        moe_router_topk_scaling_factor=arch.moe_topk_scaling_factor,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=experts.dispatcher,
        moe_grouped_gemm=experts.grouped_gemm,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_enable_routing_replay=experts.routing_replay,
        expert_model_parallel_size=experts.ep,
        expert_tensor_parallel_size=experts.etp,
    )
