"""The layout/memory planner: closed-form numbers for Llama-3-8B, warnings, suggestions, bad input.

Expected bytes are computed here from the published Llama-3-8B architecture
numbers and the formulas of remax_megatron/plan.py's docstring, not with the
planner's helpers.
"""

import json
import os
import subprocess
import sys

import pytest

from remax_megatron import plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = os.path.join(REPO, "configs", "models", "llama3-8b")


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(
        "actor:\n"
        f"  model: {LLAMA}\n"
        "  dtype: bfloat16\n"
        "  tp: 2\n"
        "reward:\n"
        "  functions: [exact_match]\n"
        "trainer:\n"
        "  prompts_per_step: 64\n"
        "  micro_batch_size: 4\n"
        "rollout:\n"
        "  n: 4\n"
        "  max_new_tokens: 512\n"
        "data:\n"
        "  max_prompt_tokens: 256\n"
    )
    return str(path)


def _plan_json(capsys, *argv):
    code = plan.main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def _llama3_8b_params() -> int:
    d, f, layers, heads, kv, hd, vocab = 4096, 14336, 32, 32, 8, 128, 128256
    attention = d * heads * hd + 2 * d * kv * hd + heads * hd * d
    layer = attention + 3 * d * f + 2 * d
    return 2 * vocab * d + layers * layer + d  # untied embedding + output layer, final norm


def test_llama3_8b_tp2_matches_closed_form(config, capsys):
    code, est = _plan_json(capsys, "--config", config, "--nodes", "1", "--gpus-per-node", "8", "--gpu-mem-gib", "80")
    p = _llama3_8b_params()
    assert p == 8_030_261_248  # the published Llama-3-8B parameter count
    tp, dp = 2, 4  # 8 GPUs / (tp 2 * pp 1)
    norms = 32 * 2 * 4096 + 4096  # RMSNorm weights: replicated over TP
    share = (p - norms) // tp + norms  # one rank's parameters (128256 is a multiple of 128 * 2)
    rows = {r["key"]: r for r in est["rows"]}
    assert est["params"] == p and est["dp"] == dp
    assert rows["weights"]["bytes"] == share * 2  # bf16
    assert rows["gradients"]["bytes"] == share * 4  # fp32 grad buffer
    assert rows["optimizer"]["bytes"] == share * 12
    assert rows["optimizer_distributed"]["bytes"] == share * 12 // dp
    assert rows["optimizer_distributed"]["counted"] and not rows["optimizer"]["counted"]
    assert est["total_bytes"] == sum(r["bytes"] for r in est["rows"] if r["counted"])
    # rollout: 8 engines at rollout.tp=1, 64 prompts -> 8 per engine, 8 * (4 + 1) sequences of 256 + 512 tokens
    assert rows["kv_cache"]["bytes"] == 2 * 32 * 8 * 128 * (8 * 5) * 768 * 2
    assert rows["engine_weights"]["bytes"] == p * 2
    assert code == (0 if est["fits"] else 1)


def test_pp_note_and_activation_recompute_order(config, capsys):
    code = plan.main(["--config", config, "--nodes", "1", "--gpus-per-node", "8", "actor.pp=2"])
    out = capsys.readouterr().out
    assert "per-GPU memory (pipeline stage 0 of 2, the heaviest)" in out and "stages: 0: " in out, out
    acts = {}
    for mode in ("none", "selective", "full"):
        _, est = _plan_json(capsys, "--config", config, f"actor.recompute={mode}")
        acts[mode] = {r["key"]: r["bytes"] for r in est["rows"]}["activations"]
    assert acts["none"] > acts["selective"] > acts["full"] > 0
    assert code in (0, 1)


def _apply_suggestion(capsys, argv, text):
    """Re-plan `argv` with the suggested flags and overrides appended (later ones win)."""
    words = text.split("(estimated")[0].split()
    argv = list(argv)
    for i, w in enumerate(words):
        if w in ("--nodes", "--gpus-per-node"):
            argv += [w, words[i + 1]]
        elif "=" in w:
            argv.append(w)
    return _plan_json(capsys, *argv)


