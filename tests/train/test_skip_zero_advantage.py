"""trainer.skip_zero_advantage (algo/zero_advantage.py): rows whose reward ties their prompt's greedy reward
are left out of the update's forward and backward, and the update is unchanged.

- on vs off, the same batch with half its rows tied: loss, grad norm and the updated weights equal (1e-6
  relative) at tp1 (fixed micro-batches, two mini-batches, token budget, packed), tp2, pp2, dp2 (fixed and
  token budget); the skipped rows are exactly the tied ones and the forward computes fewer tokens
- a DP rank whose rows all tie (dp2, and pp2 x dp2) runs its first row only (or ghosts), joins every
  collective and still gives the full update
- a row with a nonzero advantage skipped on purpose changes the weights (the comparison catches it)
- auto: off with KL (in the reward or the loss), a MoE load-balancing loss or LoRA dropout, and says why;
  on is refused there in one line
"""

import os

import pytest
import torch

from tests._dist import SharedLaunches
from tests.train.test_update import BUDGET_VARIANTS, _trainer, _var_batch
from tests.train.update_helpers import dp_share, tiny_llama, update_config

TIED = [1, 3, 4, 6]  # rows whose reward equals the baseline (rank 0 of dp2 holds rows 0-3)
ALL_OF_RANK0 = [0, 1, 2, 3]  # every row of DP rank 0 ties

VARIANTS = {  # name: overrides
    "fixed": BUDGET_VARIANTS["fixed"],
    "minibatches": ["trainer.micro_batch_size=2", "trainer.mini_batches=2"],
    "budget": BUDGET_VARIANTS["budget"],
    "packed": BUDGET_VARIANTS["packed"],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory, tie=False, seed=7)


def _tied_batch(tied):
    batch = _var_batch()
    batch["baseline"] = torch.zeros(8)
    batch["baseline"][tied] = batch["rewards"][tied]  # advantage exactly 0 on these rows
    return batch


def _skip_body(rank, world, model_dir, tp, pp, variants, tied, out_path, sabotage=False):
    """One update per (variant, skip off/on) on this DP rank's contiguous share of the batch."""
    from remax_megatron import update as update_module
    from remax_megatron.weights import export_hf_weights

    if sabotage:  # a row with a nonzero advantage (row 0) is skipped too
        honest = update_module.rows_without_signal
        update_module.rows_without_signal = lambda r, b, m: honest(r, b, m) | (torch.arange(len(r)) == 0)
    results = {}
    for variant in variants:
        for skip in ("off", "on"):
            trainer, actor, _, _ = _trainer(
                world,
                model_dir,
                tp,
                pp,
                [
                    *VARIANTS[variant],
                    f"trainer.skip_zero_advantage={skip}",
                    "optim.lr=1e-2",
                    "optim.grad_clip=0",
                    "optim.eps=1e-3",
                ],
            )
            local, plan = trainer.updater.micro_batch_plan(dp_share(trainer, _tied_batch(tied)))
            update = trainer.updater.train_on(local, None, None, plan)
            results[variant, skip] = {
                "stats": update.stats,
                "computed": update.computed_tokens,
                "skipped_rows": update.skipped_rows,
                "weights": {n: t.clone() for n, t in export_hf_weights(actor)},
            }
    if rank == 0:
        torch.save(results, out_path)


LAYOUTS = {  # name: (tp, pp, dp, variants, tied rows)
    "w1": (1, 1, 1, list(VARIANTS), TIED),
    "tp2": (2, 1, 1, ["fixed", "budget"], TIED),
    "pp2": (1, 2, 1, ["fixed", "packed"], TIED),
    "dp2": (1, 1, 2, ["fixed", "budget"], TIED),
    "dp2-rank0-all-tied": (1, 1, 2, ["fixed", "budget"], ALL_OF_RANK0),
    "pp2dp2-rank0-all-tied": (1, 2, 2, ["fixed", "budget"], ALL_OF_RANK0),
}


