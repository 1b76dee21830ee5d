"""Training on multi-turn trajectories (issue 41): the loss and gradient of one update on a batch of 3-turn
trajectories (generated, observation, generated, observation, generated tokens) equal an unsharded fp64
reference that trains the generated tokens only, at tp1, tp2, pp2, dp2 and with packed rows. The same
reference with the observation tokens put into the mask, or with one turn's generated tokens dropped, is far
from the update: the check sees both mistakes."""

import os

import pytest
import torch

from tests._dist import SharedLaunches
from tests.train.test_update import _max_rel, _trainer, model_dir  # noqa: F401  (model_dir: fixture)

LAYOUTS = [(1, 1, 1, "fixed"), (2, 1, 1, "fixed"), (1, 2, 1, "fixed"), (1, 1, 2, "fixed"), (1, 1, 1, "packed")]
VARIANTS = {
    "fixed": ["trainer.micro_batch_size=2"],
    "packed": [
        "trainer.micro_batch_tokens=40",
        "trainer.pack_sequences=true",
        "data.max_prompt_tokens=4",
        "rollout.max_new_tokens=20",
    ],
}
ROWS, PROMPT = 8, 4
LR, EPS = 1e-2, 1e-3


def trajectories():
    """ROWS rows: a 4-token prompt and a trajectory of 3 generated turns with 2 observations between them
    (lengths differ per row), its loss mask, and a reward per row (baseline 0: the advantage is the reward)."""
    from remax_megatron.rollout.agent import Trajectory

    g = torch.Generator().manual_seed(3)
    prompts, rows = [], []
    for r in range(ROWS):
        pieces = [(1 + r % 3, 1), (2 + r % 2, 0), (2, 1), (1 + r % 4, 0), (1 + (r + 1) % 3, 1)]
        ids, mask = [], []
        for length, generated in pieces:
            ids += torch.randint(4, 100, (length,), generator=g).tolist()
            mask += [generated] * length
        t = Trajectory(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", loss_mask=mask, turns=3)
        prompts.append(torch.randint(4, 100, (PROMPT,), generator=g).tolist())
        rows.append(t)
    return prompts, rows, torch.randn(ROWS, generator=g)


def _batch():
    from remax_megatron.batching import pad_sequences

    prompts, rows, rewards = trajectories()
    batch = pad_sequences(prompts, rows, pad_id=0)
    batch["rewards"], batch["baseline"] = rewards, torch.zeros(ROWS)
    return batch


def _body(rank, world, model_dir, tp, pp, variant, out_path):  # noqa: F811
    """One update on this DP rank's share of the trajectories: the loss and the full (HF-named) gradient."""
    from remax_megatron.step_metrics import swap_data
    from remax_megatron.weights import export_hf_weights

    trainer, actor, ddp, _ = _trainer(
        world,
        model_dir,
        tp,
        pp,
        [*VARIANTS[variant], f"optim.lr={LR}", "optim.grad_clip=0", f"optim.eps={EPS}", "optim.weight_decay=0"],
    )
    g, batch = trainer.groups, _batch()
    rows = ROWS // g.dp_size
    mine = {k: v[g.dp_rank * rows : (g.dp_rank + 1) * rows] for k, v in batch.items()}
    local, plan = trainer.updater.micro_batch_plan(mine)
    params, grads, step = list(actor.parameters()), [], trainer.parts.optimizer.step

    def step_keeping_the_gradient():  # the update's (DP-reduced) gradient, before the step clears it
        grads.extend(p.main_grad.detach().clone().view(p.shape) for p in params)
        return step()

    trainer.parts.optimizer.step = step_keeping_the_gradient
    update = trainer.updater.train_on(local, None, None, plan)
    swap_data(params, grads)
    gradient = {n: t.clone() for n, t in export_hf_weights(actor)}
    swap_data(params, grads)
    if rank == 0:
        torch.save({"loss": update.stats["loss"], "gradient": gradient}, out_path)


def reference(model_path, mask_of=lambda row: row.loss_mask) -> tuple[float, dict]:
    """fp64, unsharded: the token-mean ReMax loss over the tokens `mask_of` marks, and its gradient."""
    from transformers import AutoModelForCausalLM

    prompts, rows, rewards = trajectories()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    total, tokens = 0.0, sum(sum(mask_of(t)) for t in rows)
    for prompt, t, reward in zip(prompts, rows, rewards.double()):
        ids = torch.tensor([prompt + t.token_ids])
        logp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]  # [S - 1]
        trained = torch.tensor([0] * (len(prompt) - 1) + list(mask_of(t)), dtype=torch.float64)
        # one update on its own rollout (trainer.mini_batches=1): the loss is -A * log p per trained token
        total = total - (reward * trained * logp).sum() / tokens
    total.backward()
    return float(total), {n: p.grad.float() for n, p in model.named_parameters()}


def _drop_last_turn(row):
    mask = list(row.loss_mask)
    last = max(i for i, m in enumerate(mask) if m == 0)  # the final turn's generated tokens follow it
    return mask[: last + 1] + [0] * (len(mask) - last - 1)


@pytest.fixture(scope="module")
def launched(model_dir, tmp_path_factory):  # noqa: F811
    top = str(tmp_path_factory.mktemp("agent_loss"))
    cases: dict = {}
    for tp, pp, dp, variant in LAYOUTS:
        name = f"agent-{tp}{pp}{dp}-{variant}"
        cases.setdefault(tp * pp * dp, {})[name] = (
            _body,
            (model_dir, tp, pp, variant, os.path.join(top, name + ".pt")),
        )
    launches = SharedLaunches(cases, top)

    def result(tp, pp, dp, variant):
        name = f"agent-{tp}{pp}{dp}-{variant}"
        launches.check(name)
        return torch.load(os.path.join(top, name + ".pt"))

    return result


@pytest.fixture(scope="module")
def references(model_dir):  # noqa: F811
    return {
        "generated": reference(model_dir),
        "observations too": reference(model_dir, lambda row: [1] * len(row.loss_mask)),
        "a turn dropped": reference(model_dir, _drop_last_turn),
    }


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp,variant", LAYOUTS)
def test_trajectories_train_their_generated_tokens_only(launched, references, tp, pp, dp, variant):
    got = launched(tp, pp, dp, variant)
    loss, gradient = references["generated"]
    assert abs(got["loss"] - loss) <= 1e-6 * max(abs(loss), 1.0), (got["loss"], loss)
    assert _max_rel(got["gradient"], gradient) <= 1e-6
    for wrong in ("observations too", "a turn dropped"):
        assert _max_rel(got["gradient"], references[wrong][1]) > 1e-2, wrong
