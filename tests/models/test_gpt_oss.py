"""gpt-oss (`gpt_oss`, GptOssForCausalLM): sinks, alternating sliding / full layers, YaRN, biased router and
experts with the clamped SwiGLU (models/families/gpt_oss.py).

A tiny random checkpoint with odd shapes: head_dim 12 (not a power of two), 6 query heads over 2 KV heads,
vocab 300 (not a multiple of 128), 4 layers: window of 5 tokens, full, full, window; 4 experts (2
per token) of width 20, nonzero sinks and biases everywhere (o_proj, q/k/v, router, experts); YaRN factor 4.
The parity rows are 17, 11 and 6 tokens long, longer than the window.

Fast lane: the mapping names every checkpoint tensor once (the fused experts read per expert), the config
mapping, one-line refusals, flops with windows, the planner on gpt-oss-20b / -120b's published shapes.
Slow (multi-process, gloo): megatron's fp32 log-probs vs transformers' at TP1, TP2 (SP) x PP2, EP2; HF ->
megatron -> HF bitwise at TP2 x PP2 and EP2; broken mappings fail that parity; LoRA on attention; routing
replay; the native engine's gap to a TP2 actor over a 3-step run.
"""

import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open

from remax_megatron.models import read_hf_config
from tests._dist import SharedLaunches
from tests.models.family_helpers import (
    assert_parity,
    attention_lora_model,
    edit_config,
    hf_logprobs,
    replay_body,
    round_trip_body,
    three_steps,
)
from tools.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = dict(hidden=48, layers=4, heads=6, kv_heads=2, ffn=20, vocab=300, head_dim=12)
WINDOW = 5  # < the parity rows (family_helpers.rows, 18 long): the windowed layers drop keys
# not periodic in 2 layers: at PP2 the second stage's layers are windowed by their global index
LAYER_TYPES = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
OPTIONS = dict(experts=4, top_k=2, sliding_window=WINDOW, layer_types=LAYER_TYPES)


def tiny_gpt_oss(path, seed=3, **extra):
    return make_tiny_model(str(path), "gpt_oss", seed=seed, **{**SHAPE, **OPTIONS, **extra})


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    return tiny_gpt_oss(tmp_path_factory.mktemp("oss") / "tiny")


# ---- fast lane ---------------------------------------------------------------------------------------------------


def test_config_maps_to_megatron(oss):
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from remax_megatron.models.hf_config import transformer_config

    arch = read_hf_config(oss)
    assert (arch.family, arch.qkv_bias, arch.linear_bias, arch.attention_sinks) == ("gpt_oss", True, True, True)
    assert arch.layer_windows == (WINDOW, None, None, WINDOW)
    assert dict(arch.yarn)["factor"] == 4.0 and arch.swiglu_limit == 7.0
    config = transformer_config(arch, tp=1, pp=1)
    assert config.window_size == (WINDOW - 1, 0) and config.window_attn_skip_freq == [1, 0, 0, 1]
    assert config.softmax_type == "learnable" and config.add_bias_linear
    assert config.activation_func is quick_gelu and config.glu_linear_offset == 1.0
    assert config.activation_func_clamp_value == 7.0 and not config.moe_grouped_gemm
    assert config.yarn_rotary_scaling_factor == 4.0 and not config.yarn_correction_range_round_to_int
    assert config.softmax_scale is None  # YaRN's concentration factor: megatron's attention scales cos / sin


