"""ReMax's invariants at trainer level: one real `Trainer.train_step` (native engine, tiny random
Llama, one process) with spies on the engine, the scorer and the advantage kernel.

The spy scorer gives prompt p's greedy response the reward 10 * index(p) and its sample j the reward
10 * index(p) + j. So if every sample is paired with ITS prompt's greedy reward, sample j's advantage
is exactly j on every response token: 0 for sample 0 (same reward as the greedy), positive for the
others. Pairing a sample with another prompt's greedy reward, or flipping the sign, changes that.

The same step with a reference model and KL in the reward (advantages vs a plain fp64 loop) or in the
loss, and with two mini-batches per rollout (old log-probs, ratio 1 then != 1).
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
    from remax_megatron.startup import build, check_inputs

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


# ---- the reference model + KL (both modes) and several mini-batches, through the real step ------

def _paths_body(rank, world, model_dir, ref_dir, out_dir, result_path):
    import remax_megatron.trainer as trainer_module
    from remax_megatron.config import load_config
    from remax_megatron.startup import build, check_inputs

    common = [f"actor.model={model_dir}", "rollout.engine=native", f"rollout.n={N}", "rollout.max_new_tokens=6",
              "reward.functions=[exact_match]", "trainer.prompts_per_step=4", "trainer.micro_batch_size=2",
              "trainer.eval_every=0", "data.max_prompt_tokens=64", "logging.tensorboard=false",
              "logging.progress_bar=false", "optim.lr=1e-3"]
    kl = ["reference.enabled=true", f"reference.model={ref_dir}", "algo.kl_coef=0.5"]
    runs = {"kl_reward": kl + ["algo.kl_mode=reward"], "kl_loss": kl + ["algo.kl_mode=loss"],
            "mini_batches": ["trainer.mini_batches=2"]}
    kernel, loss_fn, results = trainer_module.compute_advantages, trainer_module.remax_loss, {}
    for name, extra in runs.items():
        cfg = load_config(None, common + extra + [f"trainer.output_dir={out_dir}/{name}"])
        parts = build(cfg, check_inputs(cfg, world))
        parts.scorer = SpyScorer()
        seen = {"advantages": [], "loss": [], "logprob_passes": 0}

        def spy_advantages(*args, **kwargs):
            out = kernel(*args, **kwargs)
            seen["advantages"].append(([a.clone() if torch.is_tensor(a) else a for a in args], dict(kwargs),
                                       out.clone()))
            return out

        def spy_loss(logprobs, advantages, mask, **kwargs):
            seen["loss"].append({k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in kwargs.items()
                                 if k in ("old_logprobs", "ref_logprobs", "kl_coef")} | {"logprobs": logprobs.detach().clone()})
            return loss_fn(logprobs, advantages, mask, **kwargs)

        trainer_module.compute_advantages, trainer_module.remax_loss = spy_advantages, spy_loss
        trainer = trainer_module.Trainer(parts, logger=None)
        logprobs = trainer._logprobs

        def counted(model, batch, plan):
            seen["logprob_passes"] += 1
            return logprobs(model, batch, plan)

        trainer._logprobs = counted
        seen["record"] = trainer.train_step()
        results[name] = seen
        trainer_module.compute_advantages, trainer_module.remax_loss = kernel, loss_fn
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    torch.save(results, result_path)


@pytest.fixture(scope="module")
def paths(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("paths")
    ref_dir = make_tiny_model(str(tmp / "ref"), "llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=96,
                              tie=False, seed=11)  # same architecture, other weights: KL > 0 from step 1
    run_distributed(_paths_body, world_size=1, args=(model_dir, ref_dir, str(tmp / "out"), str(tmp / "paths.pt")))
    return torch.load(tmp / "paths.pt", weights_only=False)


def _advantages_by_loop(rewards, baseline, mask, logprobs, ref, kl_coef):
    """A plain fp64 loop: sequence reward minus the greedy one, plus the KL penalty still to come."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                to_go = sum(float(logprobs[b, k]) - float(ref[b, k]) for k in range(t, mask.shape[1]) if mask[b, k])
                out[b, t] = float(rewards[b]) - float(baseline[b]) - kl_coef * to_go
    return out


@pytest.mark.slow
def test_kl_in_the_reward_enters_the_advantages(paths):
    run = paths["kl_reward"]
    assert run["logprob_passes"] == 1  # the reference only: on-policy, the actor's come from the training forward
    assert run["record"]["kl/mean"] != 0.0
    for (rewards, baseline, mask, logprobs, ref), kwargs, got in run["advantages"]:
        assert ref is not None and kwargs["kl_coef"] == 0.5
        expected = _advantages_by_loop(rewards, baseline, mask, logprobs, ref, 0.5)
        assert (got.double() - expected).abs().max() < 1e-5
        assert (got.double() - (rewards - baseline)[:, None] * mask).abs().max() > 1e-3  # the KL term is there
    assert all(call["ref_logprobs"] is None for call in run["loss"])  # not twice: not in the loss too


@pytest.mark.slow
def test_kl_in_the_loss_is_a_loss_term_and_not_in_the_advantages(paths):
    run = paths["kl_loss"]
    for (rewards, baseline, mask, *policy), kwargs, got in run["advantages"]:
        assert policy == [] and kwargs.get("kl_coef", 0.0) == 0.0  # no log-probs, no KL: r - r_greedy
        assert torch.equal(got, (rewards - baseline)[:, None] * mask.float())
    assert all(call["ref_logprobs"] is not None and call["kl_coef"] == 0.5 for call in run["loss"])
    assert run["record"]["kl/mean"] != 0.0


@pytest.mark.slow
def test_several_mini_batches_use_the_rollout_policy_as_old_logprobs(paths):
    run = paths["mini_batches"]
    assert run["logprob_passes"] == 1  # the old log-prob pass runs (off-policy after the first update)
    calls = run["loss"]  # 12 sequences / 2 updates / micro-batch 2 = 3 micro-batches per update
    assert len(calls) == 6 and all(call["old_logprobs"] is not None for call in calls)
    first, second = calls[:3], calls[3:]
    # first update: the weights are the rollout's, ratio 1; second update: they moved, ratio != 1
    assert all((c["logprobs"] - c["old_logprobs"]).abs().max() < 1e-5 for c in first)
    assert any((c["logprobs"] - c["old_logprobs"]).abs().max() > 1e-4 for c in second)
