"""The SDPA core attention (models/attention.py) against megatron-core's DotProductAttention and a dense fp64
reference.

- core attention alone (one process, TP1): causal GQA 8 query / 2 KV heads, a left-padding mask, a window
  and a learnable sink vs megatron's DotProductAttention on the same q / k / v: forward and q / k / v
  gradients within 1e-6 (fp32); windows and sinks vs the fp64 reference, HF's sliding_window W = megatron's
  (W - 1, 0) pinned; fully masked rows give zeros and finite gradients (fp32, bf16); THD documents equal
  each document alone
- whole transformer layers at TP1 and TP2 (gloo, slow): output, input and weight gradients vs the same
  layer on megatron's DotProductAttention within 1e-6; an MLA layer (k/v channels, softmax scale) builds on
  it and runs forward and backward
- the local spec (LoRA and full fine-tuning alike when Transformer Engine is absent) names the class
"""

import contextlib
import math
import types

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.fusions import fused_softmax
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import dot_product_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from remax_megatron.models.attention import TorchDotProductAttention
from tests._dist import SharedLaunches

HEADS, GROUPS, HEAD_DIM = 8, 2, 16


class _OneRank:
    """A TP group of one process (the modules only ask its size)."""

    def size(self):
        return 1

    def rank(self):
        return 0


def _config(**overrides) -> TransformerConfig:
    kw = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


@pytest.fixture
def megatron_on_cpu(monkeypatch):
    """megatron's DotProductAttention on CPU in this process: its score buffer, dropout RNG fork, masks and
    sink parameter all name CUDA."""

    class Buffer:
        def get_tensor(self, shape, dtype, name):  # noqa: ARG002
            return torch.empty(shape, dtype=dtype)

    tracker = types.SimpleNamespace(fork=contextlib.nullcontext)
    monkeypatch.setattr(dot_product_attention.parallel_state, "get_global_memory_buffer", lambda: Buffer())
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: tracker)
    monkeypatch.setattr(fused_softmax, "get_default_causal_mask", lambda s: torch.ones(s, s, dtype=torch.bool).triu(1))
    monkeypatch.setattr(fused_softmax, "get_sliding_window_causal_mask", _megatron_window_mask_cpu)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def _megatron_window_mask_cpu(sq, skv, window_size):
    # megatron's get_sliding_window_causal_mask, on CPU (its own builds on device="cuda")
    m = torch.ones(sq, skv, dtype=torch.bool)
    return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])


def _ours(config, layer_number=1, **kw) -> TorchDotProductAttention:
    tp = types.SimpleNamespace(tp=_OneRank())
    return TorchDotProductAttention(config, layer_number, AttnMaskType.causal, "self", pg_collection=tp, **kw)


def _pair(config, **kw):
    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    args["pg_collection"] = types.SimpleNamespace(tp=_OneRank())
    ours, theirs = TorchDotProductAttention(**args, **kw), DotProductAttention(**args, **kw)
    if theirs.softmax_offset is not None and isinstance(theirs.softmax_offset, torch.nn.Parameter):
        with torch.no_grad():
            ours.softmax_offset.copy_(theirs.softmax_offset)
    return ours, theirs


