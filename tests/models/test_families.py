"""The model-family registry: every family reads its configs, counts its parameters as transformers
does, refuses what it cannot run exactly, and a new family needs only its own description (a toy
family with other HF names registers, loads, runs and exports; a toy MoE family with other expert and
router names also syncs into the native rollout engine and records its routes)."""

import json
import re

import pytest
import torch

from remax_megatron.models import families
from remax_megatron.models.families import CAUSAL_LM, EngineTensor, Family, MoeNames, TensorRule
from remax_megatron.models.families.base import dense_mlp_rules, attention_rules, moe_mlp_rules
from remax_megatron.models.hf_config import check_run_length, read_hf_config
from tests._dist import run_distributed
from tools.make_tiny_model import make_tiny_model

BUILTIN = {
    "llama": ["LlamaForCausalLM", "LlamaForSequenceClassification"],
    "qwen2": ["Qwen2ForCausalLM", "Qwen2ForSequenceClassification"],
    "qwen3": ["Qwen3ForCausalLM", "Qwen3ForSequenceClassification"],
    "mistral": ["MistralForCausalLM", "MistralForSequenceClassification"],
    "qwen3_moe": ["Qwen3MoeForCausalLM"],
    "mixtral": ["MixtralForCausalLM"],
    "glm4_moe": ["Glm4MoeForCausalLM"],
    "gpt_oss": ["GptOssForCausalLM"],
    "deepseek_v3": ["DeepseekV3ForCausalLM"],
}

# family, options, tie, reward: the shapes the parameter count is checked on
SHAPES = [
    ("llama", {}, True, False),
    ("llama", {}, False, True),
    ("qwen2", {}, False, False),
    ("qwen3", {"head_dim": 32}, False, False),
    ("qwen3", {}, True, False),
    ("qwen3", {}, False, True),
    ("mistral", {"head_dim": 8, "sliding_window": 128}, False, False),
    ("qwen3_moe", {"experts": 4, "top_k": 2}, False, False),
    ("mixtral", {"experts": 3, "top_k": 2}, True, False),
    ("glm4_moe", {"experts": 4, "top_k": 2, "head_dim": 20, "qk_norm": True}, False, False),
    ("gpt_oss", {"experts": 3, "top_k": 2, "head_dim": 12}, False, False),
    ("deepseek_v3", {"experts": 4, "top_k": 2}, False, False),
    ("deepseek_v3", {"q_lora_rank": None}, True, False),
]


def test_registry_serves_the_builtin_families():
    assert {f.name: sorted(f.architectures) for f in families.families()} == {k: sorted(v) for k, v in BUILTIN.items()}
    for name, archs in BUILTIN.items():
        for arch in archs:
            family, task = families.lookup(arch, "config.json")
            assert family.name == name and task == ("reward" if "Sequence" in arch else "causal_lm")


