"""GLM-4.5 (`glm4_moe`) and the DeepSeek-style MoE it shares with DeepSeek-V3 (models/families/deepseek_moe.py).

A tiny random checkpoint with odd shapes: head_dim 20 (not a power of two) with partial RoPE (10 of 20 dims),
6 query heads over 2 KV heads, q/k biases, vocab 300 (not a multiple of 128), one dense layer then three MoE
layers of 4 experts (2 per token) plus a shared expert, sigmoid routing with a nonzero correction bias and a
routed scaling factor of 1.5.

Fast lane: the mapping names every checkpoint tensor once, the config mapping, the refusals, flops, the
planner on GLM-4.5-Air's published shapes, vLLM's one-line refusal of widths its CPU experts cannot sync.
Slow (multi-process, gloo): HF -> megatron -> HF bitwise through both converters at TP2 x PP2 and EP2;
megatron's fp32 log-probs over padded rows vs transformers' at TP1, TP2 (SP) x PP2, EP2, TP2 x EP2 and with
group-limited top-k; a bfloat16 export keeps the correction bias float32; broken mappings (no correction
bias, full instead of partial RoPE, no group limit) fail that parity; routing replay past the dense layer;
LoRA on attention; the native and vLLM engines' gap to a TP2 actor over a 3-step run, and its exact resume.
"""

import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open

from remax_megatron.models import read_hf_config
from tests._dist import SharedLaunches
from tests._needs import needs_vllm
from tests.models.family_helpers import (
    assert_parity,
    attention_lora_model,
    edit_config,
    hf_logprobs,
    replay_body,
    round_trip_body,
    three_steps,
    with_mtp_layer,
)
from tools.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = dict(hidden=72, layers=4, heads=6, kv_heads=2, ffn=80, vocab=300, head_dim=20, moe_ffn=24)
OPTIONS = dict(experts=4, top_k=2, first_dense=1, shared_experts=1, routed_scaling_factor=1.5)


def tiny_glm(path, seed=3, **extra):
    return make_tiny_model(str(path), "glm4_moe", seed=seed, **{**SHAPE, **OPTIONS, **extra})


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return tiny_glm(tmp_path_factory.mktemp("glm") / "tiny")


# ---- fast lane ---------------------------------------------------------------------------------------------------


def test_config_maps_to_megatron(glm):
    from remax_megatron.models.hf_config import transformer_config

    arch = read_hf_config(glm)
    assert (arch.family, arch.qkv_bias, arch.qk_layernorm, arch.rotary_percent) == ("glm4_moe", True, False, 0.5)
    assert (arch.first_dense_layers, arch.moe_layers, arch.moe_shared_ffn_hidden_size) == (1, 3, 24)
    assert (arch.moe_score_function, arch.moe_expert_bias, arch.moe_topk_scaling_factor) == ("sigmoid", True, 1.5)
    config = transformer_config(arch, tp=1, pp=1)
    assert config.moe_layer_freq == [0, 1, 1, 1] and config.moe_shared_expert_intermediate_size == 24
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 0.0  # frozen
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_topk_scaling_factor == 1.5
    assert config.moe_router_num_groups is None  # n_group 1: plain top-k


