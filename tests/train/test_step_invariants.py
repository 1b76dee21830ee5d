"""ReMax's invariants at trainer level: one real `Trainer.train_step` (native engine, tiny random
Llama, one process) with spies on the engine, the scorer and the advantage kernel.

The spy scorer gives prompt p's greedy response the reward 10 * index(p) and its sample j the reward
10 * index(p) + j. So if every sample is paired with ITS prompt's greedy reward, sample j's advantage
is exactly j on every response token: 0 for sample 0 (same reward as the greedy), positive for the
others. Pairing a sample with another prompt's greedy reward, or flipping the sign, changes that.
"""

import pytest
import torch

from tests._dist import run_distributed
from tools.make_tiny_model import make_tiny_model

N = 3  # sampled responses per prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("m") / "llama"), "llama", hidden=64, layers=2, heads=4,
                           kv_heads=2, ffn=96, tie=False, seed=3)


class SpyScorer:
    """Rewards from the prompt index and the response's position; records every call."""

    reward_model = None

    def __init__(self):
        self.calls = []

    def score(self, prompt_ids, prompt_texts, columns, indices, responses):
        self.calls.append((list(indices), responses))
        return [[10.0 * i + (j if j < N else 0.0) for j in range(len(row))] for i, row in zip(indices, responses)], {}


def _step_body(rank, world, model_dir, out_dir, result_path):
    import remax_megatron.trainer as trainer_module
    from remax_megatron.config import load_config
    from remax_megatron.train import build, check_inputs

    cfg = load_config(None, [
        f"actor.model={model_dir}", "rollout.engine=native", f"rollout.n={N}", "rollout.max_new_tokens=6",
        "reward.functions=[exact_match]", "trainer.prompts_per_step=4", "trainer.micro_batch_size=4",
        "trainer.eval_every=0", f"trainer.output_dir={out_dir}", "data.max_prompt_tokens=64",
        "logging.tensorboard=false", "logging.progress_bar=false", "optim.lr=1e-3"])
    parts = build(cfg, check_inputs(cfg, world))
    parts.scorer = SpyScorer()
    generated = []
    engine_generate = parts.engine.generate

    def spy_generate(prompts, n, sampling, seeds=None):
        rollouts = engine_generate(prompts, n=n, sampling=sampling, seeds=seeds)
        generated.extend(rollouts)
        return rollouts

    parts.engine.generate = spy_generate
    advantages = []
    kernel = trainer_module.compute_advantages

    def spy_advantages(*args, **kwargs):
        out = kernel(*args, **kwargs)
        advantages.append(out.clone())
        return out

    trainer_module.compute_advantages = spy_advantages
    trainer = trainer_module.Trainer(parts, logger=None)
    record = trainer.train_step()
    torch.save({"calls": parts.scorer.calls, "generated": generated, "advantages": torch.cat(advantages),
                "record": record}, result_path)


@pytest.fixture(scope="module")
def step(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step")
    path = tmp / "step.pt"
    run_distributed(_step_body, world_size=1, args=(model_dir, str(tmp / "out"), str(path)))
    return torch.load(path, weights_only=False)


@pytest.mark.slow
def test_samples_and_greedy_are_scored_together_by_the_same_scorer(step):
    (indices, responses), = step["calls"]  # one scoring call per step
    assert len(responses) == 4 and all(len(row) == N + 1 for row in responses)
    for row, rollout in zip(responses, step["generated"]):
        assert [ids for ids, _ in row[:N]] == [c.token_ids for c in rollout.sampled]
        assert row[N][0] == rollout.greedy.token_ids  # the greedy response comes last in its prompt's row


@pytest.mark.slow
def test_each_sample_is_paired_with_its_own_prompts_greedy_reward(step):
    adv = step["advantages"]  # [prompts * N, S], rows prompt-major
    lengths = [len(c.token_ids) for r in step["generated"] for c in r.sampled]
    assert adv.shape[0] == 4 * N
    for row, length in enumerate(lengths):
        j = row % N
        values = adv[row][adv[row] != 0] if j else adv[row]
        # sample j's advantage is j on each of its response tokens (and 0 on sample 0: same reward as greedy)
        assert int((adv[row] != 0).sum()) == (length if j else 0), (row, adv[row])
        assert torch.all(values == float(j)), (row, adv[row])


@pytest.mark.slow
def test_the_step_reports_the_rewards_it_trained_on(step):
    record, (indices, _) = step["record"], step["calls"][0]
    assert record["reward/greedy_mean"] == pytest.approx(sum(10.0 * i for i in indices) / 4)
    assert record["reward/sampled_mean"] == pytest.approx(sum(10.0 * i + j for i in indices for j in range(N)) / 12)
    assert record["advantage/mean"] > 0
