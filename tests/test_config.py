"""Config: YAML + dotted overrides, type conversion, unknown keys, one-line errors, saved config."""

import pytest

from remax_megatron.config import load_config, save_config

R = "reward.functions=[exact_match]"


def test_overrides_convert_to_field_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  tp: 2\nrollout:\n  n: 4\nreward:\n  functions: [exact_match]\n")
    cfg = load_config(
        str(path),
        [
            "trainer.steps=7",
            "optim.lr=3e-6",
            "actor.sequence_parallel=true",
            'rollout.stop=["\\n", END]',
            "reward.weights=0.5",
        ],
    )
    assert (cfg.actor.tp, cfg.rollout.n, cfg.trainer.steps) == (2, 4, 7)
    assert cfg.optim.lr == 3e-6 and cfg.actor.sequence_parallel is True
    assert cfg.rollout.stop == ["\n", "END"] and cfg.reward.weights == [0.5]
    assert cfg.checkpoint.dir.endswith("checkpoints")


def test_saved_config_reloads_identically(tmp_path):
    cfg = load_config(None, [R, "actor.tp=2", "rollout.stop=[a, b]"])
    path = save_config(cfg, str(tmp_path / "out"))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "override,message",
    [
        ("actor.tpp=2", "unknown config key 'actor.tpp'; did you mean actor.tp?"),
        ("trainer.step=3", "did you mean trainer.steps?"),
        ("nosection.x=1", "unknown config key 'nosection.x'"),
        ("trainer.steps=abc", "trainer.steps expects an integer, got 'abc'"),
        ("trainer.steps=1.5", "trainer.steps expects an integer, got 1.5"),
        ("actor.sequence_parallel=maybe", "actor.sequence_parallel expects true or false"),
        ("actor.offload_during_rollout=maybe", "actor.offload_during_rollout expects true or false"),
        ("trainer.peak_tflops=-3", "trainer.peak_tflops=-3.0 must be >= 0"),
        ("optim.lr=fast", "optim.lr expects a number"),
        ("actor.tp=0", "actor.tp=0 must be > 0"),
        ("actor.dtype=fp8", "actor.dtype='fp8' is not one of"),
        ("rollout.kv_cache_gib=-1", "rollout.kv_cache_gib=-1.0 must be >= 0"),
        ("rollout.n=0", "rollout.n=0 must be > 0"),
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens=0 must be > 0"),
        ("rollout.sync_bucket_mb=0", "rollout.sync_bucket_mb=0 must be > 0"),
        ("algo.loss_agg=sum", "algo.loss_agg='sum' is not one of"),
        ("algo.kl_coef=0.1", "needs a reference model"),
        ("checkpoint.resume=/no/such/ckpt", "no such path"),
        ("trainer.steps", "is not key=value"),
        ("trainer.skip_zero_advantage=maybe", "trainer.skip_zero_advantage='maybe' is not one of auto, on, off"),
        ("algo.dynamic_sampling_max_rounds=0", "algo.dynamic_sampling_max_rounds=0 must be > 0"),
        ("reward.overlong_buffer=-1", "reward.overlong_buffer=-1 must be >= 0"),
        ("logging.rollouts_every=-2", "logging.rollouts_every=-2 must be >= 0"),
    ],
)
def test_bad_values_give_one_line_errors(override, message):
    with pytest.raises(ValueError) as e:
        load_config(None, [R, override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_yaml_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  temprature: 0.7\n")
    with pytest.raises(ValueError, match="did you mean rollout.temperature"):
        load_config(str(path), [R])


def test_missing_reward_and_missing_file():
    with pytest.raises(ValueError, match="no reward"):
        load_config(None, [])
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config("nope.yaml")


@pytest.mark.parametrize(
    "tp,pp,world,message",
    [(2, 2, 6, "tp(2) * pp(2) = 4 does not divide world(6)"), (4, 1, 2, "tp(4) * pp(1) = 4 does not divide world(2)")],
)
def test_layout_against_world(tp, pp, world, message):
    cfg = load_config(None, [R, f"actor.tp={tp}", f"actor.pp={pp}"])
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        cfg.check_world(world)


def test_layout_message_names_every_factor():
    from remax_megatron.parallel import ParallelLayout

    assert str(ParallelLayout(tp=2, pp=2, world_size=8)) == "tp(2) * pp(2) * dp(2) = world(8)"


def test_kl_loss_term_refuses_k1():
    """k1 as a loss term has a zero-expectation gradient on-policy: refused, the default is k3."""
    with pytest.raises(ValueError) as e:
        load_config(None, [R, "algo.kl_mode=loss", "algo.kl_estimator=k1"])
    assert "algo.kl_mode=loss with algo.kl_estimator=k1" in str(e.value) and "k3" in str(e.value)
    assert "\n" not in str(e.value)
    assert load_config(None, [R, "algo.kl_mode=loss"]).algo.kl_estimator == "k3"
    assert load_config(None, [R, "algo.kl_mode=loss", "algo.kl_estimator=k2"]).algo.kl_estimator == "k2"
    assert load_config(None, [R, "algo.kl_estimator=k1"]).algo.kl_mode == "reward"  # unused there


def test_reward_layout_nests_in_the_actor_layout():
    """reward.tp * reward.pp divides actor.tp * actor.pp, or is a multiple of it dividing actor.tp * actor.pp * dp."""
    rm = [R, "reward.model=some/rm"]
    load_config(None, [*rm, "actor.tp=2", "reward.tp=1"]).check_world(4)
    load_config(None, [*rm, "actor.tp=2", "actor.pp=2", "reward.pp=2"]).check_world(4)
    load_config(None, [*rm, "actor.tp=1", "reward.tp=2"]).check_world(2)  # one RM over two actor replicas
    for override, world in (["reward.tp=4", 2], ["reward.tp=3", 4]):
        with pytest.raises(ValueError) as e:
            load_config(None, [*rm, "actor.tp=2", override]).check_world(world)
        assert f"reward.tp({override[-1]}) * reward.pp(1)" in str(e.value) and "\n" not in str(e.value)
        assert "neither divides actor.tp(2) * actor.pp(1) = 2" in str(e.value)


@pytest.mark.parametrize(
    "text,where",
    [
        ("actor:\n  tp: [1, 2\nrollout:\n  n: 2\n", ":3:8: invalid YAML, expected ',' or ']', but got"),
        ("actor:\n tp: 1\n  pp: 2\n", ":3:5: invalid YAML, mapping values are not allowed here"),
        ("reward:\n  format_pattern: '^\\d+\n", ":3:1: invalid YAML, found unexpected end of stream"),
    ],
)
def test_yaml_syntax_error_in_file_is_one_line_with_line_and_column(tmp_path, text, where):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_config(str(path), [R])
    assert str(e.value).startswith(str(path) + where), str(e.value)
    assert "\n" not in str(e.value)


def test_yaml_syntax_error_in_override_is_one_line_with_column():
    with pytest.raises(ValueError) as e:
        load_config(None, [R, "actor.model=["])
    message = str(e.value)
    assert message.startswith("override 'actor.model=[', column 14: invalid YAML"), message
    assert "\n" not in message and "\"actor.model='['\"" in message
    assert load_config(None, [R, "actor.model='['"]).actor.model == "["  # the suggested quoting works


def test_help_lists_every_key_with_type_default_and_doc():
    """`python -m remax_megatron.train --help` shows every field of the config dataclasses."""
    import dataclasses
    import subprocess
    import sys
    import typing

    from remax_megatron.config import Config

    out = subprocess.run(
        [sys.executable, "-m", "remax_megatron.train", "--help"], capture_output=True, text=True, check=True
    ).stdout
    lines = out.splitlines()
    count = 0
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            line = next((x for x in lines if x.strip().startswith(f"{section.name}.{f.name} = ")), None)
            assert line is not None, f"--help does not list {section.name}.{f.name}"
            assert f"= {default!r}  [" in line, line
            assert f.metadata.get("doc") and line.rstrip().endswith(f.metadata["doc"]), line
            count += 1
    assert count > 60


def test_fixed_choices_come_from_the_types():
    """A Literal field refuses other values whether it comes from YAML/overrides or a constructor."""
    from remax_megatron.config import AlgoConfig

    with pytest.raises(ValueError, match=r"algo.loss_agg='sum' is not one of token-mean, seq-mean-token-sum"):
        load_config(None, [R, "algo.loss_agg=sum"])
    with pytest.raises(ValueError, match=r"algo.kl_mode='both' is not one of reward, loss"):
        AlgoConfig(kl_mode="both")


def test_separate_placement_refusals_are_one_line():
    """rollout.placement=separate (issue 36): the split of the world is checked before any work."""
    base = ["reward.functions=[exact_match]", "rollout.placement=separate"]
    with pytest.raises(ValueError, match=r"rollout.ranks=0: give the number of ranks"):
        load_config(None, base)
    with pytest.raises(ValueError, match=r"rollout.ranks=1 with rollout.placement=colocated"):
        load_config(None, ["reward.functions=[exact_match]", "rollout.ranks=1"])
    with pytest.raises(ValueError, match=r"rollout.max_staleness=2 must be 0 or 1"):
        load_config(None, [*base, "rollout.ranks=1", "rollout.max_staleness=2"])
    with pytest.raises(ValueError, match=r"rollout.behaviour_logprobs=true needs rollout.placement=separate"):
        load_config(None, ["reward.functions=[exact_match]", "rollout.behaviour_logprobs=true"])
    cfg = load_config(None, [*base, "rollout.ranks=2", "actor.tp=1"])
    with pytest.raises(ValueError, match=r"rollout.ranks\(2\) .* must be in \[1, world\(2\) - 1\]"):
        cfg.check_world(2)
    cfg = load_config(None, [*base, "rollout.ranks=1", "rollout.tp=2", "actor.tp=1"])
    with pytest.raises(ValueError, match=r"rollout.tp\(2\) does not divide rollout.ranks\(1\)"):
        cfg.check_world(3)
    cfg = load_config(None, [*base, "rollout.ranks=1", "actor.tp=2", "trainer.prompts_per_step=8"])
    cfg.check_world(3)  # 2 training ranks at tp2 + 1 rollout rank
    with pytest.raises(ValueError, match=r"actor layout: tp\(2\) \* pp\(1\) = 2 does not divide world\(3\)"):
        cfg.check_world(4)
    assert (cfg.train_world(3), cfg.rollout_world(3)) == (2, 1)


def test_on_and_off_read_as_words_in_yaml(tmp_path):
    """YAML 1.1 reads a bare on / off as a boolean: a Literal with those words takes them back."""
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  skip_zero_advantage: off\n")
    assert load_config(str(path), [R]).trainer.skip_zero_advantage == "off"
    assert load_config(None, [R, "trainer.skip_zero_advantage=on"]).trainer.skip_zero_advantage == "on"


def test_dynamic_sampling_one_step_ahead_is_refused_in_one_line():
    with pytest.raises(
        ValueError,
        match="algo.dynamic_sampling=true with rollout.placement=separate and rollout.max_staleness=1 is not supported",
    ) as e:
        load_config(None, [R, "rollout.placement=separate", "rollout.ranks=1", "algo.dynamic_sampling=true"])
    assert "\n" not in str(e.value)
    load_config(
        None,
        [R, "rollout.placement=separate", "rollout.ranks=1", "rollout.max_staleness=0", "algo.dynamic_sampling=true"],
    )
