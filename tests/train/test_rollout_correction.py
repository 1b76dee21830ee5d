"""algo.rollout_correction through the trainer's update (issue 36 item 1), fp32 on CPU.

- With the engine's log-probs equal to the actor's (a cap that clips nothing), token-tis and seq-mis
  give the update of `none` (loss, grad norm, weights within 1e-6) at tp1, tp2, pp2, dp2, padded and
  packed rows, and the is/* metrics say nothing was corrected.
- With one sequence's engine log-probs moved by 0.5, token-tis caps exactly that sequence's tokens
  (is/clipped_frac = its tokens over the batch's) and seq-mis masks exactly it (is/masked_frac = 1/8);
  the loss moves by the amount the weights predict, in each layout, and at world 1 in every loss mode.
  (token-tis caps from above: the engine's log-probs are moved DOWN by 0.5 there, a ratio of e^0.5.)
"""

import os

import pytest
import torch

from tests._dist import SharedLaunches
from tests.train.test_update import _trainer, _var_batch, model_dir  # noqa: F401  (model_dir: fixture)

CORRECTIONS = ("none", "token-tis", "seq-mis")
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]  # tp, pp, dp
VARIANTS = {
    "fixed": ["trainer.micro_batch_size=2"],
    "packed": [
        "trainer.micro_batch_tokens=24",
        "trainer.pack_sequences=true",
        "data.max_prompt_tokens=4",
        "rollout.max_new_tokens=8",
    ],
}
SHIFTED_ROW = 3  # of _var_batch(): 4 response tokens of the batch's 29
CAP = 1.5


LOSS_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def _modes(tp, pp, dp):
    """Every loss aggregation mode at world 1 (the padded rows); token-mean in the other layouts."""
    return LOSS_MODES if tp * pp * dp == 1 else LOSS_MODES[:1]


