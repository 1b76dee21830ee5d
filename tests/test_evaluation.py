"""evaluation.py: greedy eval scored by the training reward, its record, and the printed samples rotating with
the step (one DP rank here: no process group)."""

from types import SimpleNamespace

from remax_megatron.config import load_config
from remax_megatron.evaluation import Evaluator
from remax_megatron.rollout import Completion, PromptRollout
from remax_megatron.step_metrics import DpReduce


class _Scorer:
    def score(self, prompts, responses, response_columns=None):
        rewards = [[float(len(text))] for ((ids, text),) in responses]
        return rewards, {"reward/exact_match_mean": 0.5, "reward/unique_scored": float(len(prompts))}


def _evaluator(eval_prompts, dp_size=1, **overrides):
    cfg = load_config(
        None, ["reward.functions=[exact_match]", "trainer.eval_every=2", *[f"{k}={v}" for k, v in overrides.items()]]
    )
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "x" * len(ids))
    parts = SimpleNamespace(eval_prompts=eval_prompts, tokenizer=tokenizer, scorer=_Scorer())
    groups = SimpleNamespace(dp_size=dp_size, dp_rank=0, dp=None)
    lines = []
    dispatch = SimpleNamespace(share=lambda prompts: prompts)
    return Evaluator(cfg, parts, dispatch, DpReduce(groups), SimpleNamespace(write=lines.append)), lines


def _prompt(i):
    return SimpleNamespace(text=f"q{i}", raw=f"q{i}", is_chat=False, columns={"answer": str(i)}, token_ids=[i])


def _greedy(prompts):
    """The engine's greedy responses: prompt i answers with i + 1 tokens."""
    return [PromptRollout(sampled=[], greedy=Completion([0] * (q.token_ids[0] + 1), [0.0], "stop")) for q in prompts]


def test_the_record_is_the_greedy_reward_and_the_samples_rotate_with_the_step():
    evaluator, lines = _evaluator(
        [_prompt(i) for i in range(5)], **{"logging.sample_completions": 2, "trainer.eval_prompts": 4}
    )
    asked = []
    record = evaluator.evaluate(4, lambda prompts: asked.append(prompts) or _greedy(prompts))
    assert [q.text for q in asked[0]] == ["q0", "q1", "q2", "q3"]  # trainer.eval_prompts of them
    assert record == {"step": 4, "eval/reward_mean": (1 + 2 + 3 + 4) / 4, "eval/reward/exact_match_mean": 0.5}
    # step 4 at eval_every 2: the third eval, so samples 4 and 5 of the set (mod 4): prompts 0 and 1
    assert lines == [
        "  [eval step 4] 'q0' -> 'x'  (answer '0', reward 1)",
        "  [eval step 4] 'q1' -> 'xx'  (answer '1', reward 2)",
    ]
    lines.clear()
    evaluator.evaluate(2, _greedy)
    assert [line.split("]")[1].split("->")[0].strip() for line in lines] == ["'q2'", "'q3'"]


def test_fewer_eval_prompts_than_data_parallel_ranks_is_no_eval_on_every_rank():
    evaluator, lines = _evaluator([_prompt(0)], dp_size=2)
    assert evaluator.evaluate(2, lambda prompts: 1 / 0) == {} and lines == []