def _qkv(s=12, b=3, dtype=torch.float32, seed=0, hv=HEAD_DIM):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, HEADS, HEAD_DIM, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(s, b, GROUPS, HEAD_DIM, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(s, b, GROUPS, hv, generator=g, dtype=torch.float64).to(dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def _run(module, qkv, mask=None, weight=None, **kw):
    """Output and the gradients of q, k, v (and of the sink, if any) under a fixed random cotangent."""
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv)
    module.zero_grad()
    out = module(q, k, v, mask, **kw)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    if weight is not None:
        cotangent = cotangent * weight
    (out.double() * cotangent).sum().backward()
    sink = module.softmax_offset
    extra = [sink.grad] if isinstance(sink, torch.nn.Parameter) else []
    return [out, q.grad, k.grad, v.grad, *extra]


def _assert_close(ours, theirs, tol=1e-6):
    """max |diff| <= tol, relative to the tensor's largest entry when that exceeds 1 (fp32 rounding of a
    gradient of size 10 is already 1e-6)."""
    for name, a, b in zip(["out", "dq", "dk", "dv", "dsink"], ours, theirs):
        err = (a.double() - b.double()).abs().max().item()
        scale = max(1.0, b.double().abs().max().item())
        assert err <= tol * scale, f"{name}: max |diff| {err:.3g} > {tol} * {scale:.3g}"


def _reference(qkv, allowed, scale, sink=None):
    """Dense fp64 attention: allowed [b|1, 1, sq, sk] (True = may see); sink [heads] an extra logit with no
    value; a row that sees nothing gives 0. -> [sq, b, heads * hv]"""
    q, k, v = (x.detach().double().permute(1, 2, 0, 3) for x in qkv)  # [b, n, s, h]
    k, v = (x.repeat_interleave(HEADS // GROUPS, dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        column = sink.detach().double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if sink is not None:
        probs = probs[..., :-1]
    out = probs @ v
    s, b = out.shape[2], out.shape[0]
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def _hf_sliding(s, window):
    """transformers' sliding-window causal mask: query i sees key j when i - window < j <= i."""
    i, j = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
    return ((j <= i) & (j > i - window)).view(1, 1, s, s)


def test_causal_gqa_matches_megatron(megatron_on_cpu):
    ours, theirs = _pair(_config())
    qkv = _qkv()
    got, want = _run(ours, qkv), _run(theirs, qkv)
    _assert_close(got, want)
    s = qkv[0].shape[0]
    causal = torch.ones(s, s, dtype=torch.bool).tril().view(1, 1, s, s)
    assert (got[0].double() - _reference(qkv, causal, 1 / math.sqrt(HEAD_DIM))).abs().max() < 1e-6


def test_padding_mask_matches_megatron_and_masked_rows_are_zero(megatron_on_cpu):
    """Left padding: rows 1 and 2 start with 3 and 5 pad tokens. Queries on padding see no key: megatron
    gives them the mean of all values (its -10000 fill), this module 0; the live rows agree."""
    s, b = 12, 3
    pads = torch.tensor([0, 3, 5])
    key_pad = torch.arange(s).view(1, -1) < pads.view(-1, 1)  # [b, sk]
    mask = (key_pad.view(b, 1, 1, s) | torch.ones(s, s, dtype=torch.bool).triu(1)).expand(b, 1, s, s)
    live = (~key_pad).t().unsqueeze(-1).double()  # [s, b, 1]
    ours, theirs = _pair(_config())
    qkv = _qkv(s, b)
    got, want = _run(ours, qkv, mask, weight=live), _run(theirs, qkv, mask, weight=live)
    got_live, want_live = [got[0] * live, *got[1:]], [want[0] * live, *want[1:]]
    _assert_close(got_live, want_live)
    assert got[0][~live.bool().squeeze(-1)].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_fully_masked_rows_zero_and_finite(dtype, softmax_type):
    """Every key of row 1 masked (a padding-only row): its output is 0 and every gradient finite."""
    config = _config(params_dtype=dtype, softmax_type=softmax_type, bf16=dtype == torch.bfloat16)
    module = _ours(config)
    s, b = 10, 2
    mask = torch.ones(s, s, dtype=torch.bool).triu(1).repeat(b, 1, 1, 1)
    mask[1] = True
    q, k, v = _qkv(s, b, dtype)
    out = module(q, k, v, mask)
    assert out.dtype == dtype
    assert out[:, 1].abs().max() == 0 and out[:, 0].abs().max() > 0
    out.float().square().sum().backward()
    for name, grad in [("q", q.grad), ("k", k.grad), ("v", v.grad)]:
        assert torch.isfinite(grad).all(), name
    assert q.grad[:, 1].abs().max() == 0
    if softmax_type == "learnable":
        assert torch.isfinite(module.softmax_offset.grad).all()


@pytest.mark.parametrize("window", [1, 3, 5])
def test_window_matches_megatron_and_hf_off_by_one(megatron_on_cpu, window):
    """megatron's window_size (w, 0) = HF's sliding_window w + 1 (a token sees itself and w earlier ones);
    HF's sliding_window w is a different (narrower) mask, which the module's output must not match."""
    s = 12
    config = _config(window_size=(window, 0), window_attn_skip_freq=None)
    ours, theirs = _pair(config)
    qkv = _qkv(s)
    got = _run(ours, qkv)
    _assert_close(got, _run(theirs, qkv))
    scale = 1 / math.sqrt(HEAD_DIM)
    assert (got[0].double() - _reference(qkv, _hf_sliding(s, window + 1), scale)).abs().max() < 1e-6
    assert (got[0].double() - _reference(qkv, _hf_sliding(s, window), scale)).abs().max() > 1e-3


def test_window_per_layer():
    """window_attn_skip_freq=2: layers 1, 3 windowed, 2, 4 full (megatron's is_layer_window_attention); a list
    names them one by one."""
    config = _config(num_layers=4, window_size=(3, 0), window_attn_skip_freq=2)
    windows = [_ours(config, n).window_size for n in (1, 2, 3, 4)]
    assert windows == [(3, 0), None, (3, 0), None]
    config = _config(num_layers=4, window_size=(3, 0), window_attn_skip_freq=[0, 1, 1, 0])
    windows = [_ours(config, n).window_size for n in (1, 2, 3, 4)]
    assert windows == [None, (3, 0), (3, 0), None]


def test_window_narrows_a_given_mask():
    """A padding mask and a window together: both apply (megatron's window mask replaces the mask)."""
    s, b, window = 12, 2, 2
    config = _config(window_size=(window, 0), window_attn_skip_freq=None)
    module = _ours(config)
    key_pad = torch.zeros(b, s, dtype=torch.bool)
    key_pad[1, :4] = True
    mask = key_pad.view(b, 1, 1, s) | torch.ones(s, s, dtype=torch.bool).triu(1)
    qkv = _qkv(s, b)
    allowed = ~mask & _hf_sliding(s, window + 1)
    want = _reference(qkv, allowed, 1 / math.sqrt(HEAD_DIM))
    assert (module(*qkv, mask).double() - want).abs().max() < 1e-6


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
def test_sink_matches_megatron_and_reference(megatron_on_cpu, softmax_type):
    config = _config(softmax_type=softmax_type)
    ours, theirs = _pair(config)
    if softmax_type == "learnable":
        assert ours.softmax_offset.shape == theirs.softmax_offset.shape == (HEADS,)
        assert "softmax_offset" in dict(ours.named_parameters())
        with torch.no_grad():  # sinks of both signs and sizes
            theirs.softmax_offset.copy_(torch.linspace(-3, 4, HEADS))
            ours.softmax_offset.copy_(theirs.softmax_offset)
    qkv = _qkv()
    got = _run(ours, qkv)
    _assert_close(got, _run(theirs, qkv))
    s = qkv[0].shape[0]
    causal = torch.ones(s, s, dtype=torch.bool).tril().view(1, 1, s, s)
    scale = 1 / math.sqrt(HEAD_DIM)
    sink = ours.softmax_offset if softmax_type == "learnable" else torch.zeros(HEADS)
    assert (got[0].double() - _reference(qkv, causal, scale, sink)).abs().max() < 1e-6
    assert (got[0].double() - _reference(qkv, causal, scale)).abs().max() > 1e-3  # the sink changes the output


def test_sink_with_window_vs_reference():
    s, window = 12, 3
    config = _config(softmax_type="learnable", window_size=(window, 0), window_attn_skip_freq=None)
    module = _ours(config)
    with torch.no_grad():
        module.softmax_offset.copy_(torch.linspace(-2, 2, HEADS))
    qkv = _qkv(s)
    want = _reference(qkv, _hf_sliding(s, window + 1), 1 / math.sqrt(HEAD_DIM), module.softmax_offset)
    assert (module(*qkv, None).double() - want).abs().max() < 1e-6


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_flex_path_masks_and_sink_column(monkeypatch, softmax_type):
    """The CUDA path's block mask and sink column (FlexAttention), run here eagerly without gradients (CPU flex
    has no backward): equal to the dense fp64 reference, a window crossing FlexAttention's 128-token blocks."""
    from torch.nn.attention.flex_attention import flex_attention

    from remax_megatron.models import attention

    monkeypatch.setattr(attention, "_compiled_flex", lambda: flex_attention)
    s, window = 200, 40
    config = _config(softmax_type=softmax_type, window_size=(window - 1, 0), window_attn_skip_freq=None)
    module = _ours(config)
    sink = None
    if softmax_type == "learnable":
        with torch.no_grad():
            module.softmax_offset.copy_(torch.linspace(-2, 3, HEADS))
        sink = module.softmax_offset.detach()
    qkv = _qkv(s, 1)
    q, k, v = (x.detach().permute(1, 2, 0, 3) for x in qkv)
    with torch.no_grad():
        out = attention._flex_attend(q, k, v, module.softmax_scale, True, module.window_size, sink)
    got = out.permute(2, 0, 1, 3).reshape(s, 1, -1)
    want = _reference(qkv, _hf_sliding(s, window), 1 / math.sqrt(HEAD_DIM), sink)
    assert (got.double() - want).abs().max() < 1e-5


def test_k_v_channels_and_scale():
    """MLA's arguments: query/key head dim != value head dim, its own softmax scale."""
    config = _config()
    module = _ours(config, softmax_scale=0.3, k_channels=HEAD_DIM, v_channels=24)
    qkv = _qkv(hv=24)
    out = module(*qkv, None)
    s = qkv[0].shape[0]
    assert out.shape == (s, 3, HEADS * 24)
    causal = torch.ones(s, s, dtype=torch.bool).tril().view(1, 1, s, s)
    assert (out.double() - _reference(qkv, causal, 0.3)).abs().max() < 1e-6


def test_thd_documents_equal_each_document_alone():
    """Packed THD rows (cu_seqlens) equal each document run alone; one cu_seqlens entry dropped (two documents
    seeing each other) does not."""
    config = _config(softmax_type="learnable", window_size=(4, 0), window_attn_skip_freq=None)
    module = _ours(config)
    lengths = [5, 9, 1, 7]
    q, k, v = (x[:, 0] for x in _qkv(sum(lengths), 1))  # [t, n, h]

    def packed(bounds):
        cu = torch.tensor(bounds, dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
        return module(q, k, v, None, packed_seq_params=params)

    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    alone = torch.cat(
        [module(*(x[a:e].unsqueeze(1) for x in (q, k, v)), None)[:, 0] for a, e in zip(bounds, bounds[1:])]
    )
    got = packed(bounds)
    assert got.shape == alone.shape
    assert (got - alone).abs().max() < 1e-6
    leaky = packed([b for b in bounds if b != bounds[2]])
    assert (leaky - alone).abs().max() > 1e-3


def test_local_spec_uses_it_for_lora_and_full_fine_tuning(monkeypatch):
    """With no Transformer Engine the full fine-tuning spec and the LoRA spec (local=True) build the same
    core attention class."""
    from remax_megatron.models import gpt

    monkeypatch.setattr(gpt, "transformer_engine_usable", lambda: False)
    config = _config()
    for local in (False, True):
        spec = gpt.layer_spec(config, pp_rank=0, local=local)
        assert spec.layer_specs[0].submodules.self_attention.submodules.core_attention is TorchDotProductAttention


def test_refuses_context_parallel():
    config = _config()
    config.context_parallel_size = 2
    with pytest.raises(ValueError, match="context_parallel_size=2"):
        _ours(config)


# ---- whole layers on gloo: TP1 and TP2, and MLA ----


def _layer_parity(rank, world, tp, tmp):  # noqa: ARG001
    """One transformer layer on megatron's DotProductAttention and the same weights on the SDPA one: output,
    input and weight gradients within 1e-6 (fp32, causal, GQA 8 / 2)."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from remax_megatron.parallel.layout import ParallelLayout
    from remax_megatron.parallel.cpu_compat import redirect_cuda

    ParallelLayout(tp=tp, pp=1, world_size=world).initialize(seed=0)
    config = _config(tensor_model_parallel_size=tp, num_layers=1)
    spec_theirs = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec_ours = copy.deepcopy(spec_theirs)
    spec_ours.submodules.self_attention.submodules.core_attention = TorchDotProductAttention
    with redirect_cuda():
        theirs = spec_theirs.module(config, spec_theirs.submodules, layer_number=1)
        ours = spec_ours.module(config, spec_ours.submodules, layer_number=1)
    assert type(ours.self_attention.core_attention) is TorchDotProductAttention
    ours.load_state_dict(theirs.state_dict())
    s, b = 16, 2
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(s, b, config.hidden_size, generator=g)
    cotangent = torch.randn(s, b, config.hidden_size, generator=g)
    results = []
    for layer in (theirs, ours):
        x = hidden.clone().requires_grad_()
        out, _ = layer(x, attention_mask=None)
        (out * cotangent).sum().backward()
        grads = {n: p.grad for n, p in layer.named_parameters()}
        results.append((out, x.grad, grads))
    (out_t, dx_t, grads_t), (out_o, dx_o, grads_o) = results
    assert (out_t - out_o).abs().max() <= 1e-6
    assert (dx_t - dx_o).abs().max() <= 1e-6
    assert grads_t.keys() == grads_o.keys() and grads_t
    for name in grads_t:
        err = (grads_t[name] - grads_o[name]).abs().max()
        assert err <= 1e-6, f"{name}: {err:.3g}"


def _mla_layer(rank, world, tp, tmp):  # noqa: ARG001
    """A megatron-core MLA layer (local spec, multi_latent_attention=True) on the SDPA core attention: builds
    with k_channels = qk_head_dim + qk_pos_emb_head_dim != v_channels and MLA's scale; forward and backward
    are finite, and its output equals the layer's own q / k / v through the fp64 reference."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import multi_latent_attention as mla_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from remax_megatron.parallel.layout import ParallelLayout
    from remax_megatron.parallel.cpu_compat import redirect_cuda

    ParallelLayout(tp=tp, pp=1, world_size=world).initialize(seed=0)  # cpu_compat: RoPE tables on CPU
    if not isinstance(mla_module.TELinear, type):
        # Without TE megatron's MLA isinstance-checks a mock (the DeepSeek-V3 family's patch_mla_for_cpu
        # does the same for models it builds).
        mla_module.TELinear = type("NoTransformerEngineLinear", (), {})
    config = MLATransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        q_lora_rank=24,
        kv_lora_rank=20,
        qk_head_dim=12,
        qk_pos_emb_head_dim=6,
        v_head_dim=10,
        rope_type="rope",
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        normalization="RMSNorm",
    )
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = TorchDotProductAttention
    with redirect_cuda():
        layer = spec.module(config, spec.submodules, layer_number=1)
    core = layer.self_attention.core_attention
    assert type(core) is TorchDotProductAttention
    assert (core.k_channels, core.v_channels) == (18, 10)
    assert core.softmax_scale == pytest.approx(1 / math.sqrt(18))
    seen = {}
    forward = core.forward

    def spy(query, key, value, *args, **kwargs):
        seen["qkv"] = (query.detach(), key.detach(), value.detach())
        return forward(query, key, value, *args, **kwargs)

    core.forward = spy
    s, b = 9, 2
    x = torch.randn(s, b, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out, _ = layer(x, attention_mask=None)  # MLA applies its own RoPE
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().max() > 0
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    q, k, v = (t.double() for t in seen["qkv"])  # [s, b, n, h]; MLA keys have one head per query head
    scores = torch.einsum("sbnh,tbnh->bnst", q, k) * core.softmax_scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("bnst,tbnh->sbnh", torch.softmax(scores, -1), v).reshape(s, b, -1)
    got = forward(*seen["qkv"], None)
    assert (got.double() - want).abs().max() < 1e-6


PACKED_LENGTHS = [7, 3, 11, 5, 1, 9]


def _packed_vs_padded(rank, world, tp, model_dir, tmp):  # noqa: ARG001
    """An actor's log-probs on documents packed in one THD row (batching.assemble) equal the same documents
    right-padded within 1e-6 (fp32; TP2 with sequence parallel); with one boundary dropped from cu_seqlens (two
    documents see each other) they do not."""
    from remax_megatron.batching.micro_batches import MicroBatch, assemble, model_inputs, model_labels, to_sequences
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.forward import forward_only
    from remax_megatron.parallel import ParallelLayout

    ParallelLayout(tp=tp, pp=1, world_size=world).initialize(seed=0)
    sp = tp > 1
    model = build_policy(read_hf_config(model_dir), tp=tp, pp=1, sequence_parallel=sp)
    model.eval()
    n, width = len(PACKED_LENGTHS), max(PACKED_LENGTHS) + 1  # + 1: a multiple of 2 for sequence parallel
    lengths = torch.tensor(PACKED_LENGTHS)
    ids = torch.randint(4, 100, (n, width), generator=torch.Generator().manual_seed(5))
    real = torch.arange(width)[None, :] < lengths[:, None]
    ids = ids * real
    labels = torch.where(real, torch.roll(ids, -1, dims=1), -100)
    batch = {"input_ids": ids, "labels": labels, "lengths": lengths}
    rows = list(range(n))

    def logprobs(mb):
        def head(m, hidden, micro):
            return to_sequences(micro, m.token_logprobs(hidden, model_labels(micro))[0])

        (out,) = forward_only(model, [mb], head, inputs=model_inputs)
        return out.masked_fill(~real, 0.0)  # [n, width]

    multiple = 2 if sp else 1
    padded = logprobs(assemble(batch, MicroBatch(rows, width), multiple=multiple))
    packed_mb = assemble(batch, MicroBatch(rows, width, bins=[rows], row_width=sum(PACKED_LENGTHS)), multiple=multiple)
    packed = logprobs(packed_mb)
    assert padded.abs().max() > 1
    err = (packed - padded).abs().max().item()
    assert err <= 1e-6, f"packed vs padded: max |diff| {err:.3g}"
    cu = packed_mb["cu_seqlens"].tolist()
    merged = cu[:2] + cu[3:]  # documents 1 and 2 as one (RoPE's table must cover it: max_seqlen)
    longest = torch.tensor(max(e - s for s, e in zip(merged, merged[1:])), dtype=torch.int32)
    leaky = dict(packed_mb, cu_seqlens=torch.tensor(merged, dtype=torch.int32), max_seqlen=longest)
    leaked = (logprobs(leaky) - padded).abs().max().item()
    assert leaked > 1e-3, f"a mask letting document 2 see document 1 moved nothing ({leaked:.3g})"


CASES = {
    2: {
        "layer_tp1": (_layer_parity, (1,)),
        "layer_tp2": (_layer_parity, (2,)),
        "mla_tp1": (_mla_layer, (1,)),
        "mla_tp2": (_mla_layer, (2,)),
        "packed_tp1": (_packed_vs_padded, (1,)),
        "packed_tp2": (_packed_vs_padded, (2,)),
    }
}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    tmp = str(tmp_path_factory.mktemp("attn"))
    # GQA 4 / 2 heads, 2 layers, random weights (the same on every rank: one directory)
    model_dir = make_tiny_model(f"{tmp}/llama", "llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, seed=4)
    model_args = {_packed_vs_padded: (model_dir,)}
    cases = {
        w: {n: (fn, (*args, *model_args.get(fn, ()), tmp)) for n, (fn, args) in c.items()} for w, c in CASES.items()
    }
    return SharedLaunches(cases, tmp)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_layer_matches_megatron_attention(launches, tp):
    launches.check(f"layer_tp{tp}")


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_mla_layer_builds_and_runs(launches, tp):
    launches.check(f"mla_tp{tp}")


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_documents_equal_padded_rows(launches, tp):
    launches.check(f"packed_tp{tp}")
