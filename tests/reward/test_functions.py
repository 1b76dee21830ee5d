"""Reward functions, weighting, checks, dedup of sampled/greedy, and the adaptive KL controller."""

import math
import sys
import types

import pytest

from remax_megatron.algo.kl_controller import KLController
from remax_megatron.data.prompts import Prompt
from remax_megatron.reward import RewardFunctions, RewardScorer
from remax_megatron.reward.functions import last_number


def test_builtins():
    fns = RewardFunctions(["exact_match", "numeric_match", "format", "length_penalty"], options={"limit": 4})
    total, parts = fns(
        ["p"] * 4, ["7", " 7 ", "the answer is 1,234.0", "12345678"], {"answer": ["7", "8", "1234", "x"]}, [0, 1, 2, 3]
    )
    assert parts["exact_match"] == [1.0, 0.0, 0.0, 0.0]
    assert parts["numeric_match"] == [1.0, 0.0, 1.0, 0.0]
    assert parts["format"] == [1.0, 1.0, 0.0, 1.0]
    assert parts["length_penalty"] == [0.0, 0.0, -(21 - 4) / 4, -1.0]
    assert total == pytest.approx([sum(v[i] for v in parts.values()) for i in range(4)])
    assert last_number("no digits") is None and last_number("-3.5e2 then 42") == 42.0


def test_weighted_sum_matches_hand_computed():
    fns = RewardFunctions(["exact_match", "format"], [0.25, -2.0])
    total, _ = fns(["p", "p"], ["3", "three"], {"answer": ["3", "three"]}, [0, 1])
    assert total == pytest.approx([0.25 * 1 - 2.0 * 1, 0.25 * 1 - 2.0 * 0])


def _user_module():
    mod = types.ModuleType("user_rewards_for_test")
    mod.constant = lambda prompts, responses, **cols: [0.5] * len(responses)
    mod.raises = lambda prompts, responses, **cols: [1 / 0 if r == "bad" else 1.0 for r in responses]
    mod.nan = lambda prompts, responses, **cols: [float("nan") if r == "bad" else 1.0 for r in responses]
    mod.short = lambda prompts, responses, **cols: [1.0]
    mod.not_callable = 3
    sys.modules[mod.__name__] = mod
    return mod.__name__


def test_user_function_by_dotted_path_gets_columns():
    seen = {}
    name = _user_module()

    def capture(prompts, responses, answer, level):
        seen.update(answer=answer, level=level)
        return [1.0] * len(responses)

    sys.modules[name].capture = capture
    fns = RewardFunctions([f"{name}:capture", f"{name}:constant"])
    total, _ = fns(["a", "b"], ["x", "y"], {"answer": ["1", "2"], "level": [3, 4]}, [0, 1])
    assert total == [1.5, 1.5] and seen == {"answer": ["1", "2"], "level": [3, 4]}


@pytest.mark.parametrize(
    "fn,message",
    [
        ("raises", "'{m}:raises' raised ZeroDivisionError: division by zero (on prompt 11)"),
        ("nan", "'{m}:nan' returned nan for prompt 11"),
        ("short", "'{m}:short' returned 1 values for 2 responses"),
    ],
)
def test_bad_reward_function_names_function_and_prompt(fn, message):
    name = _user_module()
    fns = RewardFunctions([f"{name}:{fn}"])
    with pytest.raises(ValueError) as e:
        fns(["p", "q"], ["good", "bad"], {}, [10, 11])
    assert message.format(m=name) in str(e.value)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("no_such_builtin", "is not built in"),
        ("no.such.module:fn", "cannot import no.such.module"),
        ("json:nothing_here", "has no callable 'nothing_here'"),
    ],
)
def test_unresolvable_reward_paths(spec, message):
    with pytest.raises(ValueError, match=message):
        RewardFunctions([spec])