def test_mapping_makes_every_checkpoint_tensor_once(glm):
    from remax_megatron.weights.mapping import WeightMapping

    arch = read_hf_config(glm)
    mapping = WeightMapping(arch, tp=1, pp=1, padded_vocab=384)
    names = [n for spec in mapping.exported_specs() for n in spec.hf]
    with safe_open(os.path.join(glm, "model.safetensors"), "pt") as f:
        stored = sorted(f.keys())
    assert sorted(names) == stored and len(set(names)) == len(names)
    by_name = {spec.megatron: spec for spec in mapping.specs}
    assert "decoder.layers.0.mlp.linear_fc1.weight" in by_name  # the dense first layer
    assert not any(name.startswith("decoder.layers.0.mlp.router") for name in by_name)
    bias = by_name["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.hf == ("model.layers.1.mlp.gate.e_score_correction_bias",) and bias.fp32 and bias.expert is None
    shared = by_name["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"]
    assert shared.kind == "fc1" and shared.expert is None  # split over TP like a dense MLP


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob=false"),
        ({"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
        ({"n_group": 2, "topk_group": 1}, "scores a group by its top 2 experts where transformers sums the top 2"),
        ({"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}, "top 1 experts"),
        # 5 of 20 dims: RoPE rotates pairs (transformers reads the factor from rope_parameters)
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
            "partial_rotary_factor=0.25",
        ),
        ({"first_k_dense_replace": 4}, "leaves no MoE layer"),
        ({"scoring_func": "softmax"}, "only sigmoid scores with the correction bias"),
    ],
)
def test_routing_megatron_cannot_express_is_refused_in_one_line(glm, tmp_path, changes, message):
    if changes.get("n_group") == 2:  # 2 per token over groups of 2, one group chosen: top 2 == top 2, runs
        arch = read_hf_config(edit_config(glm, tmp_path / "ok", **changes))
        assert (arch.moe_num_groups, arch.moe_group_topk) == (2, 1)
        return
    with pytest.raises(ValueError) as e:
        read_hf_config(edit_config(glm, tmp_path / "bad", **changes))
    line = str(e.value)
    assert message in line and "\n" not in line, line


def test_mtp_layers_are_skipped_with_one_line(glm, tmp_path, capsys):
    from remax_megatron.models.families.deepseek_moe import say_mtp_dropped, say_mtp_not_written

    arch = read_hf_config(edit_config(glm, tmp_path / "mtp", num_nextn_predict_layers=1))
    assert arch.mtp_layers == 1 and arch.num_layers == 4  # not built
    say_mtp_dropped(arch, "src")
    say_mtp_not_written(arch, "out")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "skipped on import" in lines[0] and "wrote no multi-token-prediction" in lines[1]


def test_flops_count_dense_first_layers_and_shared_experts(glm):
    from remax_megatron.flops import forward_flops

    arch = read_hf_config(glm)
    h, q, kv, v = 72, 6 * 20, 2 * 20, 300
    attention = 2 * h * (q + 2 * kv) + 2 * q * h
    dense, moe = 6 * h * 80, 2 * h * 4 + 6 * h * (24 * 2 + 24)  # router, 2 routed experts, the shared one
    per_token = 4 * attention + dense + 3 * moe
    assert forward_flops(arch, [1]) == per_token + 4 * 2 * q + 2 * h * v


def test_planner_counts_glm_4_5_air(tmp_path, capsys):
    """GLM-4.5-Air's model card: 106 B parameters (12 B active without the embeddings); a layout a user
    would pick (8 nodes of 8 GPUs, actor TP4 x PP2 x EP16, rollout TP8) fits 80 GiB per GPU."""
    from remax_megatron import plan

    config = tmp_path / "air.yaml"
    config.write_text(
        f"actor:\n  model: {os.path.join(ROOT, 'configs', 'models', 'glm-4.5-air')}\n  dtype: bfloat16\n"
        "  tp: 4\n  pp: 2\n  sequence_parallel: true\n  ep: 16\n  etp: 1\nrollout:\n  tp: 8\n"
        "reward:\n  functions: [exact_match]\ntrainer:\n  prompts_per_step: 64\n"
    )
    assert plan.main(["--config", str(config), "--nodes", "8", "--gpus-per-node", "8", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert abs(est["params"] / 106e9 - 1) < 0.02, est["params"]
    embeddings = 2 * 151552 * 4096
    assert abs((est["active_params"] - embeddings) / 12e9 - 1) < 0.02, est["active_params"]
    assert est["total_bytes"] < 80 * 2**30, est["total_bytes"] / 2**30


# ---- multi-process (gloo) ----------------------------------------------------------------------------------------


def _one_dtype_but_fp32_bias(tensors):
    """A checkpoint's tensors share one dtype, but the correction bias is float32 (as published)."""
    dtypes = {t.dtype for n, t in tensors.items() if not n.endswith("e_score_correction_bias")}
    biases = {t.dtype for n, t in tensors.items() if n.endswith("e_score_correction_bias")}
    assert len(dtypes) == 1 and biases == {torch.float32}, (dtypes, biases)


def _round_trip_body(rank, world, hf, ckpt, out, to_megatron, to_hf):
    round_trip_body(rank, world, hf, ckpt, out, to_megatron, to_hf, _one_dtype_but_fp32_bias)


def _parity_body(rank, world, model_dir, tp, pp, ep, expected, breaks=None, bf16_export=False):
    """megatron's fp32 log-probs vs transformers' (expected [3, 18]); `breaks`: a ModelArch field changed
    on purpose (the mapping broken), the parity must then fail."""
    from remax_megatron.models import build_policy
    from remax_megatron.models.arch import ExpertOptions
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import export_hf_weights, load_hf_weights

    etp = 1 if ep > 1 else tp
    ParallelLayout(tp=tp, pp=pp, world_size=world, ep=ep, etp=etp).initialize(seed=0)
    arch = read_hf_config(model_dir)
    if breaks:
        arch = dataclasses.replace(arch, **breaks)
    model = build_policy(arch, tp=tp, pp=pp, sequence_parallel=tp > 1, experts=ExpertOptions(ep=ep, etp=etp))
    load_hf_weights(model, model_dir)
    assert_parity(model, arch.vocab_size, expected, breaks, tp, pp, ep)
    if bf16_export:  # the correction bias stays float32 in a bfloat16 export (its own broadcast at PP2)
        from safetensors.torch import load_file

        source = load_file(os.path.join(model_dir, "model.safetensors"))
        for name, tensor in export_hf_weights(model, dtype=torch.bfloat16, bucket_mb=0.01):
            if name.endswith("e_score_correction_bias"):
                assert tensor.dtype == torch.float32 and torch.equal(tensor.cpu(), source[name]), name
            else:
                assert tensor.dtype == torch.bfloat16, name


def _lora_body(rank, world, model_dir):
    """LoRA targets that exist in GLM-4.5: attention's fused qkv and output projection in every layer; MoE
    experts refused in one line (shared experts and the dense layer's MLP are plain linears)."""
    from safetensors.torch import load_file

    from remax_megatron.weights import export_hf_weights

    model = attention_lora_model(world, model_dir)
    source = load_file(os.path.join(model_dir, "model.safetensors"))
    for name, tensor in export_hf_weights(model):  # B = 0: the merged export is the checkpoint
        assert torch.equal(tensor, source[name]), name


def _replay_body(rank, world, model_dir, tp, pp, ep):
    """Routing replay past the dense first layer (no route there); experts split over TP where there is no EP."""
    replay_body(rank, world, model_dir, tp, pp, ep, etp=1 if ep > 1 else tp, dense_layers=1)


def _aux_body(rank, world, model_dir, out_path):
    from tests.train.test_update import _aux_vs_megatron_body

    _aux_vs_megatron_body(rank, world, model_dir, out_path)
    out = torch.load(out_path)
    # the trainer's load-balancing loss of a sigmoid router (normalised sigmoid scores, DeepSeek-V3's form)
    # is megatron's own, layer by layer; megatron's tracker has a slot for the dense layer too
    assert out["ours"].shape == (3,) and out["megatron"].shape == (4,) and out["megatron"][0] == 0, out
    assert torch.allclose(out["ours"].float(), out["megatron"][1:].float(), rtol=1e-5, atol=1e-6), out


def _mtp_body(rank, world, model_dir, out):
    """An import skips the MTP layer saying so in one line; an export writes none and says so in one line."""
    import contextlib
    import io

    from safetensors.torch import load_file

    from remax_megatron.models import build_policy
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights
    from remax_megatron.weights.export import save_hf_dir

    ParallelLayout(tp=1, pp=1, world_size=world).initialize(seed=0)
    arch = read_hf_config(model_dir)
    model = build_policy(arch, tp=1, pp=1)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        load_hf_weights(model, model_dir)
        save_hf_dir(model, out, model_dir, tool="test", writer=True)
    lines = said.getvalue().splitlines()
    assert len(lines) == 2 and "skipped on import" in lines[0] and "wrote no multi-token-prediction" in lines[1]
    written = load_file(os.path.join(out, "model.safetensors"))
    source = load_file(os.path.join(model_dir, "model.safetensors"))
    assert sorted(written) == sorted(n for n in source if not n.startswith("model.layers.4."))


# (HF -> megatron layout, megatron -> HF layout) as (tp, pp, ep, etp), 4 processes
ROUND_TRIPS = {
    "tp2-pp2": ((2, 2, 1, 0), (1, 1, 2, 0)),
    "ep2": ((1, 1, 2, 0), (2, 2, 1, 0)),
    # a bfloat16 checkpoint whose correction bias is float32 (as published): both dtypes kept
    "bf16-tp2-pp2": ((2, 2, 1, 0), (2, 2, 1, 0)),
}
# (tp, pp, ep, world)
PARITY = {"tp1": (1, 1, 1, 1), "grouped": None, "tp2-pp2": (2, 2, 1, 4), "ep2": (1, 1, 2, 2), "tp2-ep2": (2, 1, 2, 2)}
# broken on purpose: (the model, ModelArch fields changed)
BROKEN = {
    "no-expert-bias": ("glm", {"moe_expert_bias": False}),
    "full-rotary": ("glm", {"rotary_percent": 1.0}),
    "no-group-limit": ("grouped", {"moe_num_groups": None, "moe_group_topk": None}),
}


@pytest.fixture(scope="module")
def launched(glm, tmp_path_factory):
    top = tmp_path_factory.mktemp("glm-launches")
    expected = hf_logprobs(glm)
    cases = {1: {}, 2: {}, 4: {}}
    bf16 = tiny_glm(top / "bf16", dtype="bfloat16")
    for name, (to_megatron, to_hf) in ROUND_TRIPS.items():
        (top / name).mkdir()
        source = bf16 if name.startswith("bf16") else glm
        cases[4][f"round-trip-{name}"] = (
            _round_trip_body,
            (source, str(top / name / "ckpt"), str(top / name / "out"), to_megatron, to_hf),
        )
    for name, (tp, pp, ep, world) in ((k, v) for k, v in PARITY.items() if v):
        cases[world][f"parity-{name}"] = (_parity_body, (glm, tp, pp, ep, expected, None, name == "tp2-pp2"))
    # group-limited top-k: 8 experts in 4 groups, 2 groups per token, 4 experts per token (4 / 2 = 2: megatron's
    # group score is transformers')
    grouped = tiny_glm(top / "grouped", experts=8, top_k=4, groups=4, group_topk=2)
    models = {"glm": (glm, expected), "grouped": (grouped, hf_logprobs(grouped))}
    cases[1]["parity-grouped"] = (_parity_body, (grouped, 1, 1, 1, models["grouped"][1]))
    for name, (model, breaks) in BROKEN.items():
        cases[1][f"broken-{name}"] = (_parity_body, (*models[model][:1], 1, 1, 1, models[model][1], breaks))
    cases[1]["lora"] = (_lora_body, (glm,))
    mtp = {  # a published checkpoint's MTP layer, after the decoder layers
        "model.layers.4.eh_proj.weight": torch.randn(72, 144),
        "model.layers.4.self_attn.q_proj.weight": torch.randn(120, 72),
    }
    cases[1]["mtp"] = (_mtp_body, (with_mtp_layer(glm, top / "mtp", mtp), str(top / "mtp-out")))
    cases[1]["aux-vs-megatron"] = (_aux_body, (glm, str(top / "aux.pt")))
    cases[2]["replay-tp2-ep2"] = (_replay_body, (glm, 2, 1, 2))
    cases[2]["replay-pp2"] = (_replay_body, (glm, 1, 2, 1))
    return SharedLaunches(cases, str(top / "launches"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2-ep2", "pp2"])
def test_routing_replay_past_the_dense_first_layer(launched, name):
    launched.check(f"replay-{name}")


@pytest.mark.slow
def test_load_balancing_loss_of_the_sigmoid_router_is_megatrons(launched):
    launched.check("aux-vs-megatron")


@pytest.mark.slow
def test_mtp_layers_are_skipped_on_import_and_not_exported(launched):
    launched.check("mtp")


@pytest.mark.slow
def test_lora_targets_attention_and_refuses_experts(launched):
    launched.check("lora")


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


# vLLM's CPU experts need hidden and expert widths that are multiples of 32 (a one-line refusal otherwise);
# the engines' model: the same odd shapes elsewhere (6 q heads over 2 KV heads, vocab 300, biases, 1 + 3 layers)
VLLM_SHAPE = dict(hidden=64, head_dim=32, moe_ffn=32)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["native", pytest.param("vllm", marks=needs_vllm)])
def test_engine_follows_a_tp2_actor_over_three_steps(glm, tmp_path, engine):
    """Engine-vs-actor log-prob gap (fp32 CPU) at every step of a 3-step ReMax run with a TP2 (sequence
    parallel) actor: rounding only, so the weights and the correction bias reach the engine every sync.
    Measured: 4.8e-7 to 9.5e-7 per step (native), 4.8e-7 (vLLM's CPU build)."""
    from tests.train.test_train_e2e import assert_fp32_rounding_only

    model = glm if engine == "native" else tiny_glm(tmp_path / "vllm-shaped", **VLLM_SHAPE)
    train = three_steps(model, tmp_path / "run", engine, "checkpoint.save_every=2")
    assert len(train) == 3 and all(r["rollout/tokens"] > 0 for r in train)
    assert_fp32_rounding_only(r["logprob/engine_vs_actor_max_diff"] for r in train)
    if engine == "native":  # resumed from step 2 (weights, the frozen bias, Adam), step 3 is the same step
        resume = f"checkpoint.resume={tmp_path / 'run' / 'checkpoints' / 'step_000002'}"
        (again,) = three_steps(model, tmp_path / "resumed", engine, "checkpoint.save_every=0", resume)
        timeless = [
            {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/", "perf/"))}
            for r in (train[2], again)
        ]
        assert timeless[0] == timeless[1]


@needs_vllm
def test_vllm_refuses_expert_widths_its_cpu_build_cannot_sync(tmp_path):
    from remax_megatron.config import RolloutConfig
    from remax_megatron.rollout.vllm_engine import VllmEngine

    if torch.cuda.is_available():
        pytest.skip("the alignment is vLLM's CPU experts'")
    with pytest.raises(ValueError) as e:
        arch = read_hf_config(tiny_glm(tmp_path / "m", head_dim=32))  # a head size vLLM's CPU attention runs
        VllmEngine.check_config(RolloutConfig(engine="vllm", kv_cache_gib=0.01), arch, 1)
    line = str(e.value)
    assert "hidden_size=72" in line and "moe_intermediate_size=24" in line and "rollout.engine=native" in line
    assert "\n" not in line
