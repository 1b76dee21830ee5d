"""Multi-latent attention (DeepSeek-V2/V3, Kimi K2): HF config and tensors <-> megatron-core's MLA.

HF (transformers' DeepseekV3Attention), per layer under `self_attn.`:
  q_a_proj [q_lora, D] -> q_a_layernorm [q_lora] -> q_b_proj [n * (nope + rope), q_lora]
  (or q_proj [n * (nope + rope), D] when q_lora_rank is null, DeepSeek-V2-Lite's layout);
  kv_a_proj_with_mqa [kv_lora + rope, D] -> split [kv_lora | rope]; kv_a_layernorm [kv_lora] ->
  kv_b_proj [n * (nope + v), kv_lora]; o_proj [D, n * v].
megatron-core (MLASelfAttention, local spec) under `self_attention.`: linear_q_down_proj,
q_layernorm, linear_q_up_proj (or linear_q_proj), linear_kv_down_proj, kv_layernorm,
linear_kv_up_proj, linear_proj. Both sides order a head's query rows [nope; rope] and its
kv_b rows [k nope; v], and the latent rows [kv_lora; rope]: the tensors map one to one, with no
permutation (megatron splits them exactly there: torch.split(q, [qk_head_dim, qk_pos_emb_head_dim]),
torch.split(kv, [qk_head_dim, v_head_dim]), torch.split(kv_combined, [kv_lora_rank, qk_pos_emb_head_dim])).
Every projection of the local spec is column parallel, the down projections included (split over
their output rows and gathered before the split), and o_proj row parallel.

RoPE: megatron's MLA always takes a rope part's even then odd dims before rotating halves
(rope_utils._apply_rotary_pos_emb_bshd with multi_latent_attention), which is HF's
`rope_interleave: true` (every published DeepSeek-V3 / R1 / Kimi K2 config); false is refused.
YaRN: megatron's YarnRotaryEmbedding and MLA softmax scale (mscale^2 / sqrt(nope + rope) with
mscale_all_dim) are HF's; HF drops `mscale` when `mscale_all_dim` is 0, so it is passed as 1 then.
"""

from __future__ import annotations

from remax_megatron.models.arch import ModelArch
from remax_megatron.models.families.base import COLUMN, REPLICATED, ROW, TensorRule

YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def mla_features(cfg, path: str) -> dict:
    """The ModelArch MLA fields of an HF config (DeepseekV3Config); one-line refusals for what megatron's
    MLA does not compute as transformers does."""
    if getattr(cfg, "attention_bias", False):
        raise ValueError(
            f"attention_bias=True in {path} is not supported: megatron-core's multi-latent attention has no "
            "biases on its projections"
        )
    if getattr(cfg, "rope_interleave", True) is False:
        raise ValueError(
            f"rope_interleave=false in {path} is not supported: megatron-core's multi-latent attention always "
            "de-interleaves the rope dims (HF's rope_interleave=true, every published DeepSeek-V3 config)"
        )
    n, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if kv != n:
        raise ValueError(
            f"num_key_value_heads={kv} != num_attention_heads={n} in {path}: multi-latent attention expands "
            "its latent to every head (set num_key_value_heads to num_attention_heads)"
        )
    return {
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_head_dim": cfg.qk_nope_head_dim,
        "qk_pos_emb_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "head_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
        "yarn": yarn_of(cfg, path),
    }


def yarn_of(cfg, path: str) -> tuple[tuple[str, float], ...] | None:
    """megatron's YaRN settings (YARN_KEYS order) from HF's rope_parameters; None for plain RoPE."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(
            f"rope_type {kind!r} in {path} is not supported for multi-latent attention: use 'yarn' or 'default'"
        )
    if rope.get("attention_factor") is not None:
        raise ValueError(
            f"rope_parameters.attention_factor={rope['attention_factor']} in {path} is not supported: megatron derives "
            "it from factor, mscale and mscale_all_dim (remove it to use theirs)"
        )
    if rope.get("truncate", True) is False:
        raise ValueError(
            f"rope_parameters.truncate=false in {path} is not supported: megatron rounds YaRN's correction range"
        )
    mscale_all_dim = float(rope.get("mscale_all_dim") or 0.0)
    values = {
        "factor": float(rope["factor"]),
        "original_max_position_embeddings": float(
            rope.get("original_max_position_embeddings") or cfg.max_position_embeddings
        ),
        "beta_fast": float(rope.get("beta_fast") or 32.0),
        "beta_slow": float(rope.get("beta_slow") or 1.0),
        # transformers uses mscale only together with mscale_all_dim (else its attention factor is mscale 1's)
        "mscale": float(rope.get("mscale") or 1.0) if mscale_all_dim else 1.0,
        "mscale_all_dim": mscale_all_dim,
    }
    return tuple((k, values[k]) for k in YARN_KEYS)


def mla_attention_rules(arch: ModelArch) -> list[TensorRule]:
    """Pre-norm multi-latent attention (module docstring): HF names under the layer, megatron's local spec."""
    d, n = arch.hidden_size, arch.num_heads
    nope, rope, v, kv_lora, q_lora = (
        arch.qk_head_dim,
        arch.qk_pos_emb_head_dim,
        arch.v_head_dim,
        arch.kv_lora_rank,
        arch.q_lora_rank,
    )
    q_rows = n * (nope + rope)

    def rule(megatron: str, hf: str, kind: str, shape: tuple[int, ...]) -> TensorRule:
        return TensorRule(f"self_attention.{megatron}.weight", (f"self_attn.{hf}.weight",), kind, (shape,))

    rules = [TensorRule("input_layernorm.weight", ("input_layernorm.weight",), REPLICATED, ((d,),))]
    if q_lora is None:
        rules.append(rule("linear_q_proj", "q_proj", COLUMN, (q_rows, d)))
    else:
        rules += [
            rule("linear_q_down_proj", "q_a_proj", COLUMN, (q_lora, d)),
            rule("q_layernorm", "q_a_layernorm", REPLICATED, (q_lora,)),
            rule("linear_q_up_proj", "q_b_proj", COLUMN, (q_rows, q_lora)),
        ]
    return rules + [
        rule("linear_kv_down_proj", "kv_a_proj_with_mqa", COLUMN, (kv_lora + rope, d)),
        rule("kv_layernorm", "kv_a_layernorm", REPLICATED, (kv_lora,)),
        rule("linear_kv_up_proj", "kv_b_proj", COLUMN, (n * (nope + v), kv_lora)),
        rule("linear_proj", "o_proj", ROW, (d, n * v)),
    ]