def _body(rank, world, model_path, tp, pp, out_path):
    """Per variant, correction and engine (exact, or row SHIFTED_ROW moved by 0.5): one update's stats and
    is/* metrics, and the rollout policy's log-probs of the batch (to predict the moved loss)."""
    from remax_megatron.models.forward import broadcast_from_last_stage
    from remax_megatron.weights import export_hf_weights

    results = {}
    runs = [
        (v, o, m)
        for v, o in VARIANTS.items()
        for m in _modes(tp, pp, world // (tp * pp))
        if m == "token-mean" or v == "fixed"
    ]
    for variant, overrides, mode in runs:
        for correction in CORRECTIONS:
            for shift in (0.0,) if correction == "none" else (0.0, -0.5, 0.5):
                if correction == "token-tis" and shift > 0:
                    continue  # a ratio below 1 is not capped: token-tis truncates from above only
                trainer, actor, _, _ = _trainer(
                    world,
                    model_path,
                    tp,
                    pp,
                    [
                        *overrides,
                        "optim.lr=1e-2",
                        "optim.grad_clip=0",
                        "optim.eps=1e-3",
                        f"algo.loss_agg={mode}",
                        f"algo.rollout_correction={correction}",
                        f"algo.rollout_is_cap={CAP}",
                    ],
                )
                g, batch = trainer.groups, _var_batch()
                batch["row"] = torch.arange(8)  # which global row each local row is, wherever the plan moves it
                rows = batch["input_ids"].shape[0] // g.dp_size
                mine = {k: v[g.dp_rank * rows : (g.dp_rank + 1) * rows] for k, v in batch.items()}
                local, plan = trainer.updater.micro_batch_plan(mine)
                # The engine: the actor's own log-probs (the separate pass: fp32-equal to the training forward)
                exact = trainer.updater.logprobs(actor, local, plan)
                exact = broadcast_from_last_stage(exact, local["input_ids"].shape, torch.float32)
                engine = exact.clone()
                engine[local["row"] == SHIFTED_ROW] += shift
                local["engine_logprobs"] = engine
                update = trainer.updater.train_on(local, None, None, plan)
                metrics = trainer.metrics.correction(local, update.logprobs)
                mine = {int(r): exact[i] for i, r in enumerate(local["row"])} if g.is_last_stage else {}
                results[variant, mode, correction, shift] = {
                    "stats": update.stats,
                    "metrics": metrics,
                    "logprobs": mine,
                    "weights": {n: t.clone() for n, t in export_hf_weights(actor)},
                }
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        for key, result in results.items():  # every rank's rows' log-probs, by global row
            for other in gathered:
                result["logprobs"].update(other[key]["logprobs"])
        torch.save(results, out_path)


@pytest.fixture(scope="module")
def launched(model_dir, tmp_path_factory):  # noqa: F811
    top = str(tmp_path_factory.mktemp("correction"))
    cases: dict = {}
    for tp, pp, dp in LAYOUTS:
        name = f"correction-{tp}{pp}{dp}"
        cases.setdefault(tp * pp * dp, {})[name] = (_body, (model_dir, tp, pp, os.path.join(top, name + ".pt")))
    launches = SharedLaunches(cases, top)

    def result(tp, pp, dp):
        name = f"correction-{tp}{pp}{dp}"
        launches.check(name)
        return torch.load(os.path.join(top, name + ".pt"))

    return result


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_correction_that_corrects_nothing_leaves_the_update_unchanged(launched, tp, pp, dp):
    runs, base = launched(tp, pp, dp), launched(1, 1, 1)
    for (variant, mode, correction, shift), got in runs.items():
        if shift:
            continue
        ref = base["fixed", mode, "none", 0.0]
        where = (tp, pp, dp, variant, mode, correction)
        for key in ("loss", "grad_norm"):
            assert abs(got["stats"][key] - ref["stats"][key]) < 1e-6, (where, key, got["stats"], ref["stats"])
        worst = max((got["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
        assert worst < 1e-6, (where, worst)
        if correction == "none":
            assert got["metrics"] == {}
        else:
            frac = "is/clipped_frac" if correction == "token-tis" else "is/masked_frac"
            assert got["metrics"][frac] == 0.0, (where, got["metrics"])
            assert abs(got["metrics"]["is/ratio_mean"] - 1) < 1e-6 and abs(got["metrics"]["is/ratio_max"] - 1) < 1e-5


def _row_term(mode: str, row_pg_sum: float, row_tokens: int, total_tokens: int, rows: int) -> float:
    """The shifted row's policy-gradient term in the loss under `mode` (algo/aggregation.py, global counts)."""
    if mode == "token-mean":
        return row_pg_sum / total_tokens
    if mode == "seq-mean-token-sum":
        return row_pg_sum / rows
    return row_pg_sum / row_tokens / rows


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_one_shifted_sequence_is_capped_or_masked(launched, tp, pp, dp):
    """The loss moves by exactly the shifted row's weighted policy-gradient term: token-tis weighs its
    tokens CAP instead of 1, seq-mis removes them; the global counts (29 tokens, 8 sequences) stay the
    denominators, in every loss mode."""
    runs = launched(tp, pp, dp)
    batch = _var_batch()
    mask = batch["response_mask"][SHIFTED_ROW]
    tokens, total = int(mask.sum()), int(batch["response_mask"].sum())
    for variant, mode in {(v, m) for v, m, _, _ in runs}:
        none = runs[variant, mode, "none", 0.0]
        lp = none["logprobs"][SHIFTED_ROW][mask].double()
        # advantage = reward (zero baseline): the row's summed pg = -A * sum(logp)
        row_pg = _row_term(mode, float(-batch["rewards"][SHIFTED_ROW] * lp.sum()), tokens, total, 8)
        where = (tp, pp, dp, variant, mode)
        tis = runs[variant, mode, "token-tis", -0.5]
        assert tis["metrics"]["is/clipped_frac"] == tokens / total, (where, tis["metrics"])
        assert abs(tis["metrics"]["is/ratio_max"] - 1.6487213) < 1e-5, (where, tis["metrics"])
        assert abs(tis["stats"]["loss"] - (none["stats"]["loss"] + (CAP - 1) * row_pg)) < 1e-6, where
        for shift in (-0.5, 0.5):
            mis = runs[variant, mode, "seq-mis", shift]
            assert mis["metrics"]["is/masked_frac"] == 1 / 8, (where, shift, mis["metrics"])
            assert abs(mis["stats"]["loss"] - (none["stats"]["loss"] - row_pg)) < 1e-6, (where, shift)
            assert abs(mis["stats"]["loss"] - none["stats"]["loss"]) > 1e-4, (where, "the row must matter")