def test_impossible_layout_warns_and_suggests(config, capsys):
    argv = [
        "--config",
        config,
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--gpu-mem-gib",
        "24",
        "actor.tp=1",
        "optim.distributed_optimizer=false",
    ]
    assert plan.main(argv) == 1
    out = capsys.readouterr().out
    assert "warning: estimated" in out and "exceeds the 24.00 GiB GPU" in out
    suggestion = next(line for line in out.splitlines() if line.startswith("suggestion:"))
    assert "--gpus-per-node" in suggestion  # 8B weights + Adam cannot fit one 24 GiB GPU
    code, est = _apply_suggestion(capsys, argv, suggestion.split(":", 1)[1])
    assert code == 0 and est["fits"] and est["world"] > 1


def test_in_world_suggestion_is_a_single_change(config, capsys):
    # 8 x 80 GiB at TP=1 without the distributed optimizer: 12 B/param of Adam state does not fit
    argv = [
        "--config",
        config,
        "--gpus-per-node",
        "8",
        "--gpu-mem-gib",
        "80",
        "actor.tp=1",
        "optim.distributed_optimizer=false",
    ]
    code, est = _plan_json(capsys, *argv)
    assert code == 1 and not est["fits"]
    change = est["suggestion"].split("(estimated")[0].split()
    assert len(change) == 1 and "--nodes" not in est["suggestion"], est["suggestion"]
    code, est = _apply_suggestion(capsys, argv, est["suggestion"])
    assert code == 0 and est["fits"] and est["world"] == 8


def _run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "remax_megatron.plan", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gpus-per-node", "6", "actor.tp=4"], "does not divide world(6)"),
        (["actor.tpp=2"], "did you mean actor.tp?"),
        (["--nodes", "0"], "--nodes=0 must be >= 1"),
    ],
)
def test_bad_input_is_one_line(config, extra, message):
    r = _run_cli("--config", config, *extra)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_unknown_key_in_yaml_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor:\n  modle: x\nreward:\n  functions: [exact_match]\n")
    r = _run_cli("--config", str(path))
    assert r.returncode == 2 and "unknown config key 'actor.modle'; did you mean actor.model?" in r.stderr
    assert r.stderr.count("\n") == 1


@pytest.fixture
def rm_config(config, tmp_path):
    """The Llama-3-8B config above with a Llama-3-8B reward model (its own layout)."""
    with open(os.path.join(LLAMA, "config.json")) as f:
        raw = json.load(f)
    raw.update(architectures=["LlamaForSequenceClassification"], num_labels=1)
    rm_dir = tmp_path / "rm"
    rm_dir.mkdir()
    (rm_dir / "config.json").write_text(json.dumps(raw))
    with open(config) as f:
        text = f.read().replace("reward:\n", f"reward:\n  model: {rm_dir}\n")
    with open(config, "w") as f:
        f.write(text)
    return config


@pytest.mark.parametrize("rm_tp", [1, 2])
def test_reward_model_layout_of_its_own(rm_config, capsys, rm_tp):
    base = ["--config", rm_config, "--gpus-per-node", "8", f"reward.tp={rm_tp}"]
    code, est = _plan_json(capsys, *base)
    rows = {r["key"]: r for r in est["rows"]}
    d, vocab = 4096, 128256
    p_rm = _llama3_8b_params() - vocab * d + d  # [1, D] score head instead of the output layer
    replicated = 32 * 2 * d + d + d  # norms and the score head, on every TP rank
    per_rank = (p_rm - replicated) // rm_tp + replicated
    assert rows["reward_model"]["bytes"] == per_rank * 2 and rows["reward_model"]["counted"]
    plan.main([*base])
    assert (
        f"reward model tp({rm_tp}) * pp(1), {2 // rm_tp} replica(s) per actor model-parallel group"
        in capsys.readouterr().out
    )


def test_reward_model_layout_must_nest_in_the_actor(rm_config):
    r = _run_cli("--config", rm_config, "reward.tp=3")
    assert r.returncode == 2, r.stderr
    assert "reward.tp(3) * reward.pp(1) = 3 neither divides actor.tp(2) * actor.pp(1) = 2" in r.stderr
    assert r.stderr.count("\n") == 1


def test_reward_model_shorter_than_the_run_is_refused_as_at_start_up(rm_config, tmp_path):
    """The planner runs start-up's reward-model checks: an RM that cannot attend over prompt + completion
    (256 + 512 tokens here) is refused in one line, as train would refuse it."""
    rm_dir = str(tmp_path / "rm")
    with open(os.path.join(rm_dir, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(rm_dir, "config.json"), "w") as f:
        json.dump(dict(raw, max_position_embeddings=512), f)
    r = _run_cli("--config", rm_config)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        f"error: data.max_prompt_tokens(256) + rollout.max_new_tokens(512) = 768 exceeds reward.model {rm_dir}'s "
        "max_position_embeddings=512: lower one of them"
    ], r.stderr
    assert r.stdout == ""