def test_unknown_architecture_lists_the_families(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"), "llama", hidden=32, heads=2, kv_heads=1)
    config = json.load(open(f"{path}/config.json"))
    config["architectures"] = ["Qwen3NextForCausalLM"]
    json.dump(config, open(f"{path}/config.json", "w"))
    with pytest.raises(ValueError) as refused:
        read_hf_config(path)
    line = str(refused.value)
    assert "unsupported architecture 'Qwen3NextForCausalLM'" in line and "\n" not in line, line
    assert "gated DeltaNet" in line, line  # the reason it is refused, by name
    for name, archs in BUILTIN.items():
        assert f"{name} ({', '.join(archs)})" in line, line


@pytest.mark.parametrize("family,options,tie,reward", SHAPES)
def test_parameter_count_matches_transformers(tmp_path, family, options, tie, reward):
    """The planner's P (plan.param_count, from the family's tensor rules) is what transformers builds."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from remax_megatron import plan

    path = make_tiny_model(
        str(tmp_path / "m"),
        family,
        hidden=32,
        layers=3,
        heads=4,
        kv_heads=2,
        ffn=48,
        vocab=200,
        tie=tie,
        reward=reward,
        **options,
    )
    arch = read_hf_config(path)
    cls = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    hf = cls.from_pretrained(path)
    # parameters and persistent buffers (a DeepSeek-style router's correction bias): the checkpoint's tensors
    persistent = hf.state_dict()
    buffers = sum(b.numel() for name, b in hf.named_buffers() if name in persistent)
    assert plan.param_count(arch, arch.vocab_size) == sum(p.numel() for p in hf.parameters()) + buffers
    # Every HF tensor of the checkpoint is made by exactly one rule (nothing left out, nothing invented); the
    # reader's names (gpt-oss's fused experts read per expert)
    from remax_megatron.weights.hf_io import HFCheckpointReader
    from remax_megatron.weights.mapping import WeightMapping

    mapped = [n for s in WeightMapping(arch, 1, 1, arch.vocab_size).exported_specs() for n in s.hf]
    assert len(mapped) == len(set(mapped))
    assert set(mapped) == set(HFCheckpointReader(path).names())


def test_qwen3_and_mistral_read_their_features(tmp_path):
    qwen3 = read_hf_config(make_tiny_model(str(tmp_path / "q"), "qwen3", hidden=64, heads=4, kv_heads=2, head_dim=32))
    assert (qwen3.qk_layernorm, qwen3.head_dim, qwen3.qkv_bias, qwen3.layer_windows) == (True, 32, False, None)
    mistral = read_hf_config(
        make_tiny_model(str(tmp_path / "m"), "mistral", hidden=64, heads=4, kv_heads=2, sliding_window=96)
    )
    assert (mistral.qk_layernorm, mistral.head_dim, mistral.layer_windows) == (False, 16, (96, 96))


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_attention_bias_is_refused(tmp_path, family):
    """HF's attention_bias also adds an o_proj bias, which megatron-core only has with MLP biases: a
    silent drop of it would change the model."""
    path = make_tiny_model(str(tmp_path / "m"), family, hidden=32, heads=2, kv_heads=1)
    config = json.load(open(f"{path}/config.json"))
    config["attention_bias"] = True
    json.dump(config, open(f"{path}/config.json", "w"))
    with pytest.raises(ValueError, match="attention_bias=True in .* is not supported: it adds a bias to o_proj"):
        read_hf_config(path)


WINDOW_AFTER_1 = dict(sliding_window=8, max_window_layers=1)


def test_sliding_windows_are_read_per_layer_and_runs_may_outgrow_them(tmp_path):
    """Mistral windows every layer, Qwen2 the layers from max_window_layers on; a window is applied by the
    attention (tests/models/test_parity.py), so a run longer than it is no error. A window configured with
    use_sliding_window=false (Qwen-style) is full attention."""
    from remax_megatron.models.hf_config import transformer_config

    mistral = read_hf_config(
        make_tiny_model(str(tmp_path / "m"), "mistral", hidden=32, heads=2, kv_heads=1, sliding_window=96)
    )
    check_run_length(mistral, 97, "actor.model m", "data.max_prompt_tokens(33) + rollout.max_new_tokens(64)")
    qwen2 = read_hf_config(
        make_tiny_model(str(tmp_path / "q2"), "qwen2", hidden=32, heads=2, layers=3, kv_heads=1, **WINDOW_AFTER_1)
    )
    assert qwen2.layer_windows == (None, 8, 8)
    config = transformer_config(qwen2, tp=1, pp=1)
    assert (config.window_size, config.window_attn_skip_freq) == ((7, 0), [0, 1, 1])
    path = make_tiny_model(str(tmp_path / "q"), "qwen3", hidden=32, heads=2, kv_heads=1)
    config = json.load(open(f"{path}/config.json"))
    config.update(use_sliding_window=False, sliding_window=8)
    json.dump(config, open(f"{path}/config.json", "w"))
    assert read_hf_config(path).layer_windows is None


def test_make_tiny_model_cli_builds_every_family(tmp_path, capsys):
    from tools import make_tiny_model as cli

    for family in BUILTIN:
        out = tmp_path / family
        cli.main(["--family", family, "--out", str(out), "--hidden", "32", "--heads", "2", "--kv-heads", "1"])
        assert read_hf_config(str(out)).family == family
    cli.main(
        [
            "--family",
            "qwen3",
            "--out",
            str(tmp_path / "q"),
            "--hidden",
            "32",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "64",
        ]
    )
    assert read_hf_config(str(tmp_path / "q")).head_dim == 64
    with pytest.raises(SystemExit, match="sliding_window is not an option of the qwen3 family"):
        cli.main(["--family", "qwen3", "--out", str(tmp_path / "w"), "--sliding-window", "8"])


# ---- a toy family: Llama's layers under other HF names, registered by a test -------------------------

_TOY_NAMES = {
    "input_layernorm.weight": "ln_1.weight",
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.o_proj.weight": "attn.out.weight",
    "post_attention_layernorm.weight": "ln_2.weight",
    "mlp.gate_proj.weight": "ffn.w1.weight",
    "mlp.up_proj.weight": "ffn.w3.weight",
    "mlp.down_proj.weight": "ffn.w2.weight",
}


class Toy(Family):
    """What a new family's file holds: its architectures, its HF names, its layer rules."""

    name = "toy"
    architectures = {"ToyForCausalLM": CAUSAL_LM}
    hf_config_class = "LlamaConfig"
    hf_embedding, hf_final_norm, hf_lm_head = "transformer.wte.weight", "transformer.ln_f.weight", "head.weight"
    hf_layer_prefix = "transformer.h.{layer}."

    def layer_rules(self, arch, layer):
        rules = attention_rules(arch, qkv_bias=False, qk_norm=False) + dense_mlp_rules(arch)
        return [TensorRule(r.megatron, tuple(_TOY_NAMES[n] for n in r.hf), r.kind, r.shapes) for r in rules]


def _toy_name(name: str) -> str:
    if name.startswith("model.layers."):
        layer, rest = name[len("model.layers.") :].split(".", 1)
        return f"transformer.h.{layer}.{_TOY_NAMES[rest]}"
    return {
        "model.embed_tokens.weight": Toy.hf_embedding,
        "model.norm.weight": Toy.hf_final_norm,
        "lm_head.weight": Toy.hf_lm_head,
    }[name]


def _toy_model(tmp_path) -> tuple[str, str]:
    """(a tiny Llama directory, the same weights as a ToyForCausalLM directory)."""
    from safetensors.torch import load_file, save_file

    llama = make_tiny_model(
        str(tmp_path / "llama"), "llama", hidden=64, layers=4, heads=4, kv_heads=2, ffn=96, vocab=300, seed=11
    )
    toy = tmp_path / "toy"
    toy.mkdir()
    tensors = load_file(f"{llama}/model.safetensors")
    save_file({_toy_name(k): v for k, v in tensors.items()}, str(toy / "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(f"{llama}/config.json"))
    config["architectures"] = ["ToyForCausalLM"]  # model_type stays "llama": transformers reads the config
    json.dump(config, open(toy / "config.json", "w"))
    return llama, str(toy)


@pytest.fixture
def toy_registered():
    families.register(Toy())
    yield
    families.unregister("toy")


def test_a_registered_toy_family_maps_its_own_names(tmp_path, toy_registered):
    from safetensors.torch import load_file

    from remax_megatron import plan
    from remax_megatron.weights.mapping import WeightMapping

    llama, toy = _toy_model(tmp_path)
    arch = read_hf_config(toy)
    assert arch.family == "toy" and arch.architecture == "ToyForCausalLM"
    mapping = WeightMapping(arch, tp=2, pp=2, padded_vocab=512)
    assert {n for s in mapping.exported_specs() for n in s.hf} == set(load_file(f"{toy}/model.safetensors"))
    assert plan.param_count(arch, 300) == plan.param_count(read_hf_config(llama), 300)


def _toy_body(rank, world, llama, toy, expected):
    from safetensors.torch import load_file

    from remax_megatron.models import build_policy
    from remax_megatron.models.forward import forward_only
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import export_hf_weights, load_hf_weights

    families.register(Toy())  # in this process too: registration is all a new family needs
    ParallelLayout(tp=2, pp=1, world_size=world).initialize()
    arch = read_hf_config(toy)
    model = build_policy(arch, tp=2, pp=1)
    load_hf_weights(model, toy)
    ids = torch.randint(4, arch.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    (logits,) = forward_only(model, [{"input_ids": ids}], lambda m, hidden, batch: m.full_logits(hidden))
    err = (logits - expected).abs().max().item()
    assert err < 1e-5, f"toy family: max |logits - the Llama it renames| = {err}"
    exported = {name: tensor.clone() for name, tensor in export_hf_weights(model)}
    source = load_file(f"{toy}/model.safetensors")
    assert set(exported) == set(source)
    assert all(torch.equal(exported[n], source[n]) for n in source)


@pytest.mark.slow
def test_a_registered_toy_family_loads_runs_and_exports(tmp_path):
    """A family registered at run time (names the mapping never saw) gives its Llama's logits at TP=2 and
    exports its own names bitwise."""
    from transformers import AutoModelForCausalLM

    llama, toy = _toy_model(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    ids = torch.randint(4, hf.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
    run_distributed(_toy_body, 2, (llama, toy, expected))


# ---- a toy MoE family: a Qwen3-MoE model whose checkpoint names its router and experts otherwise -------


class ToyMoe(Family):
    """What a new MoE family's file holds: its architecture, the config fields it reads, its layer rules
    and its routed MLP's names (the checkpoint's; transformers' model is Qwen3-MoE's, model_type stays)."""

    name = "toy_moe"
    architectures = {"ToyMoeForCausalLM": CAUSAL_LM}
    hf_config_class = "Qwen3MoeConfig"
    moe = MoeNames(
        router="moe.router.weight",
        expert="moe.expert_{}.",
        gate="wi_gate.weight",
        up="wi_up.weight",
        down="wo.weight",
        model_router="mlp.gate",
        model_gate_up="mlp.experts.gate_up_proj",
        model_down="mlp.experts.down_proj",
    )

    def features(self, cfg, path):
        return {
            "qk_layernorm": True,
            "num_experts": cfg.num_experts,
            "moe_ffn_hidden_size": cfg.moe_intermediate_size,
            "moe_top_k": cfg.num_experts_per_tok,
            "moe_pre_softmax": not cfg.norm_topk_prob,
        }

    def layer_rules(self, arch, layer):
        return attention_rules(arch, qkv_bias=False, qk_norm=True) + moe_mlp_rules(arch, self.moe)


# Qwen3-MoE checkpoint name -> the toy's, written out here (not derived from either family's rules)
_TO_TOY_MOE = [
    (r"\.mlp\.gate\.weight$", ".moe.router.weight"),
    (r"\.mlp\.experts\.(\d+)\.gate_proj\.", r".moe.expert_\1.wi_gate."),
    (r"\.mlp\.experts\.(\d+)\.up_proj\.", r".moe.expert_\1.wi_up."),
    (r"\.mlp\.experts\.(\d+)\.down_proj\.", r".moe.expert_\1.wo."),
]


def _toy_moe_model(tmp_path) -> tuple[str, str]:
    """(a tiny Qwen3-MoE directory, the same weights as a ToyMoeForCausalLM directory)."""
    import shutil

    from safetensors.torch import load_file, save_file

    qwen = make_tiny_model(
        str(tmp_path / "qwen3_moe"),
        "qwen3_moe",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=32,
        experts=4,
        top_k=2,
        seed=21,
    )
    toy = tmp_path / "toy_moe"
    shutil.copytree(qwen, toy)  # tokenizer, generation config
    renamed = {}
    for name, tensor in load_file(f"{qwen}/model.safetensors").items():
        for pattern, replacement in _TO_TOY_MOE:
            name = re.sub(pattern, replacement, name)
        renamed[name] = tensor
    save_file(renamed, str(toy / "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(toy / "config.json"))
    config["architectures"] = ["ToyMoeForCausalLM"]  # model_type stays "qwen3_moe": transformers builds that
    json.dump(config, open(toy / "config.json", "w"))
    return qwen, str(toy)


@pytest.fixture
def toy_moe_registered():
    families.register(ToyMoe())
    yield
    families.unregister("toy_moe")


def _native_generate(model_dir, stream):
    """A native engine with routes, synced from `stream`: (its weights, tokens, log-probs and routes of a
    seeded sampled-and-greedy request)."""
    from remax_megatron.rollout import SamplingParams, sync_weights
    from remax_megatron.rollout.native import NativeEngine

    engine = NativeEngine(hf_dir=model_dir, seed=0, dtype=torch.float32, device="cpu", routes=True)
    sync_weights(engine, stream, bucket_mb=0.05)
    out = engine.generate(
        [[5, 17, 40, 41], [9, 10]], n=2, sampling=SamplingParams(max_new_tokens=5, temperature=1.3), seeds=[1, 2]
    )
    rows = [(c.token_ids, c.logprobs, c.routed_experts) for r in out for c in r.sampled + [r.greedy]]
    return engine.model.state_dict(), rows


def _assert_same_engine(got, want):
    (got_state, got_rows), (want_state, want_rows) = got, want
    assert got_state.keys() == want_state.keys()
    unequal = [k for k in want_state if not torch.equal(got_state[k], want_state[k])]
    assert not unequal, f"engine parameters differ from Qwen3-MoE's: {unequal}"
    for (tokens, logprobs, routes), (want_tokens, want_logprobs, want_routes) in zip(got_rows, want_rows):
        assert (tokens, logprobs) == (want_tokens, want_logprobs)
        assert routes.shape[1:] == (2, 2) and torch.equal(routes, want_routes)  # [tokens, layers, top_k]


def test_a_registered_toy_moe_family_names_its_experts_everywhere(tmp_path, toy_moe_registered):
    """The toy's one definition serves the registry, the weight mapping and the native engine: its
    checkpoint (no Qwen3-MoE expert or router name in it) syncs into transformers' fused experts and
    router exactly as Qwen3-MoE's does, and routing replay finds its routers."""
    from safetensors.torch import load_file

    from remax_megatron import plan
    from remax_megatron.weights.mapping import WeightMapping
    from tests.rollout.helpers import hf_stream

    qwen, toy = _toy_moe_model(tmp_path)
    arch = read_hf_config(toy)
    assert (arch.family, arch.is_moe, arch.num_experts) == ("toy_moe", True, 4)
    toy_names = set(load_file(f"{toy}/model.safetensors"))
    assert not any(".mlp.gate." in n or ".mlp.experts." in n for n in toy_names)
    mapping = WeightMapping(arch, tp=1, pp=1, padded_vocab=arch.vocab_size)
    assert {n for s in mapping.exported_specs() for n in s.hf} == toy_names
    assert plan.param_count(arch, arch.vocab_size) == plan.param_count(read_hf_config(qwen), arch.vocab_size)

    toy_family = families.family_named("toy_moe")
    assert toy_family.engine_tensor("model.layers.1.moe.expert_3.wi_up.weight") == EngineTensor(
        "model.layers.1.mlp.experts.gate_up_proj", 3, part=1, parts=2
    )
    assert toy_family.engine_tensor("model.layers.0.moe.router.weight") == EngineTensor(
        "model.layers.0.mlp.gate.weight"
    )
    assert toy_family.engine_tensor("model.layers.0.mlp.experts.3.up_proj.weight") is None  # Qwen3-MoE's name
    _assert_same_engine(_native_generate(toy, hf_stream(toy)), _native_generate(qwen, hf_stream(qwen)))


def _toy_moe_body(rank, world, toy, out_path):
    """The toy checkpoint into a megatron MoE actor and out again: the export stream, saved."""
    from remax_megatron.models import build_policy
    from remax_megatron.models.arch import ExpertOptions
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import export_hf_weights, load_hf_weights

    families.register(ToyMoe())  # in this process too: registration is all a new family needs
    ParallelLayout(tp=1, pp=1, world_size=world).initialize(seed=0)
    arch = read_hf_config(toy)
    actor = build_policy(arch, tp=1, pp=1, trainable=False, experts=ExpertOptions(ep=1, etp=1))
    load_hf_weights(actor, toy)
    torch.save([(name, tensor.clone()) for name, tensor in export_hf_weights(actor, bucket_mb=0.05)], out_path)


@pytest.mark.slow
def test_a_toy_moe_actor_exports_into_the_native_engine(tmp_path, toy_moe_registered):
    """Actor -> export -> native engine, the rollout path, for a family registered at run time: the actor
    exports the toy's names, and the engine ends up exactly where a Qwen3-MoE checkpoint puts it (the
    engines are compared in one process: another process's thread count may round differently)."""
    from safetensors.torch import load_file

    from tests.rollout.helpers import hf_stream

    qwen, toy = _toy_moe_model(tmp_path)
    out = tmp_path / "exported.pt"
    run_distributed(_toy_moe_body, 1, (toy, str(out)))
    exported = torch.load(out, weights_only=False)
    source = load_file(f"{toy}/model.safetensors")
    assert sorted(n for n, _ in exported) == sorted(source)
    assert all(torch.equal(t, source[n]) for n, t in exported)
    _assert_same_engine(_native_generate(toy, iter(exported)), _native_generate(qwen, hf_stream(qwen)))