def test_mapping_makes_every_checkpoint_tensor_once(oss):
    from remax_megatron.weights.hf_io import HFCheckpointReader
    from remax_megatron.weights.mapping import WeightMapping

    arch = read_hf_config(oss)
    mapping = WeightMapping(arch, tp=1, pp=1, padded_vocab=384)
    names = [n for spec in mapping.exported_specs() for n in spec.hf]
    reader = HFCheckpointReader(oss)
    assert sorted(names) == sorted(reader.names()) and len(set(names)) == len(names)
    with safe_open(os.path.join(oss, "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    fused = stored["model.layers.2.mlp.experts.gate_up_proj"]  # [E, hidden, 2 f], gate / up interleaved
    assert torch.equal(reader.read("model.layers.2.mlp.experts.3.up_proj.weight"), fused[3, :, 1::2].t())
    assert torch.equal(reader.read("model.layers.2.mlp.experts.1.gate_proj.weight", 0, 5, 9), fused[1, :, 10:18:2].t())
    by_name = {spec.megatron: spec for spec in mapping.specs}
    sink = by_name["decoder.layers.1.self_attention.core_attention.softmax_offset"]
    assert sink.hf == ("model.layers.1.self_attn.sinks",) and sink.kind == "column"
    assert by_name["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.bias"].kind == "fc1"


def test_fusing_the_per_expert_stream_gives_the_checkpoint_back(oss):
    from remax_megatron.models.families import gpt_oss
    from remax_megatron.weights.hf_io import HFCheckpointReader

    with safe_open(os.path.join(oss, "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    fused = dict(gpt_oss.fuse_stream(HFCheckpointReader(oss).tensors()))
    assert sorted(fused) == sorted(stored)
    assert all(torch.equal(fused[k], stored[k]) for k in stored)


def test_mxfp4_experts_read_per_expert(tmp_path):
    """A published (MXFP4) checkpoint's experts read per expert: each view is the dequantized fused tensor's."""
    from safetensors.torch import save_file

    from remax_megatron.models.families import gpt_oss
    from remax_megatron.weights.hf_io import HFCheckpointReader
    from remax_megatron.weights.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    g = torch.Generator().manual_seed(0)
    fused = {"gate_up_proj": torch.randn(3, 64, 2 * 32, generator=g), "down_proj": torch.randn(3, 32, 64, generator=g)}
    tensors = {"model.layers.0.mlp.experts.gate_up_proj_bias": torch.randn(3, 64, generator=g)}
    for name, weight in fused.items():
        blocks, scales = quantize_mxfp4(weight)
        tensors.update(
            {f"model.layers.0.mlp.experts.{name}_blocks": blocks, f"model.layers.0.mlp.experts.{name}_scales": scales}
        )
        fused[name] = dequantize_mxfp4(blocks, scales, torch.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(
            {"model_type": "gpt_oss", "num_local_experts": 3, "quantization_config": {"quant_method": "mxfp4"}}, f
        )
    reader = HFCheckpointReader(str(tmp_path))
    assert len(reader.names()) == 3 * (2 + 1 + 2)  # gate / up / down weights, gate / up biases
    for name in reader.names():
        whole, expert, half = gpt_oss.split_expert_name(name)
        source = fused.get(whole.rsplit(".", 1)[1], tensors.get(whole))
        assert torch.equal(reader.read(name), gpt_oss.expert_view(source[expert], half)), name


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5"),
        ({"sliding_window": None}, "sliding_window=None with sliding layers"),
        ({"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
        ({"attention_bias": False}, "attention_bias=false"),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 4.0,
                    "mscale": 1.0,
                    "original_max_position_embeddings": 128,
                }
            },
            "mscale=1.0",
        ),
    ],
)
def test_what_megatron_cannot_express_is_refused_in_one_line(oss, tmp_path, changes, message):
    with pytest.raises(ValueError) as e:
        read_hf_config(edit_config(oss, tmp_path / "bad", **changes))
    line = str(e.value)
    assert message in line and "\n" not in line, line


def test_split_biased_experts_are_refused_in_one_line(oss):
    from remax_megatron.models.arch import ExpertOptions
    from remax_megatron.models.hf_config import transformer_config

    with pytest.raises(ValueError) as e:
        transformer_config(read_hf_config(oss), tp=2, pp=1, experts=ExpertOptions(etp=2))
    line = str(e.value)
    assert "expert biases only at expert tensor parallel size 1" in line and "\n" not in line, line


def test_flops_count_windows_and_sinks_free(oss):
    from remax_megatron.flops import forward_flops

    arch = read_hf_config(oss)
    h, q, kv, v = 48, 6 * 12, 2 * 12, 300
    per_token = 4 * (2 * h * (q + 2 * kv) + 2 * q * h + 2 * h * 4 + 6 * h * 20 * 2)
    s = 17
    pairs = 2 * (WINDOW * s - WINDOW**2 / 2) + 2 * s * s / 2  # 2 windowed, 2 full layers
    assert forward_flops(arch, [s]) == s * (per_token + 2 * h * v) + 2 * 2 * q * pairs


@pytest.mark.parametrize("name,params,nodes,ep", [("gpt-oss-20b", 20.91e9, 2, 8), ("gpt-oss-120b", 116.83e9, 8, 32)])
def test_planner_counts_published_shapes(tmp_path, capsys, name, params, nodes, ep):
    """OpenAI's model card: 20.91 B / 116.83 B parameters (sinks and biases included); windows read too. Layouts
    a user would pick (actor TP8, EP8 on 2 nodes / EP32 on 8 nodes of 8 GPUs) fit 80 GiB per GPU."""
    from remax_megatron import plan

    model = os.path.join(ROOT, "configs", "models", name)
    arch = read_hf_config(model)
    assert arch.layer_windows[:2] == (128, None) and arch.attention_sinks
    config = tmp_path / "c.yaml"
    config.write_text(
        f"actor:\n  model: {model}\n  dtype: bfloat16\n  tp: 8\n  pp: 1\n  sequence_parallel: true\n"
        f"  ep: {ep}\n  etp: 1\nrollout:\n  tp: 8\nreward:\n  functions: [exact_match]\n"
        "trainer:\n  prompts_per_step: 64\n"
    )
    assert plan.main(["--config", str(config), "--nodes", str(nodes), "--gpus-per-node", "8", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert abs(est["params"] / params - 1) < 0.002, est["params"]
    assert est["total_bytes"] < 80 * 2**30, est["total_bytes"] / 2**30


# ---- multi-process (gloo) ----------------------------------------------------------------------------------------


def _swap_sinks_and_biases(model):
    """Break on purpose: each layer's sink logits and the first heads' o_proj bias entries trade places."""
    for name, param in model.named_parameters():
        if name.endswith("core_attention.softmax_offset"):
            bias = model.get_parameter(name.replace("core_attention.softmax_offset", "linear_proj.bias"))
            n = param.numel()
            with torch.no_grad():
                saved = param.clone()
                param.copy_(bias[:n])
                bias[:n].copy_(saved)


def _halves_view(fused_expert, half):
    """Break on purpose: an expert's gate / up as the first / second half of the fused last dim."""
    width = fused_expert.shape[-1] // 2
    part = fused_expert if half is None else fused_expert[..., half * width : (half + 1) * width]
    return part.t() if part.dim() == 2 else part


def _parity_body(rank, world, model_dir, tp, pp, ep, expected, breaks=None):
    """megatron's fp32 log-probs vs transformers' (expected [3, 18]); `breaks`: what is broken on purpose
    (a ModelArch change, or "swap-sinks" / "interleaved"), the parity must then fail."""
    from remax_megatron.models import build_policy
    from remax_megatron.models.arch import ExpertOptions
    from remax_megatron.models.families import gpt_oss
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights

    etp = 1  # megatron-core builds biased experts only unsplit
    ParallelLayout(tp=tp, pp=pp, world_size=world, ep=ep, etp=etp).initialize(seed=0)
    arch = read_hf_config(model_dir)
    if isinstance(breaks, dict):
        arch = dataclasses.replace(arch, **breaks)
    model = build_policy(arch, tp=tp, pp=pp, sequence_parallel=tp > 1, experts=ExpertOptions(ep=ep, etp=etp))
    if breaks == "interleaved":  # gate and up read as the fused tensor's two halves, not its even / odd columns
        gpt_oss.expert_view = _halves_view
    load_hf_weights(model, model_dir)
    if breaks == "swap-sinks":
        _swap_sinks_and_biases(model)
    assert_parity(model, arch.vocab_size, expected, breaks, tp, pp, ep)


def _lora_body(rank, world, model_dir):
    """LoRA targets that exist in gpt-oss: attention's fused qkv and output projection (biased) in every layer;
    the experts are refused in one line."""
    from safetensors.torch import load_file

    from remax_megatron.models.families import gpt_oss
    from remax_megatron.weights import export_hf_weights

    model = attention_lora_model(world, model_dir)
    source = load_file(os.path.join(model_dir, "model.safetensors"))
    exported = dict(gpt_oss.fuse_stream(export_hf_weights(model)))  # B = 0: the merged export is the checkpoint
    assert sorted(exported) == sorted(source)
    for name, tensor in exported.items():
        assert torch.equal(tensor, source[name]), name


def _engine_body(rank, world, model_dir):
    """The native engine after one sync from the actor scores its own samples as transformers does: its
    decode (sinks through models' own SDPA path, windows, YaRN) gives the log-probs a fresh transformers
    model gives the same tokens (fp32 rule)."""
    from transformers import AutoModelForCausalLM

    from remax_megatron.config import RolloutConfig
    from remax_megatron.models import build_policy
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.rollout import SamplingParams, build_engine, sync_weights
    from remax_megatron.weights import export_hf_weights, load_hf_weights

    ParallelLayout(tp=1, pp=1, world_size=world).initialize(seed=0)
    arch = read_hf_config(model_dir)
    actor = build_policy(arch, tp=1, pp=1, trainable=False)
    load_hf_weights(actor, model_dir)
    engine = build_engine(RolloutConfig(engine="native"), hf_dir=model_dir, arch=arch, seed=0, dtype=torch.float32)
    sync_weights(engine, export_hf_weights(actor, bucket_mb=0.05), bucket_mb=0.05)
    prompts = [[5, 17, 40, 41, 42, 43, 44, 45], [9, 10]]
    (result,) = [engine.generate(prompts, n=2, sampling=SamplingParams(temperature=1.0, max_new_tokens=10, seed=3))]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gaps = []
    for prompt, rollout in zip(prompts, result):
        for completion in rollout.sampled:
            ids = torch.tensor([prompt + list(completion.token_ids)])
            with torch.no_grad():
                lp = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1 : -1].double(), -1)
            theirs = lp.gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
            gaps.append((torch.tensor(completion.logprobs, dtype=torch.float64) - theirs).abs())
    gaps = torch.cat(gaps)
    assert len(gaps) > 20 and gaps.max() <= 1e-4 and gaps.median() <= 1e-5, (gaps.max(), gaps.median())


# (HF -> megatron layout, megatron -> HF layout) as (tp, pp, ep, etp), 4 processes
# (etp 1: megatron-core builds biased experts only unsplit, and whole experts at TP2 need EP > 1)
ROUND_TRIPS = {"tp2-pp2-ep2": ((2, 2, 2, 1), (1, 1, 4, 1)), "ep2": ((1, 1, 2, 1), (2, 2, 2, 1))}
# (tp, pp, ep, world)
PARITY = {"tp1": (1, 1, 1, 1), "tp2-pp2-ep2": (2, 2, 2, 4), "ep2": (1, 1, 2, 2), "tp2-ep2": (2, 1, 2, 2)}
# broken on purpose: a ModelArch change, or what _parity_body breaks by name
BROKEN = {
    "swap-sinks-and-biases": "swap-sinks",
    "window-shifted-by-one-layer": {"layer_windows": (WINDOW, WINDOW, None, None)},
    "silu": {"swiglu_limit": None},  # megatron's SiLU SwiGLU: no quick_gelu, no clamp, no + 1
    "gate-up-not-deinterleaved": "interleaved",
}


@pytest.fixture(scope="module")
def launched(oss, tmp_path_factory):
    top = tmp_path_factory.mktemp("oss-launches")
    expected = hf_logprobs(oss, attn_implementation="eager")
    cases = {1: {}, 2: {}, 4: {}}
    for name, (to_megatron, to_hf) in ROUND_TRIPS.items():
        (top / name).mkdir()
        cases[4][f"round-trip-{name}"] = (
            round_trip_body,
            (oss, str(top / name / "ckpt"), str(top / name / "out"), to_megatron, to_hf),
        )
    for name, (tp, pp, ep, world) in PARITY.items():
        cases[world][f"parity-{name}"] = (_parity_body, (oss, tp, pp, ep, expected))
    for name, breaks in BROKEN.items():
        cases[1][f"broken-{name}"] = (_parity_body, (oss, 1, 1, 1, expected, breaks))
    cases[1]["lora"] = (_lora_body, (oss,))
    cases[1]["engine"] = (_engine_body, (oss,))
    # the native engine's routes come from transformers' GptOssTopKRouter; etp 1: megatron-core builds biased
    # experts only unsplit; no dense layers
    cases[2]["replay-tp2-ep2"] = (replay_body, (oss, 2, 1, 2, 1, 0))
    return SharedLaunches(cases, str(top / "launches"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_round_trip_is_bitwise(launched, name):
    launched.check(f"round-trip-{name}")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PARITY))
def test_logprobs_match_transformers(launched, name):
    launched.check(f"parity-{name}")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_mapping_fails_parity(launched, name):
    launched.check(f"broken-{name}")


@pytest.mark.slow
def test_lora_targets_attention_and_refuses_experts(launched):
    launched.check("lora")


@pytest.mark.slow
def test_native_engine_scores_as_transformers(launched):
    launched.check("engine")


@pytest.mark.slow
def test_routing_replay(launched):
    launched.check("replay-tp2-ep2")


def test_vllm_is_refused_in_one_line(oss):
    from remax_megatron.config import RolloutConfig
    from remax_megatron.rollout.vllm_engine import VllmEngine

    with pytest.raises(ValueError) as e:
        VllmEngine.check_config(RolloutConfig(engine="vllm", kv_cache_gib=0.01), read_hf_config(oss), 1)
    line = str(e.value)
    assert "rollout.engine=vllm" in line and "rollout.engine=native" in line and "\n" not in line


@pytest.mark.slow
def test_native_engine_follows_a_tp2_actor_over_three_steps(oss, tmp_path):
    """Engine-vs-actor log-prob gap (fp32 CPU) at every step of a 3-step ReMax run with a TP2 (sequence
    parallel, EP2) actor: rounding only, so the weights, sinks and biases reach the engine every sync."""
    from tests.train.test_train_e2e import assert_fp32_rounding_only

    train = three_steps(oss, tmp_path / "run", "native", "actor.ep=2", "actor.etp=1")
    assert len(train) == 3 and all(r["rollout/tokens"] > 0 for r in train)
    assert_fp32_rounding_only(r["logprob/engine_vs_actor_max_diff"] for r in train)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["actor.moe_experts=grouped"], "grouped experts take no quick_gelu"),
        (["actor.tp=2", "actor.sequence_parallel=true", "actor.ep=2"], "actor.etp=2 (default: the tp)"),
    ],
)
def test_expert_settings_gpt_oss_cannot_run_are_refused_in_one_line(oss, overrides, message):
    from remax_megatron.config import load_config
    from remax_megatron.models.arch import expert_options

    cfg = load_config(None, [f"actor.model={oss}", "reward.functions=[exact_match]", *overrides])
    with pytest.raises(ValueError) as e:
        expert_options(cfg, read_hf_config(oss))
    line = str(e.value)
    assert message in line and "\n" not in line, line
    if "actor.ep=2" in overrides:  # with etp 1: whole experts, SequentialMLP
        ok = load_config(None, [f"actor.model={oss}", "reward.functions=[exact_match]", *overrides, "actor.etp=1"])
        options = expert_options(ok, read_hf_config(oss))
        assert (options.ep, options.etp, options.grouped_gemm) == (2, 1, False)
