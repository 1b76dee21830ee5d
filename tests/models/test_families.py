"""The model-family registry: every family reads its configs, counts its parameters as transformers
does, refuses what it cannot run exactly, and a new family needs only its own description (a toy
family with other HF names registers, loads, runs and exports)."""

import json

import pytest
import torch

from remax_megatron.models import families
from remax_megatron.models.families import CAUSAL_LM, Family, TensorRule
from remax_megatron.models.families.base import dense_mlp_rules, attention_rules
from remax_megatron.models.hf_config import check_run_length, read_hf_config
from tests._dist import run_distributed
from tools.make_tiny_model import make_tiny_model

BUILTIN = {"llama": ["LlamaForCausalLM", "LlamaForSequenceClassification"],
           "qwen2": ["Qwen2ForCausalLM", "Qwen2ForSequenceClassification"],
           "qwen3": ["Qwen3ForCausalLM", "Qwen3ForSequenceClassification"],
           "mistral": ["MistralForCausalLM", "MistralForSequenceClassification"],
           "qwen3_moe": ["Qwen3MoeForCausalLM"], "mixtral": ["MixtralForCausalLM"]}

# family, options, tie, reward: the shapes the parameter count is checked on
SHAPES = [("llama", {}, True, False), ("llama", {}, False, True), ("qwen2", {}, False, False),
          ("qwen3", {"head_dim": 32}, False, False), ("qwen3", {}, True, False), ("qwen3", {}, False, True),
          ("mistral", {"head_dim": 8, "sliding_window": 128}, False, False),
          ("qwen3_moe", {"experts": 4, "top_k": 2}, False, False), ("mixtral", {"experts": 3, "top_k": 2}, True, False)]


def test_registry_serves_the_builtin_families():
    assert {f.name: sorted(f.architectures) for f in families.families()} == \
        {k: sorted(v) for k, v in BUILTIN.items()}
    for name, archs in BUILTIN.items():
        for arch in archs:
            family, task = families.lookup(arch, "config.json")
            assert family.name == name and task == ("reward" if "Sequence" in arch else "causal_lm")