def test_reward_model_larger_than_the_actor_group(rm_config, capsys):
    """actor TP=2 x dp 4 on 8 GPUs with the RM at TP=4: one RM replica spans two actor groups."""
    code, est = _plan_json(capsys, "--config", rm_config, "--gpus-per-node", "8", "reward.tp=4")
    d, vocab, padded = 4096, 128256, 128512  # the RM's vocab padded to a multiple of 128 * 4
    p_rm, replicated = _llama3_8b_params() - 2 * vocab * d + padded * d + d, 32 * 2 * d + 2 * d
    assert {r["key"]: r for r in est["rows"]}["reward_model"]["bytes"] == ((p_rm - replicated) // 4 + replicated) * 2
    plan.main(["--config", rm_config, "--gpus-per-node", "8", "reward.tp=4"])
    assert "reward model tp(4) * pp(1), one replica over 2 actor model-parallel groups" in capsys.readouterr().out


def test_builtin_model_is_planned_from_its_config_without_building_it(tmp_path, monkeypatch, capsys):
    """The planner reads the architecture only: a built-in model is not trained for a plan."""
    from remax_megatron.builtin.models import builtin_model_path, is_built

    monkeypatch.setenv("REMAX_CACHE", str(tmp_path / "cache"))
    code, est = _plan_json(
        capsys, "--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"), "--nodes", "1", "--gpus-per-node", "2"
    )
    assert est["params"] > 0 and code == 0
    assert not is_built(builtin_model_path("tiny-arith"))


def test_qwen3_8b_parameters_are_the_published_count(tmp_path, capsys):
    """Qwen3-8B's model card: 8.2 B parameters, 6.95 B without the embeddings; the count comes from the
    qwen3 family's tensor rules (q/k norms included)."""
    config = tmp_path / "qwen3.yaml"
    config.write_text(
        f"actor:\n  model: {os.path.join(REPO, 'configs', 'models', 'qwen3-8b')}\n  dtype: bfloat16\n"
        "reward:\n  functions: [exact_match]\ntrainer:\n  prompts_per_step: 64\n"
    )
    code, est = _plan_json(capsys, "--config", str(config), "--gpus-per-node", "8")
    d, f, layers, heads, kv, hd, vocab = 4096, 12288, 36, 32, 8, 128, 151936
    layer = 2 * d * heads * hd + 2 * d * kv * hd + 2 * hd + 3 * d * f + 2 * d  # q, o; k, v; q/k norms; MLP; norms
    assert est["params"] == 2 * vocab * d + layers * layer + d == 8_190_735_360
    assert round((est["params"] - 2 * vocab * d) / 1e9, 2) == 6.95


