"""Core attention on torch's scaled_dot_product_attention: the local spec's attention (no Transformer Engine,
LoRA, CPU), in place of megatron-core's DotProductAttention.

megatron-core's local `DotProductAttention` materialises [b * heads, s, s] scores (baddbmm, softmax, bmm),
repeats K/V for GQA, refuses packed sequences, builds its window mask on `device="cuda"` (replacing any mask
passed in) and rejects the `k_channels` / `v_channels` that multi-latent attention passes. This one runs
torch SDPA (flash / cuDNN / memory-efficient on a GPU, the CPU flash kernel here), with FlexAttention on
CUDA where SDPA has no term for it (a sink logit, a sliding window).

The interface the model families build on (models/families, issue 51):

- Constructor and forward are megatron's `DotProductAttention`'s (megatron-core 0.16.1), so
  `SelfAttentionSubmodules(core_attention=TorchDotProductAttention)` and MLA's
  `MLASelfAttentionSubmodules(core_attention=...)` take it as they are; plus `k_channels` / `v_channels`
  (MLA: query/key head dim qk_nope + qk_rope, value head dim v_head_dim) and `softmax_scale` (MLA's YaRN
  mscale^2 / sqrt(q_head_dim)). Default scale: 1 / sqrt(k_channels), megatron's.
- Inputs query [sq, b, heads / tp, k_channels], key [sk, b, groups / tp, k_channels], value
  [sk, b, groups / tp, v_channels]; output [sq, b, heads / tp * v_channels]. GQA: K/V are never repeated
  (SDPA's enable_gqa).
- Masks follow megatron: `attention_mask` bool, True = masked, broadcastable to [b, heads, sq, sk]; when
  given it is the whole mask (as in megatron), else attn_mask_type causal means causal. A fully masked query
  row gives zeros (megatron's -10000 fill gives the mean of all values there) and finite gradients.
- Sliding window per layer: megatron's `config.window_size` = (left, right) with `window_attn_skip_freq`
  choosing the layers (megatron's `is_layer_window_attention`, layer_number 1-based). Query i sees keys
  i - left .. i + right, so HF's `sliding_window` W (a token sees itself and W - 1 earlier ones) is
  window_size = (W - 1, 0). The window narrows whatever mask applies (megatron's replaces it, letting packed
  documents see each other).
- Sinks: `config.softmax_type` "learnable" holds the per-head sink logit as the parameter `softmax_offset`
  [heads / tp] (megatron's name and shape, sharded over TP like the heads: HF gpt-oss `sinks` map onto it);
  "off-by-one" is a sink logit fixed at 0. The sink is one more softmax column with no value: out_i =
  sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink)).
- Packed sequences: `packed_seq_params` in megatron's THD format (query [t, heads / tp, k_channels], its
  `cu_seqlens_q` / `cu_seqlens_kv`, or their `_padded` versions as megatron's RoPE reads them): each
  document is attended on its own (SDPA over its segment), so a packed row costs what its documents cost;
  output [t, heads / tp * v_channels].
- Dropout: `attention_dropout` in training (SDPA's dropout_p; 0 in the project's configs).

Precision: SDPA's (fp32 accumulation in the softmax for bf16 inputs on every backend, as megatron's
attention_softmax_in_fp32). The CPU path and the CUDA path run the same module; tests/models/test_attention.py
pins it to megatron's DotProductAttention and to a dense fp64 reference.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide


def param_device(config) -> torch.device:
    """Where megatron's layers put their parameters: the current GPU unless use_cpu_initialization.

    The project's own modules (RMSNorm, ScalarHead, the sink logit) follow it; nothing moves a model afterwards.
    """
    return torch.device("cpu") if config.use_cpu_initialization else torch.device("cuda", torch.cuda.current_device())


class TorchDotProductAttention(MegatronModule):
    """megatron-core core attention on torch SDPA (see the module docstring for the interface)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,  # noqa: ARG002 - megatron passes it; context parallel is refused
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size}: the SDPA core attention has no context "
                "parallelism; use context_parallel_size=1 (or Transformer Engine's attention)"
            )
        if getattr(config, "qk_clip", False):
            raise ValueError(
                "qk_clip=True needs the attention logits' maxima, which SDPA does not return: set qk_clip=False"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp = self.tp_group.size()
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        # megatron divides by layer_number under apply_query_key_layer_scaling and multiplies it back in its
        # softmax: the net scale is this one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.window_size = (
            tuple(config.window_size)
            if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
            else None
        )
        self.current_max_attn_logits = None  # megatron's MLA reads it for qk_clip only
        heads = self.num_attention_heads_per_partition
        if config.softmax_type == "vanilla":
            self.softmax_offset = None
        elif config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads, device=param_device(config)), persistent=False)
        elif config.softmax_type == "learnable":
            offset = torch.zeros(heads, device=param_device(config), dtype=config.params_dtype)
            self.softmax_offset = torch.nn.Parameter(offset)
            if config.perform_initialization:
                with torch.no_grad():
                    config.init_method(self.softmax_offset)
            # One logit per head, split over TP like the heads (grad-norm clipping counts each shard once).
            tensor_parallel.set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        else:
            raise ValueError(
                f"softmax_type {config.softmax_type!r} is not supported: use 'vanilla', 'off-by-one' or 'learnable'"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query [sq, b, np, hk], key [sk, b, ng, hk], value [sk, b, ng, hv] -> [sq, b, np * hv] (THD: the
        same without b)."""
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the SDPA core attention: pass attention_bias=None")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_documents(query, key, value, packed_seq_params, causal)
        if packed_seq_params is not None:
            raise ValueError(
                f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: the SDPA core attention takes "
                "packed sequences in the 'thd' format"
            )
        # [s, b, n, h] -> [b, n, s, h]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = self._attend(q, k, v, causal=causal, mask=attention_mask)
        sq, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _forward_documents(self, query, key, value, params, causal: bool) -> torch.Tensor:
        """THD: query [t, np, hk], key / value [t, ng, h] -> [t, np * hv], each document attended alone."""
        bounds_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        bounds_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        bounds_q, bounds_kv = bounds_q.tolist(), bounds_kv.tolist()
        if bounds_q != bounds_kv:
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        if bounds_q[-1] > query.shape[0]:
            raise ValueError(f"cu_seqlens ends at {bounds_q[-1]}, past the packed row's {query.shape[0]} tokens")
        out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
        for start, end in zip(bounds_q, bounds_q[1:]):
            if end > start:
                # [n, heads, h] -> [1, heads, n, h]
                q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                out[start:end] = self._attend(q, k, v, causal=causal, mask=None)[0].transpose(0, 1)
        return out.reshape(query.shape[0], -1)

    def _attend(self, q, k, v, *, causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
        """q [b, np, sq, hk], k [b, ng, sk, hk], v [b, ng, sk, hv], mask True = masked -> [b, np, sq, hv]."""
        dropout = self.dropout_p if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]
        sink = self.softmax_offset
        if mask is None and self.window_size is None and sink is None:
            causal = causal and q.shape[2] > 1  # one query (decoding) sees every key, as in megatron
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, dropout_p=dropout, scale=self.softmax_scale, enable_gqa=gqa
            )
        if mask is None and q.is_cuda and dropout == 0.0:
            return _flex_attend(q, k, v, self.softmax_scale, causal, self.window_size, sink)
        allowed = _allowed(q.shape[2], k.shape[2], causal, self.window_size, mask, q.device)  # [b|1, np|1, sq, sk]
        if sink is not None:
            return _sdpa_with_sink(q, k, v, allowed, sink, self.softmax_scale, dropout, gqa)
        # A query that may see no key: let it see all (finite softmax), then zero its output (and so its gradient).
        dead = ~allowed.any(-1, keepdim=True)  # [b|1, np|1, sq, 1]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed | dead, dropout_p=dropout, scale=self.softmax_scale, enable_gqa=gqa
        )
        return out.masked_fill(dead, 0.0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The learnable sink logit, sharded over TP along its head dimension (megatron's layout)."""
        state_dict = self.state_dict(prefix="", keep_vars=True) if self.config.softmax_type == "learnable" else {}
        return make_sharded_tensors_for_checkpoint(
            state_dict,
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


def _allowed(sq: int, sk: int, causal: bool, window, mask, device) -> torch.Tensor:
    """Which keys each query may see: bool [.., sq, sk], True = allowed (SDPA's convention)."""
    i = torch.arange(sq, device=device).view(-1, 1) + (sk - sq)  # queries are the last sq positions
    j = torch.arange(sk, device=device).view(1, -1)
    if mask is not None:
        allowed = ~mask.to(device=device, dtype=torch.bool)
    elif causal and sq > 1:
        allowed = j <= i
    else:
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if window is not None:
        left, right = window
        allowed = allowed & (j >= i - left) & (j <= i + right)
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    return allowed


def _sdpa_with_sink(q, k, v, allowed, sink, scale: float, dropout: float, gqa: bool) -> torch.Tensor:
    """SDPA with one more key per head whose score is the sink logit and whose value is zero.

    The extra column is never masked, so a query that may see no key gets all its weight on the sink:
    output 0, gradients finite.
    """
    b, np_, sq, _ = q.shape
    k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[3])], dim=2)
    v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[3])], dim=2)
    bias = torch.zeros(*allowed.shape[:3], allowed.shape[3], dtype=q.dtype, device=q.device)
    bias = bias.masked_fill(~allowed, float("-inf")).expand(b, np_, sq, -1)  # [b, np, sq, sk]
    column = sink.to(q.dtype).view(1, np_, 1, 1).expand(b, np_, sq, 1)
    bias = torch.cat([bias, column], dim=-1)  # [b, np, sq, sk + 1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=scale, enable_gqa=gqa)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic shapes after the first recompile: packed documents come in many lengths
    return torch.compile(flex_attention)