def test_greedy_scored_by_same_reward_and_duplicates_scored_once():
    calls = []

    def counting(prompts, responses, answer):
        calls.extend(responses)
        return [float(r == a) for r, a in zip(responses, answer)]

    name = _user_module()
    sys.modules[name].counting = counting
    scorer = RewardScorer(RewardFunctions([f"{name}:counting"]))
    responses = [
        [([5], "5"), ([6], "6"), ([5], "5")],  # sample, sample, greedy (= first sample)
        [([1], "1"), ([1], "1"), ([2], "2")],
    ]
    prompts = [
        Prompt(index=0, text="a", token_ids=[0], columns={"answer": "5"}),
        Prompt(index=1, text="b", token_ids=[0], columns={"answer": "2"}),
    ]
    scores, metrics = scorer.score(prompts, responses)
    assert scores == [[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
    assert sorted(calls) == sorted(["5", "6", "1", "2"]) and metrics["reward/unique_scored"] == 4


def test_adaptive_kl_controller_matches_formula():
    ctl = KLController(0.1, target=6.0, horizon=1000)
    expected = 0.1
    for kl, n in [(12.0, 64), (3.0, 64), (6.6, 32)]:
        err = min(max(kl / 6.0 - 1, -0.2), 0.2)
        expected *= 1 + err * n / 1000
        assert ctl.update(kl, n) == pytest.approx(expected, rel=1e-12)
    fixed = KLController(0.05)
    assert fixed.update(100.0, 64) == 0.05 and not fixed.adaptive
    assert math.isclose(KLController(0.0, 1.0).update(5.0, 10), 0.0)


# ---- TRL's reward-function convention --------------------------------------------------------------------------


def _trl(name):
    return f"tests.reward.trl_rewards:{name}"


def test_trl_functions_get_keywords_and_chat_completions_as_trl_gives_them():
    from tests.reward import trl_rewards

    trl_rewards.calls.clear()
    messages = [[{"role": "user", "content": "2+3?"}], [{"role": "user", "content": "7*6?"}]]
    fns = RewardFunctions([_trl("accuracy"), _trl("short")])
    total, parts = fns(
        ["<templated 2+3?>", "<templated 7*6?>"],
        ["5", "41"],
        {"answer": ["5", "42"], "level": [1, 2]},
        [0, 1],
        raw_prompts=messages,
        completion_ids=[[9], [8, 7]],
        chat=True,
    )
    (call,) = trl_rewards.calls
    assert call["completions"] == [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "41"}]]
    assert call["prompts"] == messages and call["completion_ids"] == [[9], [8, 7]]
    assert call["answer"] == ["5", "42"] and call["level"] == [1, 2]
    assert parts[_trl("accuracy")] == [1.0, 0.0] and parts[_trl("short")] == [-0.01, -0.02]
    assert total == pytest.approx([0.99, -0.02])
    # string prompts: completions are plain strings
    trl_rewards.calls.clear()
    fns(["2+3?"], ["5"], {"answer": ["5"]}, [0], raw_prompts=["2+3?"])
    assert trl_rewards.calls[0]["completions"] == ["5"] and trl_rewards.calls[0]["prompts"] == ["2+3?"]


def test_a_trl_function_without_kwargs_gets_the_keywords_it_names_and_none_counts_zero():
    total, _ = RewardFunctions([_trl("named_only")])(["p", "q"], ["a", "b"], {"answer": ["1", "2"]}, [0, 1])
    assert total == [1.0, 1.0]
    total, _ = RewardFunctions([_trl("maybe")])(["p", "q"], ["1", "1"], {"answer": ["1", None]}, [0, 1])
    assert total == [1.0, 0.0]


def test_conventions_and_required_columns_come_from_the_signature():
    from remax_megatron.reward.functions import convention, required_columns
    from tests.reward import trl_rewards

    assert convention(trl_rewards.accuracy) == convention(trl_rewards.short) == "trl"
    assert convention(lambda prompts, responses, **cols: []) == convention(print) == "remax"
    assert required_columns(trl_rewards.accuracy) == ["answer"] and required_columns(trl_rewards.named_only) == []

    def mine(prompts, responses, answer, level, scale=1.0, **_):
        return []

    assert required_columns(mine) == ["answer", "level"]


@pytest.mark.parametrize(
    "name,message",
    [
        ("one_value", "returned 1 values for 2 responses at start-up (called on the first 2 rows of d.jsonl"),
        ("text_values", "returned '1.0' (str), not a number at start-up"),
    ],
)
def test_the_start_up_call_refuses_a_wrong_count_or_type_naming_the_contract(name, message):
    from remax_megatron.reward.functions import CONTRACT, RewardBatch

    fns = RewardFunctions([_trl(name)])
    with pytest.raises(ValueError) as e:
        fns.probe(RewardBatch(["p", "q"], ["0", "0"], {"answer": ["1", "2"]}, [0, 1]), "the first 2 rows of d.jsonl")
    line = str(e.value)
    assert message in line and line.endswith(CONTRACT) and "\n" not in line, line


def test_a_trl_function_called_positionally_was_the_failure_the_convention_fixes():
    """What the trainer used to do with `def f(completions, answer, **kw)`: call it as f(prompts, responses, answer=...)
    (TypeError: got multiple values for argument 'answer', a minute into the run)."""
    from tests.reward import trl_rewards

    with pytest.raises(TypeError, match="multiple values for argument 'answer'"):
        trl_rewards.accuracy(["p"], ["5"], answer=["5"])
    assert RewardFunctions([_trl("accuracy")])(["p"], ["5"], {"answer": ["5"]}, [0])[0] == [1.0]


def test_the_contract_is_in_the_trainers_help(capsys):
    from remax_megatron.train import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "fn(prompts, responses, **columns)" in out and "fn(completions, **kwargs)" in out
    assert "called once at start-up on the first rows" in out and "data.system_prompt" in out
