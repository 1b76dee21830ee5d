"""The architecture facts remax-megatron reads from a Hugging Face config (names follow megatron).

A leaf module (no megatron-core import): the weight mapping, the planner and the model-family
registry all describe a model by a ModelArch.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import torch

from remax_megatron.config import DEFAULT_LORA_TARGETS, LoraTarget

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def transformer_engine_usable() -> bool:
    """CUDA and Transformer Engine both present (its layer spec and grouped experts can run)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def check_packing(params_dtype: torch.dtype, local_spec: bool = False) -> None:
    """Refuse packed rows where the attention cannot keep the sequences apart (one line). Packed rows reach
    the attention in megatron's THD format (cu_seqlens: batching.micro_batches): Transformer Engine's where
    its layer spec runs, else models/attention.py's (any dtype; `local_spec`: a LoRA actor, which runs the
    local spec even where TE is installed)."""
    if transformer_engine_usable() and not local_spec and params_dtype == torch.float32:
        raise ValueError(
            "trainer.pack_sequences=true with actor.dtype=float32 under Transformer Engine: its THD "
            "attention (packed sequences) runs in its flash and cuDNN backends, which take bfloat16 or "
            "float16 only, and its unfused fallback has no THD format: use actor.dtype=bfloat16 or "
            "trainer.pack_sequences=false"
        )


@dataclass(frozen=True)
class ModelArch:
    """What remax-megatron reads from an HF config (names follow megatron)."""

    architecture: str  # e.g. "Qwen2ForCausalLM"
    family: str  # the registered model family (models/families), e.g. "qwen3"
    task: str  # "causal_lm" | "reward"
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the tokenizer's vocab; megatron pads it for TP
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # llama3-style scaling, None for plain RoPE
    tie_word_embeddings: bool
    max_position_embeddings: int
    pad_token_id: int | None
    torch_dtype: str
    # Family features (models/families/<family>.py sets them)
    qkv_bias: bool = False  # biases on q, k, v (Qwen2)
    qk_layernorm: bool = False  # RMSNorm over each head's queries and keys (Qwen3)
    # per layer: the keys a query keeps (q - k < W, HF's sliding_window) or None for full causal; None: no
    # layer slides (Mistral: every layer; Qwen2 / Qwen3: the layers past max_window_layers; gpt-oss: every other)
    layer_windows: tuple[int | None, ...] | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral): every decoder layer's MLP is routed; 0 experts: dense
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0  # one expert's FFN width
    moe_top_k: int = 0  # experts per token
    moe_pre_softmax: bool = False  # softmax over all experts, then top-k, no renormalisation
    # DeepSeek-style MoE (GLM-4.5, DeepSeek-V3; models/families/deepseek_moe.py maps them)
    rotary_percent: float = (
        1.0  # the fraction of each head's dims RoPE rotates (the first ones; HF partial_rotary_factor)
    )
    first_dense_layers: int = 0  # the first k decoder layers have a dense MLP (ffn_hidden_size), the rest are routed
    moe_shared_ffn_hidden_size: int = 0  # shared experts' total FFN width, run on every token (0: none)
    moe_score_function: str = "softmax"  # softmax | sigmoid (sigmoid scores, top-k renormalised)
    moe_expert_bias: bool = False  # a per-expert bias added to the scores for choosing experts only (frozen)
    moe_num_groups: int | None = None  # group-limited top-k: experts split into this many groups
    moe_group_topk: int | None = None  # ... of which each token picks this many
    moe_topk_scaling_factor: float | None = None  # routed weights multiplied by this (HF routed_scaling_factor)
    mtp_layers: int = 0  # the checkpoint's multi-token-prediction layers: not built, not trained, not exported
    # Multi-latent attention (DeepSeek-V3, models/families/mla.py); kv_lora_rank 0: not MLA
    q_lora_rank: int | None = None  # queries through a low-rank down / norm / up; None: one q projection
    kv_lora_rank: int = 0  # the compressed keys and values (one latent shared by the heads)
    qk_head_dim: int = 0  # per head: the query / key part without RoPE (HF qk_nope_head_dim)
    qk_pos_emb_head_dim: int = 0  # per head: the RoPE part (HF qk_rope_head_dim; the key's is shared)
    v_head_dim: int = 0
    # YaRN RoPE (rope_type "yarn"; None: another type): HF rope_parameters' factor and its knobs
    yarn: tuple[tuple[str, float], ...] | None = None  # (("factor", 40.0), ("beta_fast", 32.0), ...)
    # gpt-oss (models/families/gpt_oss.py): a learned per-head sink logit in every attention layer, biases on
    # every linear but the embeddings (o_proj, the router, the experts), and the clamped SwiGLU's limit
    attention_sinks: bool = False
    linear_bias: bool = False
    swiglu_limit: float | None = None  # None: plain SwiGLU; else gpt-oss's (up + 1) * quick_gelu(gate), clamped

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (global, 0-based) routes its MLP over the experts."""
        return self.is_moe and layer >= self.first_dense_layers

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers if self.is_moe else 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0


@dataclass(frozen=True)
class ExpertOptions:
    """How a MoE model's experts run (actor.ep, actor.etp, actor.moe_dispatcher, actor.moe_experts)."""

    ep: int = 1  # expert parallel: experts split over this many ranks
    etp: int = 1  # expert tensor parallel: each expert's MLP split over this many (1 or tp)
    dispatcher: str = "alltoall"  # megatron's token dispatcher: alltoall | allgather
    grouped_gemm: bool = False  # TE's grouped experts (CUDA + Transformer Engine); else SequentialMLP
    routing_replay: bool = False  # megatron's RouterReplay: forward on routes given from outside (the engine's)


