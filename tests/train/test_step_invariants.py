"""ReMax's invariants at trainer level: real `Trainer.train_step`s (native engine, tiny random Llama,
one process) with spies on the engine, the scorer and the advantage kernel. The first group is in
the fast lane: each fails within seconds when its invariant breaks.

The spy scorer gives prompt p's greedy response the reward 10 * index(p) and its sample j the reward
10 * index(p) + OFFSETS[j], OFFSETS = (-1, 0, 2). So when every sample is paired with ITS prompt's
greedy reward, sample j's advantage is exactly OFFSETS[j] on every response token: negative, zero
(a tie) and positive. Pairing a sample with another prompt's greedy reward (`repeat` instead of
`repeat_interleave` in batching.rollout_batch), flipping the sign, or a baseline that is not the greedy reward
(the mean of the prompt's sampled rewards is 10 * index(p) + 1/3) changes that. Two steps at a
large learning rate: the engine the second step samples from must carry the first update's weights
(an engine one update behind shows a log-prob gap of 1e-2 and more).

Greedy == argmax decoding, per engine: tests/rollout/test_native.py (native) and
tests/rollout/test_vllm_engine.py (vLLM).

The same step with a reference model and KL in the reward (advantages vs a plain fp64 loop) or in the
loss, and with two mini-batches per rollout (old log-probs, ratio 1 then != 1): slow.
"""

import pytest
import torch

from tests._dist import run_distributed
from tests.train.update_helpers import tiny_llama
from tools.make_tiny_model import make_tiny_model

N = 3  # sampled responses per prompt
OFFSETS = (-1.0, 0.0, 2.0)  # sample j's reward minus its prompt's greedy reward


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory, tie=False, seed=3)


class SpyScorer:
    """Rewards from the prompt index and the response's position; records every call."""

    reward_model = None

    def __init__(self, offsets=tuple(float(j) for j in range(N))):
        self.calls, self.offsets = [], offsets

    def score(self, prompts, responses, wait=None, response_columns=None):
        indices = [q.index for q in prompts]
        self.calls.append((indices, responses))
        return [
            [10.0 * i + (self.offsets[j] if j < N else 0.0) for j in range(len(row))]
            for i, row in zip(indices, responses)
        ], {}


def _step_body(rank, world, model_dir, out_dir, result_path, skip="off"):
    import remax_megatron.trainer as trainer_module
    import remax_megatron.update as update_module
    from remax_megatron.config import load_config
    from remax_megatron.startup import build, check_inputs

    cfg = load_config(
        None,
        [
            f"actor.model={model_dir}",
            "rollout.engine=native",
            f"rollout.n={N}",
            "rollout.max_new_tokens=6",
            "reward.functions=[exact_match]",
            "trainer.prompts_per_step=4",
            "trainer.micro_batch_size=4",
            "trainer.eval_every=0",
            f"trainer.output_dir={out_dir}",
            "data.max_prompt_tokens=64",
            "logging.tensorboard=false",
            "logging.progress_bar=false",
            "optim.lr=1e-2",
            # off: every row reaches the loss, so the spies see each pairing (on: test_skipped_rows_are_...)
            f"trainer.skip_zero_advantage={skip}",
        ],
    )
    parts = build(cfg, check_inputs(cfg, world))
    parts.scorer = SpyScorer(OFFSETS)
    generated = []
    engine_generate = parts.engine.generate

    def spy_generate(prompts, n, sampling, seeds=None):
        rollouts = engine_generate(prompts, n=n, sampling=sampling, seeds=seeds)
        generated.append(rollouts)
        return rollouts

    parts.engine.generate = spy_generate
    advantages = []
    kernel = update_module.compute_advantages

    def spy_advantages(rewards, baseline, mask, *args, **kwargs):
        out = kernel(rewards, baseline, mask, *args, **kwargs)
        advantages[-1].append((rewards.clone(), baseline.clone(), out.clone()))
        return out

    update_module.compute_advantages = spy_advantages
    trainer = trainer_module.Trainer(parts, logger=None)
    records, weights = [], []
    initial = {n: p.detach().clone() for n, p in trainer.actor_module.named_parameters()}
    for _ in range(2):
        advantages.append([])
        records.append(trainer.train_step())
        trainer.step += 1
        weights.append({n: p.detach().clone() for n, p in trainer.actor_module.named_parameters()})
    steps = [
        {
            "calls": call,
            "generated": gen,
            "record": rec,
            "rewards": torch.cat([r for r, _, _ in adv]),
            "baseline": torch.cat([b for _, b, _ in adv]),
            "advantages": torch.cat([a for _, _, a in adv]),
        }
        for call, gen, rec, adv in zip(parts.scorer.calls, generated, records, advantages)
    ]
    moved = max((after - initial[n]).abs().max().item() for n, after in weights[0].items())
    torch.save({"steps": steps, "moved": moved}, result_path)


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    """Two steps of the real trainer: {"steps": [{calls, generated, record, rewards, baseline, advantages}] per
    step, "moved": the largest weight change of step 1's update}."""
    tmp = tmp_path_factory.mktemp("step")
    path = tmp / "step.pt"
    run_distributed(_step_body, world_size=1, args=(model_dir, str(tmp / "out"), str(path)))
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def run_skipping(model_dir, tmp_path_factory):
    """The same two steps with trainer.skip_zero_advantage=on."""
    tmp = tmp_path_factory.mktemp("skip")
    path = tmp / "step.pt"
    run_distributed(_step_body, world_size=1, args=(model_dir, str(tmp / "out"), str(path), "on"))
    return torch.load(path, weights_only=False)