@pytest.fixture(scope="module")
def launched(model_dir, tmp_path_factory):
    top = str(tmp_path_factory.mktemp("skip"))
    cases = {1: {}, 2: {}, 4: {}}
    for name, (tp, pp, dp, variants, tied) in LAYOUTS.items():
        cases[tp * pp * dp][name] = (_skip_body, (model_dir, tp, pp, variants, tied, os.path.join(top, name + ".pt")))
    cases[1]["sabotage"] = (
        _skip_body,
        (model_dir, 1, 1, ["fixed", "budget", "minibatches"], TIED, os.path.join(top, "sabotage.pt"), True),
    )
    launches = SharedLaunches(cases, top)

    def result(name):
        launches.check(name)
        return torch.load(os.path.join(top, name + ".pt"))

    return result


def _worst_difference(off, on) -> float:
    """The largest relative difference between two updates: of the loss, of the grad norm, and of the weights
    (the largest weight difference over the largest weight)."""
    diffs = [abs(on["stats"][k] - off["stats"][k]) / max(abs(off["stats"][k]), 1e-12) for k in ("loss", "grad_norm")]
    largest = max(ref.abs().max().item() for ref in off["weights"].values())
    diffs.append(max((on["weights"][n] - ref).abs().max().item() for n, ref in off["weights"].items()) / largest)
    return max(diffs)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_skipping_tied_rows_leaves_the_update_unchanged(launched, layout):
    tp, pp, dp, variants, tied = LAYOUTS[layout]
    runs = launched(layout)
    for variant in variants:
        off, on = runs[variant, "off"], runs[variant, "on"]
        assert _worst_difference(off, on) < 1e-6, (layout, variant, off["stats"], on["stats"])
        # a DP rank whose rows all tie runs its first one anyway (its metrics need a forward)
        expected = len(tied) - (tied == ALL_OF_RANK0)
        assert off["skipped_rows"] == 0 and on["skipped_rows"] == expected, (layout, variant, on["skipped_rows"])
        assert on["computed"] < off["computed"], (layout, variant, on["computed"], off["computed"])


@pytest.mark.slow
def test_a_row_with_signal_skipped_on_purpose_changes_the_update(launched):
    runs = launched("sabotage")
    for variant in ("fixed", "budget", "minibatches"):
        assert runs[variant, "on"]["skipped_rows"] == len(TIED) + 1
        assert _worst_difference(runs[variant, "off"], runs[variant, "on"]) > 1e-4, variant
    assert runs["fixed", "on"]["computed"] < runs["fixed", "off"]["computed"]


@pytest.mark.parametrize(
    "overrides,is_moe,why",
    [
        (["algo.kl_coef=0.05", "reference.enabled=true"], False, "KL penalty in the reward"),
        (["algo.kl_coef=0.05", "reference.enabled=true", "algo.kl_mode=loss"], False, "KL term in the loss"),
        ([], True, "load-balancing loss"),
        (["actor.lora_rank=4", "actor.lora_dropout=0.1"], False, "lora_dropout"),
    ],
)
def test_auto_is_off_where_tied_rows_have_a_gradient_and_on_is_refused(overrides, is_moe, why):
    from remax_megatron.algo.zero_advantage import skip_start_line, skips_zero_advantage

    assert not skips_zero_advantage(update_config(*overrides), is_moe)
    line = skip_start_line(update_config(*overrides), is_moe)
    assert line.startswith("trainer.skip_zero_advantage=auto: off") and why in line, line
    with pytest.raises(ValueError, match="skip_zero_advantage=on would change the update") as e:
        skips_zero_advantage(update_config(*overrides, "trainer.skip_zero_advantage=on"), is_moe)
    assert "\n" not in str(e.value) and why in str(e.value)


def test_auto_is_on_without_kl_and_off_is_off():
    from remax_megatron.algo.zero_advantage import skip_start_line, skips_zero_advantage

    assert skips_zero_advantage(update_config(), is_moe=False) and skip_start_line(update_config(), False) is None
    assert skips_zero_advantage(update_config("algo.moe_aux_loss=none"), is_moe=True)
    assert not skips_zero_advantage(update_config("trainer.skip_zero_advantage=off"), is_moe=False)


def test_rows_without_signal_are_exact_ties_and_empty_responses():
    from remax_megatron.algo.zero_advantage import rows_without_signal

    rewards = torch.tensor([1.0, 0.5, 0.0, 1.0])
    baseline = torch.tensor([1.0, 0.5 + 1e-7, 1.0, 0.0])
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[3] = False  # a truncated sample masked out of the loss (trainer.mask_truncated)
    assert rows_without_signal(rewards, baseline, mask).tolist() == [True, False, False, True]
