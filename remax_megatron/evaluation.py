"""Eval: greedy decoding on the held-out prompts, scored by the training reward, a few samples printed.

    evaluator = Evaluator(cfg, parts, dispatch, reduce, log)
    record = evaluator.evaluate(step, generate)   # generate(prompts) -> this replica's rollouts (after a sync)

The record holds eval/reward_mean and each reward function's and the reward model's mean
(eval/reward/<fn>_mean) over every DP rank's share.
"""

from __future__ import annotations

import torch.distributed as dist

from remax_megatron.data.prompts import Prompt
from remax_megatron.rollout.agent import compact, env_columns, env_scores, scored_text
from remax_megatron.rollout.dump import RolloutDump
from remax_megatron.step_metrics import agent_metrics


class Evaluator:
    def __init__(self, cfg, parts, dispatch, reduce, log):
        self.cfg, self.parts, self.dispatch, self.reduce, self.log = cfg, parts, dispatch, reduce, log
        self.groups = reduce.groups
        self.dump = RolloutDump(cfg.logging.rollouts_every, cfg.trainer.output_dir, self.groups, parts.tokenizer)

    def evaluate(self, step: int, generate) -> dict:
        """The eval record at step `step` ({} without enough held-out prompts for every DP rank);
        `generate(prompts)` decodes this replica's share (n=0: the greedy response only)."""
        selected = self.parts.eval_prompts[: self.cfg.trainer.eval_prompts]
        if len(selected) < self.groups.dp_size:  # the same decision on every rank: no DP rank waits for another
            return {}
        prompts = self.dispatch.share(selected)
        rollouts = generate(prompts)
        tokenizer = self.parts.tokenizer
        responses = [[(r.greedy.token_ids, scored_text(r.greedy, tokenizer, self.cfg.reward.turns))] for r in rollouts]
        scores, metrics = env_scores(rollouts), {}  # rollout.env with reward(): the environment's
        if scores is None:
            scores, metrics = self.parts.scorer.score(prompts, responses, response_columns=env_columns(rollouts))
        rewards = [row[0] for row in scores]
        shown = [compact(r.greedy) or text for r, ((_, text),) in zip(rollouts, responses)]
        self._print_samples(step, prompts, shown, rewards)
        self.dump.write(step, prompts, rollouts, [], rewards, kind="eval")  # logging.rollouts_every
        record = {"step": step, "eval/reward_mean": self.reduce.dp_mean(rewards)}
        record.update(
            {f"eval/{k}": v for k, v in self.reduce.reward_metrics(metrics).items() if k != "reward/unique_scored"}
        )
        if self.cfg.rollout.multi_turn:  # eval/agent/*, time/eval/env_s
            record.update(agent_metrics(rollouts, self.dispatch.env_seconds, self.reduce, prefix="eval/"))
        return record

    def _print_samples(self, step: int, prompts: list[Prompt], responses: list[str], rewards: list[float]) -> None:
        """logging.sample_completions eval samples with their reference answer and reward. Each eval shows
        the next ones of the evaluated set (rotating with the step, so a resumed run shows the same), from
        whichever DP rank decoded them."""
        count = self.cfg.logging.sample_completions
        total = len(prompts) * self.groups.dp_size  # the evaluated prompts, every DP rank's share in order
        if not count or not total:
            return
        every = max(self.cfg.trainer.eval_every, 1)
        shown = {(step // every * count + j) % total for j in range(min(count, total))}
        first = self.groups.dp_rank * len(prompts)
        lines = []
        for i, (q, response, reward) in enumerate(zip(prompts, responses, rewards)):
            if first + i in shown:
                question = q.raw[-1]["content"] if q.is_chat else q.raw or q.text
                answer = f"answer {_clipped(q.columns['answer'])}, " if q.columns.get("answer") is not None else ""
                lines.append(
                    (
                        first + i,
                        f"  [eval step {step}] {_clipped(question)} -> {_clipped(response)}  "
                        f"({answer}reward {reward:.4g})",
                    )
                )
        if self.groups.dp_size > 1:
            everyone: list = [None] * self.groups.dp_size
            dist.all_gather_object(everyone, lines, group=self.groups.dp)
            lines = [line for rank_lines in everyone for line in rank_lines]
        for _, line in sorted(lines):
            self.log.write(line)


def _clipped(value, limit: int = 200) -> str:
    """repr of a value for a console line, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