LORA_TARGETS = typing.get_args(LoraTarget)
LORA_ADAPTERS = ("lora_A", "lora_B")  # an adapted linear's extra parameters


MLA_LORA_TARGETS = (
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
)


def check_lora_targets(targets, mla: bool, architecture: str) -> None:
    """LoRA targets name the attention the model has (one line): multi-latent attention has no linear_qkv,
    grouped-query attention none of MLA's projections."""
    if mla and "linear_qkv" in targets:
        raise ValueError(
            f"actor.lora_targets holds linear_qkv, which {architecture}'s multi-latent attention does not have: "
            "name its projections, e.g. actor.lora_targets=[linear_q_down_proj,linear_q_up_proj,"
            "linear_kv_down_proj,linear_kv_up_proj,linear_proj] (linear_q_proj where q_lora_rank is null)"
        )
    wrong = [t for t in targets if t in MLA_LORA_TARGETS]
    if not mla and wrong:
        raise ValueError(
            f"actor.lora_targets holds {wrong}, multi-latent attention's projections, which {architecture} does "
            "not have: use linear_qkv"
        )


def is_adapter(name: str) -> bool:
    """Whether a parameter / state-dict name is a LoRA adapter tensor."""
    return name.rsplit(".", 1)[-1] in LORA_ADAPTERS