def test_qwen3_30b_a3b_experts_are_split_over_ep(tmp_path, capsys):
    """Qwen3-30B-A3B's model card: 30.5 B parameters, 3.3 B activated. With experts split over ep * etp and
    the rest over tp * pp, the per-GPU weights follow; FLOPs count the active parameters."""
    config = tmp_path / "moe.yaml"
    config.write_text(
        f"actor:\n  model: {os.path.join(REPO, 'configs', 'models', 'qwen3-30b-a3b')}\n"
        "  dtype: bfloat16\n  tp: 2\n  sequence_parallel: true\n  ep: 8\n  etp: 1\n"
        "reward:\n  functions: [exact_match]\ntrainer:\n  prompts_per_step: 64\n"
    )
    code, est = _plan_json(capsys, "--config", str(config), "--gpus-per-node", "8")
    d, layers, experts, f, vocab, padded = 2048, 48, 128, 768, 151936, 152064
    expert_params = layers * experts * 3 * d * f
    assert est["expert_params"] == expert_params
    assert round(est["params"] / 1e9, 1) == 30.5 and int(est["active_params"] / 1e8) == 33  # 3.35 B
    dense = est["params"] - expert_params  # padded vocab included, tp 2 divides it
    replicated = layers * (2 * d + 2 * 128 + experts * d) + d  # norms, q/k norms, router: on every TP rank
    rows = {r["key"]: r for r in est["rows"]}
    assert rows["weights"]["bytes"] == ((dense - replicated) // 2 + replicated + expert_params // 8) * 2
    from remax_megatron.flops import forward_flops
    from remax_megatron.models.hf_config import read_hf_config

    arch = read_hf_config(os.path.join(REPO, "configs", "models", "qwen3-30b-a3b"))
    # one token: 2 FLOPs per weight it meets -- q, o, k, v, the router and its 8 experts per layer, the logits
    q, kv, k = 32 * 128, 4 * 128, 8
    per_layer = 2 * d * (q + 2 * kv) + 2 * q * d + 2 * d * experts + 6 * d * f * k
    assert forward_flops(arch, [1]) == layers * (per_layer + 2 * q) + 2 * d * vocab
    assert padded > vocab


# ---- the shipped shapes, the recipes' own commands, the heaviest pipeline stage -----------------------------------

MODELS = os.path.join(REPO, "configs", "models")


@pytest.mark.parametrize(
    "shape,published,layers,d,f,heads,kv,vocab,qkv_bias",
    [
        # Qwen2.5-7B's model card: 7.61 B parameters, 6.53 B without the embeddings; untied, qkv biases
        ("qwen2.5-7b", 7_615_616_512, 28, 3584, 18944, 28, 4, 152064, True),
        # Meta-Llama-3-70B: 70.6 B (70,553,706,496); untied
        ("llama3-70b", 70_553_706_496, 80, 8192, 28672, 64, 8, 128256, False),
    ],
)
def test_shipped_shapes_have_the_published_parameter_counts(
    tmp_path, capsys, shape, published, layers, d, f, heads, kv, vocab, qkv_bias
):
    config = tmp_path / "c.yaml"
    config.write_text(
        f"actor:\n  model: {os.path.join(MODELS, shape)}\n  dtype: bfloat16\n"
        "reward:\n  functions: [exact_match]\ntrainer:\n  prompts_per_step: 64\n"
    )
    code, est = _plan_json(capsys, "--config", str(config), "--gpus-per-node", "8")
    hd = d // heads
    layer = 2 * d * heads * hd + 2 * d * kv * hd + (heads * hd + 2 * kv * hd if qkv_bias else 0) + 3 * d * f + 2 * d
    assert est["params"] == 2 * vocab * d + layers * layer + d == published
    if shape == "qwen2.5-7b":
        assert round((published - 2 * vocab * d) / 1e9, 2) == 6.53


def _header_commands(recipe: str) -> list[list[str]]:
    """The commands a recipe's header shows (`#   <command>` lines)."""
    import shlex

    with open(recipe) as f:
        return [shlex.split(line[1:].strip()) for line in f if line.startswith("#   ")]


@pytest.mark.parametrize("recipe", sorted(os.listdir(os.path.join(REPO, "configs", "recipes"))))
def test_recipe_header_commands_work_as_written(recipe, capsys):
    """The planner commands in a recipe's header run as written (the shapes they name are shipped under
    configs/models); the single-node launch command assembles (DRY_RUN=1: it needs GPUs to run)."""
    commands = _header_commands(os.path.join(REPO, "configs", "recipes", recipe))
    plans = [c for c in commands if c[:3] == ["python", "-m", "remax_megatron.plan"]]
    assert plans, f"{recipe}: no planner command in its header"
    for command in plans:
        code = plan.main(command[3:])
        captured = capsys.readouterr()
        assert code in (0, 1) and captured.err == "", (command, captured.err)
        assert "per-GPU memory" in captured.out
    for command in (c for c in commands if c[:2] == ["bash", "launch/torchrun.sh"]):
        r = subprocess.run(
            command, cwd=REPO, env=dict(os.environ, DRY_RUN="1"), capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0 and "remax_megatron.train --config configs/recipes/" in r.stdout, r.stderr


@pytest.fixture(scope="module")
def llama70b_config(tmp_path_factory):
    """The GSM8K recipe with Llama-3-70B as the actor, as a user plans it for 4 nodes x 8 x 80 GiB."""
    path = tmp_path_factory.mktemp("plan70b") / "70b.yaml"
    with open(os.path.join(REPO, "configs", "recipes", "qwen2.5-7b-gsm8k.yaml")) as f:
        text = f.read().replace("/models/Qwen2.5-7B-Instruct", os.path.join(MODELS, "llama3-70b"))
    path.write_text(text)
    return str(path)


def test_fits_is_decided_by_the_heaviest_pipeline_stage(llama70b_config, capsys):
    """What the planner used to suggest for Llama-3-70B on 4 x 8 x 80 GiB, fitting by the uniform share P/(tp*pp):
    its first stage (embedding, 16 micro-batches in flight) does not fit."""
    argv = [
        "--config",
        llama70b_config,
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "actor.recompute=full",
        "actor.pp=16",
        "rollout.tp=8",
    ]
    code, est = _plan_json(capsys, *argv)
    assert est["total_bytes"] == max(est["stage_totals"]) == est["stage_totals"][est["heaviest_stage"]]
    assert est["heaviest_stage"] == 0 and est["stage_totals"][0] > 80 * 2**30 > min(est["stage_totals"])
    assert code == 1 and not est["fits"]


def test_every_suggestion_for_llama3_70b_on_32_gpus_fits_by_its_heaviest_stage(llama70b_config, capsys):
    argv = ["--config", llama70b_config, "--nodes", "4", "--gpus-per-node", "8", "--gpu-mem-gib", "80"]
    assert plan.main(argv) == 1
    suggestions = [
        line.split(":", 1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith("suggestion:")
    ]
    assert len(suggestions) >= 2, suggestions
    assert "actor.tp=8 actor.pp=4 rollout.tp=8" in suggestions[0], suggestions
    for suggestion in suggestions:
        code, est = _apply_suggestion(capsys, argv, suggestion)
        assert code == 0 and est["fits"] and max(est["stage_totals"]) <= 80 * 2**30, (suggestion, est["stage_totals"])


def test_separate_placement_sizes_training_and_rollout_ranks_apart(config, capsys):
    """Issue 36 item 7: 8 GPUs = 2 rollout ranks + 6 training ranks (tp2 -> dp3). The training ranks hold
    no engine; a rollout rank holds its engine, the KV cache of its share of the prompts, one sync bucket."""
    _, colocated = _plan_json(
        capsys, "--config", config, "--nodes", "1", "--gpus-per-node", "8", "trainer.prompts_per_step=48"
    )
    code, est = _plan_json(
        capsys,
        "--config",
        config,
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "rollout.placement=separate",
        "rollout.ranks=2",
        "trainer.prompts_per_step=48",
    )
    assert (est["train_world"], est["rollout_world"], est["dp"], est["engines"]) == (6, 2, 3, 2)
    rows = {r["key"]: r for r in est["rows"]}
    assert not rows["engine_weights"]["counted"] and not rows["kv_cache"]["counted"]
    assert est["train_bytes"] == sum(r["bytes"] for r in est["rows"] if r["counted"])
    side = {r["key"]: r["bytes"] for r in est["rollout_rows"]}
    p = _llama3_8b_params()
    assert side["engine_weights"] == p * 2
    # 48 prompts over 2 engines -> 24 each, 24 * (4 + 1) sequences of 256 + 512 tokens
    assert side["kv_cache"] == 2 * 32 * 8 * 128 * (24 * 5) * 768 * 2
    assert side["sync_bucket"] == 256 * 2**20
    assert est["rollout_bytes"] == sum(side.values())
    assert est["total_bytes"] == max(est["train_bytes"], est["rollout_bytes"])
    assert colocated["rollout_rows"] == [] and colocated["total_bytes"] == colocated["train_bytes"]
    text = (
        plan.main(
            [
                "--config",
                config,
                "--nodes",
                "1",
                "--gpus-per-node",
                "8",
                "rollout.placement=separate",
                "rollout.ranks=2",
                "trainer.prompts_per_step=48",
            ]
        ),
        capsys.readouterr().out,
    )[1]
    assert "on 2 separate rollout ranks (6 train)" in text and "per-GPU memory of a rollout rank" in text


def test_lora_counts_only_the_adapters_as_trained(config, capsys):
    """actor.lora_rank=16 on Llama-3-8B at tp2: gradients and optimizer states are the adapters', computed here
    from the published shapes; the weights row adds them to the base; no reference model with KL on."""
    argv = ("--config", config, "--nodes", "1", "--gpus-per-node", "8", "--gpu-mem-gib", "80")
    _, full = _plan_json(capsys, *argv)
    _, est = _plan_json(capsys, *argv, "actor.lora_rank=16", "algo.kl_coef=0.1", "reference.enabled=true")
    d, f, layers, heads, kv, hd, r, tp = 4096, 14336, 32, 32, 8, 128, 16, 2
    layer = (
        r * (d + (heads + 2 * kv) * hd // tp) + r * (heads * hd // tp + d) + r * (d + 2 * f // tp) + r * (f // tp + d)
    )
    adapters = layers * layer
    rows, base = {r["key"]: r for r in est["rows"]}, {r["key"]: r for r in full["rows"]}
    assert rows["gradients"]["bytes"] == adapters * 4
    assert rows["optimizer"]["bytes"] == adapters * 12
    assert rows["optimizer_distributed"]["bytes"] == adapters * 12 // 4
    assert rows["weights"]["bytes"] == base["weights"]["bytes"] + adapters * 2
    assert rows["reference"]["bytes"] == 0 and not rows["reference"]["counted"]
    assert est["total_bytes"] < full["total_bytes"]


def test_planner_names_the_largest_shipped_model_with_and_without_lora(config, capsys):
    """Issue 37: on 8 x 24 GiB at tp8 an 8B model fits with LoRA (adapter-sized gradients and Adam states,
    no reference) and not with full fine-tuning; on 80 GiB both do."""
    argv = (
        "--config",
        config,
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "actor.tp=8",
        "trainer.micro_batch_size=1",
        "optim.distributed_optimizer=true",
    )
    _, small = _plan_json(capsys, *argv, "--gpu-mem-gib", "24")
    assert small["largest_fitting"]["full"] is None
    assert small["largest_fitting"]["lora"][0] in ("llama3-8b", "qwen3-8b", "qwen2.5-7b")
    _, large = _plan_json(capsys, *argv, "--gpu-mem-gib", "80")
    assert large["largest_fitting"]["full"] is not None and large["largest_fitting"]["lora_rank"] == 16
    plan.main([*argv, "--gpu-mem-gib", "24"])
    name = small["largest_fitting"]["lora"][0]
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith(
            "With full fine-tuning no shipped model (configs/models) fits per GPU at this layout; with LoRA r=16 the "
            f"largest that does is {name} ("
        )
    )


def test_the_planners_last_line_is_a_sentence():
    """Issue 44: it read "full fine-tuning none, LoRA r=16 none"."""
    big, small = ("llama3-70b", 70.6e9), ("qwen3-8b", 8.2e9)
    assert plan.largest_sentence({"full": small, "lora": big, "lora_rank": 16}) == (
        "The largest shipped model (configs/models) that fits per GPU at this layout is qwen3-8b (8.2 B parameters) "
        "with full fine-tuning and llama3-70b (70.6 B parameters) with LoRA r=16."
    )
    assert plan.largest_sentence({"full": None, "lora": None, "lora_rank": 8}) == (
        "No shipped model (configs/models) fits per GPU at this layout, with full fine-tuning or with LoRA r=8."
    )
    assert plan.largest_sentence({"full": small, "lora": None, "lora_rank": 16}).endswith(
        "qwen3-8b (8.2 B parameters) with full fine-tuning; none does with LoRA r=16."
    )


def test_token_budget_sizes_the_activations_and_the_suggestions():
    """trainer.micro_batch_tokens set: a micro-batch holds the budget's tokens (padding included), not
    micro_batch_size * seq; the suggestions halve the budget (down to one longest row)."""
    from remax_megatron.config import load_config
    from remax_megatron.models.hf_config import read_hf_config
    from remax_megatron.plan import _choices, estimate, validate

    arch = read_hf_config(os.path.join(REPO, "configs", "models", "qwen3-8b"))
    base = [
        "reward.functions=[exact_match]",
        "data.max_prompt_tokens=100",
        "rollout.max_new_tokens=28",
        "rollout.engine=native",
        "trainer.micro_batch_size=4",
        "actor.recompute=selective",
    ]
    acts = {}
    for name, extra in (("fixed", []), ("budget", ["trainer.micro_batch_tokens=1024"])):
        cfg = load_config(None, [*base, *extra])
        est = estimate(cfg, arch, None, validate(cfg, arch, 1))
        acts[name] = next(r["bytes"] for r in est["rows"] if r["key"] == "activations")
    # selective recompute: bytes proportional to the tokens, 1024 against 4 * 128
    assert abs(acts["budget"] * 4 * 128 - acts["fixed"] * 1024) <= 1024, acts
    keys = dict(_choices(cfg, arch, 8))
    assert "trainer.micro_batch_size" not in keys and keys["trainer.micro_batch_tokens"] == [512, 256, 128]