def check_mla_tp(arch: ModelArch, tp: int, tp_name: str) -> None:
    """The local spec splits the down projections' output rows over TP too: tp divides them (one line)."""
    rows = {"kv_lora_rank + qk_rope_head_dim": arch.kv_lora_rank + arch.qk_pos_emb_head_dim}
    if arch.q_lora_rank is not None:
        rows["q_lora_rank"] = arch.q_lora_rank
    for what, size in rows.items():
        if size % tp:
            raise ValueError(
                f"{tp_name}={tp} does not divide {what}={size} (megatron's MLA splits its down projection over "
                f"tensor parallelism): choose {tp_name.lstrip('-')} from the divisors of {size}"
            )


def mla_config_kwargs(arch: ModelArch) -> dict:
    """MLATransformerConfig's MLA fields for `arch` (megatron names; YaRN's from arch.yarn)."""
    kwargs = dict(
        multi_latent_attention=True,
        q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_head_dim,
        qk_pos_emb_head_dim=arch.qk_pos_emb_head_dim,
        v_head_dim=arch.v_head_dim,
        rotary_base=arch.rope_theta,
        # the q / kv latents' RMSNorms are put in the layer spec (gpt._mla_layer_spec says why this stays off)
        qk_layernorm=False,
    )
    if arch.yarn is None:
        return dict(kwargs, rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    yarn = dict(arch.yarn)
    return dict(
        kwargs,
        rope_type="yarn",
        rotary_scaling_factor=yarn["factor"],
        original_max_position_embeddings=int(yarn["original_max_position_embeddings"]),
        beta_fast=yarn["beta_fast"],
        beta_slow=yarn["beta_slow"],
        mscale=yarn["mscale"],
        mscale_all_dim=yarn["mscale_all_dim"],
    )


def patch_mla_for_cpu() -> None:
    """Two things megatron-core 0.16.1's MLA needs CUDA / Transformer Engine for that it does not use.
    (1) Without TE its module's TELinear is no class (megatron.core.extensions stands mocks in for TE's
    classes) and `isinstance(linear_proj, TELinear)` raises: a class nothing is an instance of stands in.
    (2) It builds its RoPE tables without `use_cpu_initialization` (so on torch.cuda.current_device()),
    and YaRN's moves them there at every table build: without CUDA, MLA's two RoPE classes get
    use_cpu_initialization=True and see "cpu" as the current device while they build.
    Idempotent; called before an MLA model is built."""
    import torch
    from megatron.core.transformer import multi_latent_attention as mla_module

    if not isinstance(mla_module.TELinear, type):
        mla_module.TELinear = type("NoTransformerEngineLinear", (), {})
    if torch.cuda.is_available() or getattr(mla_module, "_remax_cpu_rotary", False):
        return
    for name in ("RotaryEmbedding", "YarnRotaryEmbedding"):
        original = getattr(mla_module, name)
        methods = {"__init__": _on_cpu(original.__init__, default_cpu=True)}
        if hasattr(original, "get_emb"):
            methods["get_emb"] = _on_cpu(original.get_emb)
        setattr(mla_module, name, type(name, (original,), methods))
    mla_module._remax_cpu_rotary = True


def _on_cpu(method, default_cpu: bool = False):
    from unittest import mock

    import torch

    def on_cpu(self, *args, **kwargs):
        if default_cpu:
            kwargs.setdefault("use_cpu_initialization", True)
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
            return method(self, *args, **kwargs)

    return on_cpu