@dataclass(frozen=True)
class LoraOptions:
    """LoRA on the actor (actor.lora_rank > 0): W x + (alpha / rank) * B A dropout(x), base weights frozen."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    dropout: float = 0.0
    seed: int = 0  # A's init: the same on every rank and layout (B starts at zero)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def check_expert_bias(arch: ModelArch, etp: int, etp_name: str) -> None:
    """megatron-core builds biased experts (gpt-oss) only unsplit: expert tensor parallelism 1 (one line)."""
    if arch.is_moe and getattr(arch, "linear_bias", False) and etp > 1:  # callers may pass any object
        raise ValueError(
            f"{etp_name}={etp} (default: the tp) with {arch.architecture}'s biased experts: megatron-core supports "
            f"expert biases only at expert tensor parallel size 1; set {etp_name}=1 (at tp > 1 with ep > 1)"
        )


def expert_options(cfg, arch: ModelArch, this_machine: bool = True) -> ExpertOptions:
    """How the actor's (and reference's) experts run (actor.ep, actor.etp, actor.moe_*, rollout.routing_replay);
    one-line errors for what cannot run. The one owner of the expert rules: start-up and the planner call it
    (the planner with this_machine=False: no check of this machine's CUDA / Transformer Engine)."""
    a = cfg.actor
    if not arch.is_moe:
        if cfg.rollout.routing_replay:
            raise ValueError(
                f"rollout.routing_replay=true but {arch.architecture} has no experts to route: set it to false"
            )
        return ExpertOptions()
    if a.tp > 1 and not a.sequence_parallel:
        raise ValueError(
            f"actor.tp={a.tp} with a mixture-of-experts model needs actor.sequence_parallel=true "
            "(megatron-core trains MoE layers under TP only with sequence parallelism)"
        )
    if cfg.rollout.routing_replay and cfg.actor.recompute == "full":
        raise ValueError(
            "rollout.routing_replay=true with actor.recompute=full: the recomputed forward would route "
            "on its own (megatron's REPLAY_BACKWARD is not driven by the schedule); use "
            "actor.recompute=selective or none"
        )
    if cfg.trainer.micro_batch_tokens and a.moe_dispatcher == "allgather":
        raise ValueError(
            "trainer.micro_batch_tokens with actor.moe_dispatcher=allgather: micro-batches of several "
            "shapes need megatron's variable_seq_lengths, which its allgather dispatcher refuses; use "
            "actor.moe_dispatcher=alltoall"
        )
    if cfg.trainer.pack_sequences and cfg.algo.moe_aux_loss == "seq_aux" and cfg.actor.recompute == "full":
        raise ValueError(
            "trainer.pack_sequences=true with algo.moe_aux_loss=seq_aux and actor.recompute=full: the "
            "recomputed routers would not know which packed sequence each token belongs to; use "
            "actor.recompute=selective, algo.moe_aux_loss=aux, or trainer.pack_sequences=false"
        )
    if cfg.rollout.routing_replay and cfg.trainer.mini_batches > 1:
        raise ValueError(
            f"rollout.routing_replay=true with trainer.mini_batches={cfg.trainer.mini_batches}: the old "
            "log-prob pass does not replay routes yet; use trainer.mini_batches=1"
        )
    check_expert_bias(arch, a.etp or a.tp, "actor.etp")
    # A LoRA actor runs megatron's local spec (models/gpt.build_policy): its experts are SequentialMLP.
    clamped = getattr(arch, "swiglu_limit", None) is not None  # gpt-oss (callers may pass any object)
    if a.moe_experts == "grouped" and clamped:
        raise ValueError(
            f"actor.moe_experts=grouped with {arch.architecture}: grouped experts take no quick_gelu with "
            "glu_linear_offset (gpt-oss's clamped SwiGLU); use actor.moe_experts=sequential or auto"
        )
    # gpt-oss's experts run as SequentialMLP (see above); so does a LoRA actor's (below)
    grouped = a.moe_experts == "grouped" or (
        a.moe_experts == "auto" and transformer_engine_usable() and not a.lora_rank and not clamped
    )
    if grouped and this_machine and not transformer_engine_usable():
        raise ValueError(
            "actor.moe_experts=grouped needs CUDA and Transformer Engine (TEGroupedMLP): use "
            "actor.moe_experts=sequential (megatron's SequentialMLP) or auto"
        )
    return ExpertOptions(
        ep=a.ep,
        etp=a.etp or a.tp,
        dispatcher=a.moe_dispatcher,
        grouped_gemm=grouped,
        routing_replay=cfg.rollout.routing_replay,
    )
