"""rollout/dump.py (logging.rollouts_every): one JSON line per response, each sample with its own prompt's
greedy reward as baseline, written whole or not at all, only on due steps."""

import json
from types import SimpleNamespace

from remax_megatron.rollout import Completion, PromptRollout
from remax_megatron.rollout.dump import RolloutDump


class _Tokenizer:
    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def _prompt(index, text):
    return SimpleNamespace(index=index, text=text, messages=None)


def test_each_response_is_a_line_with_its_own_prompts_baseline(tmp_path):
    dump = RolloutDump(2, str(tmp_path), SimpleNamespace(dp_size=1, dp_rank=0), _Tokenizer())
    prompts = [_prompt(7, "1+1="), _prompt(3, "2+2=")]
    rollouts = [
        PromptRollout(
            sampled=[Completion([5], [-1.0], "stop"), Completion([6, 6], [-1.0, -2.0], "length")],
            greedy=Completion([2], [-0.5], "stop"),
        )
        for _ in prompts
    ]
    dump.write(1, prompts, rollouts, [1.0, 0.0, 0.0, 1.0], [0.0, 1.0])  # step 1: not due
    assert not (tmp_path / "rollouts").exists()
    dump.write(2, prompts, rollouts, [1.0, 0.0, 0.0, 1.0], [0.0, 1.0])
    rows = [json.loads(line) for line in open(tmp_path / "rollouts" / "step_000002.jsonl")]
    assert [(r["prompt_index"], r["sample"], r["reward"], r["baseline"], r["advantage"]) for r in rows] == [
        (7, 0, 1.0, 0.0, 1.0),
        (7, 1, 0.0, 0.0, 0.0),
        (7, "greedy", 0.0, 0.0, 0.0),
        (3, 0, 0.0, 1.0, -1.0),
        (3, 1, 1.0, 1.0, 0.0),
        (3, "greedy", 1.0, 1.0, 0.0),
    ]
    assert rows[1]["response"] == "6 6" and rows[1]["completion_tokens"] == 2 and rows[1]["finish_reason"] == "length"
    assert rows[0]["prompt"] == "1+1=" and not list((tmp_path / "rollouts").glob("*.tmp"))
    dump.write(4, prompts[:1], rollouts[:1], [], [0.5], kind="eval")  # eval: the greedy responses only
    (row,) = [json.loads(line) for line in open(tmp_path / "rollouts" / "eval_step_000004.jsonl")]
    assert row["sample"] == "greedy" and row["reward"] == 0.5 and row["advantage"] == 0.0