def test_skipped_rows_are_exactly_the_ties_and_the_rest_keep_their_pairing(run_skipping):
    """trainer.skip_zero_advantage=on: sample 1 of each prompt ties its greedy reward and never reaches the
    loss; every row that does is still paired with its own prompt's greedy reward, advantage OFFSETS[j]."""
    for step in run_skipping["steps"]:
        trained = [(i, j) for i, j, _ in _rows(step) if OFFSETS[j] != 0]
        assert step["baseline"].shape[0] == len(trained) == 4 * (N - 1), step["baseline"]
        seen = sorted(zip(step["baseline"].tolist(), step["rewards"].tolist()))
        assert seen == sorted((10.0 * i, 10.0 * i + OFFSETS[j]) for i, j in trained)
        adv = step["advantages"]  # each row: r - r_greedy on its response tokens, 0 elsewhere
        assert torch.equal(adv.amax(1) + adv.amin(1), step["rewards"] - step["baseline"])
        assert step["record"]["batch/skipped_rows"] == 4 and step["record"]["batch/zero_advantage_frac"] == 1 / 3


def _rows(step):
    """(prompt index, sample j, response length) of each trained row, prompt-major."""
    indices, _ = step["calls"]
    return [(i, j, len(c.token_ids)) for i, r in zip(indices, step["generated"]) for j, c in enumerate(r.sampled)]


def test_samples_and_greedy_are_scored_together_by_the_same_scorer(run):
    steps = run["steps"]
    indices, responses = steps[0]["calls"]  # one scoring call per step
    assert len(responses) == 4 and all(len(row) == N + 1 for row in responses)
    for row, rollout in zip(responses, steps[0]["generated"]):
        assert [ids for ids, _ in row[:N]] == [c.token_ids for c in rollout.sampled]
        assert row[N][0] == rollout.greedy.token_ids  # the greedy response comes last in its prompt's row


def test_each_sample_is_paired_with_its_own_prompts_greedy_reward(run):
    steps = run["steps"]
    for step in steps:
        rows = _rows(step)
        assert step["baseline"].shape[0] == len(rows) == 4 * N
        for b, (i, j, _) in enumerate(rows):
            assert step["rewards"][b] == 10.0 * i + OFFSETS[j], (b, step["rewards"])
            assert step["baseline"][b] == 10.0 * i, (
                f"row {b} (prompt {i}, sample {j}) got baseline "
                f"{float(step['baseline'][b])}, not its prompt's greedy reward"
            )


def test_advantage_is_reward_minus_greedy_reward_with_its_sign_and_zero_on_ties(run):
    steps = run["steps"]
    for step in steps:
        adv = step["advantages"]  # [prompts * N, S]
        for b, (_, j, length) in enumerate(_rows(step)):
            tokens = adv[b][adv[b] != 0]
            if OFFSETS[j] == 0:  # a tie with the greedy reward: no signal at all
                assert int((adv[b] != 0).sum()) == 0, (b, adv[b])
            else:  # every response token carries r - r_greedy, with its sign
                assert int((adv[b] != 0).sum()) == length, (b, adv[b])
                assert torch.all(tokens == OFFSETS[j]), (b, j, adv[b])


