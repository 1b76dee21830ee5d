"""logging.rollouts_every=K: every K steps the step's rollouts as JSONL, to read what the policy really does.

    <trainer.output_dir>/rollouts/step_000010.jsonl        training: n samples + the greedy response per prompt
    <trainer.output_dir>/rollouts/eval_step_000010.jsonl   eval: the greedy response per held-out prompt

One line per response: step, prompt_index (the prompt's row in its dataset), sample (0..n-1, or "greedy"),
prompt (its chat messages, or its text without a chat template), response (decoded), completion_tokens,
finish_reason ("stop" or "length"), reward, baseline (its prompt's greedy reward: the ReMax baseline) and
advantage (reward - baseline, the sequence-level advantage before any per-token KL; 0 for the greedy response
itself). With rollout.env a trajectory also has its messages (assistant turns and observations, in order),
turns, generated_tokens, observation_tokens, finish (done, max_turns, max_total or env_error), turn_finishes
(each turn's stop / length) and env_error (what ended it, or ""); response is then the whole transcript after
the prompt. Every DP rank's responses in global prompt order; rank 0 writes, atomically (a file is whole or
absent; a resumed run rewrites a step's file whole).
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist


class RolloutDump:
    def __init__(self, every: int, output_dir: str, groups, tokenizer):
        self.every, self.dir, self.groups, self.tokenizer = (
            every,
            os.path.join(output_dir, "rollouts"),
            groups,
            tokenizer,
        )

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def write(
        self,
        step: int,
        prompts: list,
        rollouts: list,
        r_sampled: list[float],
        r_greedy: list[float],
        kind: str = "step",
    ) -> None:
        """Step `step`'s responses (this DP rank's `prompts`, their rollouts, r_sampled [P * n], r_greedy [P]),
        every DP rank's together, when the step is due. A collective over DP: every rank calls it."""
        if not self.due(step):
            return
        n = len(r_sampled) // max(len(prompts), 1)
        rows = []
        for i, (q, r) in enumerate(zip(prompts, rollouts)):
            base = {"step": step, "prompt_index": q.index, "prompt": q.messages if q.messages is not None else q.text}
            completions = [(j, c, r_sampled[i * n + j]) for j, c in enumerate(r.sampled[:n])]
            for sample, c, reward in completions + [("greedy", r.greedy, r_greedy[i])]:
                rows.append(
                    {
                        **base,
                        "sample": sample,
                        "response": self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                        "completion_tokens": len(c.token_ids),
                        "finish_reason": c.finish_reason,
                        "reward": reward,
                        "baseline": r_greedy[i],
                        "advantage": reward - r_greedy[i],
                        **_trajectory(c),
                    }
                )
        if self.groups.dp_size > 1:
            everyone: list = [None] * self.groups.dp_size
            dist.all_gather_object(everyone, rows, group=self.groups.dp)
            rows = [row for rank_rows in everyone for row in rank_rows]
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"{'eval_' if kind == 'eval' else ''}step_{step:06d}.jsonl")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        os.replace(tmp, path)


def _trajectory(c) -> dict:
    """A multi-turn trajectory's own fields (rollout/agent.py's Trajectory); {} for a single-turn completion."""
    if not hasattr(c, "turn_finishes"):
        return {}
    return {
        "messages": c.messages,
        "turns": c.turns,
        "generated_tokens": len(c.token_ids) - c.observation_tokens,
        "observation_tokens": c.observation_tokens,
        "finish": c.finish,
        "turn_finishes": c.turn_finishes,
        "env_error": c.error,
    }