def test_unknown_architecture_lists_the_families(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"), "llama", hidden=32, heads=2, kv_heads=1)
    config = json.load(open(f"{path}/config.json"))
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    json.dump(config, open(f"{path}/config.json", "w"))
    with pytest.raises(ValueError) as refused:
        read_hf_config(path)
    line = str(refused.value)
    assert "unsupported architecture 'DeepseekV3ForCausalLM'" in line and "\n" not in line, line
    assert "its sigmoid router with a per-expert bias" in line, line  # the reason it is refused, by name
    for name, archs in BUILTIN.items():
        assert f"{name} ({', '.join(archs)})" in line, line


@pytest.mark.parametrize("family,options,tie,reward", SHAPES)
def test_parameter_count_matches_transformers(tmp_path, family, options, tie, reward):
    """The planner's P (plan.param_count, from the family's tensor rules) is what transformers builds."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from remax_megatron import plan

    path = make_tiny_model(str(tmp_path / "m"), family, hidden=32, layers=3, heads=4, kv_heads=2, ffn=48,
                           vocab=200, tie=tie, reward=reward, **options)
    arch = read_hf_config(path)
    cls = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    hf = cls.from_pretrained(path)
    assert plan.param_count(arch, arch.vocab_size) == sum(p.numel() for p in hf.parameters())
    # Every HF tensor of the checkpoint is made by exactly one rule (nothing left out, nothing invented).
    from safetensors import safe_open

    from remax_megatron.weights.mapping import WeightMapping

    mapped = [n for s in WeightMapping(arch, 1, 1, arch.vocab_size).exported_specs() for n in s.hf]
    assert len(mapped) == len(set(mapped))
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert set(mapped) == set(f.keys())


def test_qwen3_and_mistral_read_their_features(tmp_path):
    qwen3 = read_hf_config(make_tiny_model(str(tmp_path / "q"), "qwen3", hidden=64, heads=4, kv_heads=2,
                                           head_dim=32))
    assert (qwen3.qk_layernorm, qwen3.head_dim, qwen3.qkv_bias, qwen3.sliding_window) == (True, 32, False, None)
    mistral = read_hf_config(make_tiny_model(str(tmp_path / "m"), "mistral", hidden=64, heads=4, kv_heads=2,
                                             sliding_window=96))
    assert (mistral.qk_layernorm, mistral.head_dim, mistral.sliding_window) == (False, 16, 96)


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


def test_sliding_window_shorter_than_the_run_is_refused(tmp_path):
    arch = read_hf_config(make_tiny_model(str(tmp_path / "m"), "mistral", hidden=32, heads=2, kv_heads=1,
                                          sliding_window=96))
    check_run_length(arch, 96, "actor.model m", "prompt + response")  # every sequence inside the window: runs
    with pytest.raises(ValueError) as refused:
        check_run_length(arch, 97, "actor.model m", "data.max_prompt_tokens(33) + rollout.max_new_tokens(64)")
    line = str(refused.value)
    assert line.startswith("data.max_prompt_tokens(33) + rollout.max_new_tokens(64) = 97 is longer than actor.model "
                           "m's sliding_window=96"), line
    # Qwen-style: a window configured but no layer using it (use_sliding_window=false) is full attention.
    path = make_tiny_model(str(tmp_path / "q"), "qwen3", hidden=32, heads=2, kv_heads=1)
    config = json.load(open(f"{path}/config.json"))
    config.update(use_sliding_window=False, sliding_window=8)
    json.dump(config, open(f"{path}/config.json", "w"))
    assert read_hf_config(path).sliding_window is None


def test_make_tiny_model_cli_builds_every_family(tmp_path, capsys):
    from tools import make_tiny_model as cli

    for family in BUILTIN:
        out = tmp_path / family
        cli.main(["--family", family, "--out", str(out), "--hidden", "32", "--heads", "2", "--kv-heads", "1"])
        assert read_hf_config(str(out)).family == family
    cli.main(["--family", "qwen3", "--out", str(tmp_path / "q"), "--hidden", "32", "--heads", "2", "--kv-heads", "1",
              "--head-dim", "64"])
    assert read_hf_config(str(tmp_path / "q")).head_dim == 64
    with pytest.raises(SystemExit, match="sliding_window is not an option of the qwen3 family"):
        cli.main(["--family", "qwen3", "--out", str(tmp_path / "w"), "--sliding-window", "8"])


# ---- a toy family: Llama's layers under other HF names, registered by a test -------------------------

_TOY_NAMES = {"input_layernorm.weight": "ln_1.weight", "self_attn.q_proj.weight": "attn.q.weight",
              "self_attn.k_proj.weight": "attn.k.weight", "self_attn.v_proj.weight": "attn.v.weight",
              "self_attn.o_proj.weight": "attn.out.weight", "post_attention_layernorm.weight": "ln_2.weight",
              "mlp.gate_proj.weight": "ffn.w1.weight", "mlp.up_proj.weight": "ffn.w3.weight",
              "mlp.down_proj.weight": "ffn.w2.weight"}


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
        layer, rest = name[len("model.layers."):].split(".", 1)
        return f"transformer.h.{layer}.{_TOY_NAMES[rest]}"
    return {"model.embed_tokens.weight": Toy.hf_embedding, "model.norm.weight": Toy.hf_final_norm,
            "lm_head.weight": Toy.hf_lm_head}[name]


def _toy_model(tmp_path) -> tuple[str, str]:
    """(a tiny Llama directory, the same weights as a ToyForCausalLM directory)."""
    from safetensors.torch import load_file, save_file

    llama = make_tiny_model(str(tmp_path / "llama"), "llama", hidden=64, layers=4, heads=4, kv_heads=2, ffn=96,
                            vocab=300, seed=11)
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