@functools.lru_cache(maxsize=64)
def _block_mask(sq: int, sk: int, causal: bool, window, sink: bool, device: str):
    """FlexAttention's block mask for a causal / windowed self-attention; with `sink`, key sk (one past the
    real keys) is the sink column and always visible."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = sk - sq

    def visible(b, h, q_idx, kv_idx):  # noqa: ARG001 - FlexAttention's signature
        i = q_idx + offset
        keep = kv_idx < sk
        if causal:
            keep = keep & (kv_idx <= i)
        if window is not None:
            keep = keep & (kv_idx >= i - window[0]) & (kv_idx <= i + window[1])
        return keep | (kv_idx == sk) if sink else keep

    return create_block_mask(visible, None, None, sq, sk + int(sink), device=device)


def _flex_attend(q, k, v, scale: float, causal: bool, window, sink) -> torch.Tensor:
    """CUDA: FlexAttention (compiled) for windows and sinks, no [s, s] tensor. The sink is a zero key / zero
    value column whose score is replaced by the head's sink logit."""
    sk = k.shape[2]
    block_mask = _block_mask(q.shape[2], sk, causal and q.shape[2] > 1, window, sink is not None, str(q.device))
    score_mod = None
    if sink is not None:
        k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[3])], dim=2)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[3])], dim=2)
        logits = sink.to(torch.float32)

        def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ARG001 - FlexAttention's signature
            return torch.where(kv_idx == sk, logits[h], score)

    return _compiled_flex()(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