def test_the_baseline_is_the_greedy_reward_not_a_mean_of_samples(run):
    steps = run["steps"]
    for step in steps:
        indices, _ = step["calls"]
        sampled = step["rewards"].view(-1, N)
        assert not torch.allclose(sampled.mean(1), torch.tensor([10.0 * i for i in indices]))  # tells them apart
        assert torch.equal(step["baseline"].view(-1, N)[:, 0], torch.tensor([10.0 * i for i in indices]))
        record = step["record"]
        assert record["reward/greedy_mean"] == pytest.approx(sum(10.0 * i for i in indices) / 4)
        assert record["reward/sampled_mean"] == pytest.approx(sum(10.0 * i + o for i in indices for o in OFFSETS) / 12)
        assert record["reward/tie_frac"] == pytest.approx(1 / 3)  # sample 1 of each prompt


def test_the_engine_follows_the_actor_after_an_update(run):
    steps = run["steps"]
    first, second = steps[0]["record"], steps[1]["record"]
    # step 1 changed the weights, enough for an engine left behind to be 1e-2 and more off
    assert first["grad_norm"] > 0 and first["optim/skipped_updates"] == 0 and run["moved"] > 5e-3, run["moved"]
    # step 2 sampled from the engine after step 1's update: its log-probs are the updated actor's
    assert second["logprob/engine_vs_actor_max_diff"] < 1e-4, second["logprob/engine_vs_actor_max_diff"]
    assert first["logprob/engine_vs_actor_max_diff"] < 1e-4


# ---- the reference model + KL (both modes) and several mini-batches, through the real step ------


def _spied_step(parts, update_module, trainer_module) -> dict:
    """One training step of a Trainer built from `parts`, recording every advantage-kernel call, every loss
    call's inputs and the number of log-prob passes (the module's functions are restored after the step)."""
    kernel, loss_fn = update_module.compute_advantages, update_module.remax_loss
    seen = {"advantages": [], "loss": [], "logprob_passes": 0}

    def spy_advantages(*args, **kwargs):
        out = kernel(*args, **kwargs)
        seen["advantages"].append(([a.clone() if torch.is_tensor(a) else a for a in args], dict(kwargs), out.clone()))
        return out

    def spy_loss(logprobs, advantages, mask, **kwargs):
        seen["loss"].append(
            {
                k: (v.detach().clone() if torch.is_tensor(v) else v)
                for k, v in kwargs.items()
                if k in ("old_logprobs", "ref_logprobs", "kl_coef")
            }
            | {"logprobs": logprobs.detach().clone()}
        )
        return loss_fn(logprobs, advantages, mask, **kwargs)

    update_module.compute_advantages, update_module.remax_loss = spy_advantages, spy_loss
    trainer = trainer_module.Trainer(parts, logger=None)
    logprobs = trainer.updater.logprobs

    def counted(model, batch, plan):
        seen["logprob_passes"] += 1
        return logprobs(model, batch, plan)

    trainer.updater.logprobs = counted
    seen["record"] = trainer.train_step()
    update_module.compute_advantages, update_module.remax_loss = kernel, loss_fn
    return seen


def _paths_body(rank, world, model_dir, ref_dir, out_dir, result_path):
    import remax_megatron.trainer as trainer_module
    import remax_megatron.update as update_module
    from remax_megatron.config import load_config
    from remax_megatron.startup import build, check_inputs

    common = [
        f"actor.model={model_dir}",
        "rollout.engine=native",
        f"rollout.n={N}",
        "rollout.max_new_tokens=6",
        "reward.functions=[exact_match]",
        "trainer.prompts_per_step=4",
        "trainer.micro_batch_size=2",
        "trainer.eval_every=0",
        "data.max_prompt_tokens=64",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "optim.lr=1e-3",
        "trainer.skip_zero_advantage=off",
    ]  # the spies count every row's loss call (sample 0 ties)
    kl = ["reference.enabled=true", f"reference.model={ref_dir}", "algo.kl_coef=0.5"]
    runs = {
        "kl_reward": kl + ["algo.kl_mode=reward"],
        "kl_loss": kl + ["algo.kl_mode=loss"],
        "mini_batches": ["trainer.mini_batches=2"],
    }
    results = {}
    for name, extra in runs.items():
        cfg = load_config(None, common + extra + [f"trainer.output_dir={out_dir}/{name}"])
        parts = build(cfg, check_inputs(cfg, world))
        parts.scorer = SpyScorer()
        results[name] = _spied_step(parts, update_module, trainer_module)
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    torch.save(results, result_path)


@pytest.fixture(scope="module")
def paths(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("paths")
    ref_dir = make_tiny_model(
        str(tmp / "ref"), "llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, tie=False, seed=11
    )  # same architecture, other weights: KL > 0 from step 1
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
