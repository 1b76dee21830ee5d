"""The actor update on CPU: megatron DDP + schedule + fused log-probs + ReMax loss + CpuAdamW.

- the loss and gradient of one update agree across (TP=2, PP=1), (TP=1, PP=2), (TP=1, PP=1),
  TP=2 with sequence parallel (norm-weight gradients summed over TP by finalize_model_grads), with
  selective recompute, and PP=2 with full recompute
- token-mean over the global token count: 1 vs 4 micro-batches give the same gradient / weights
- a non-finite loss skips the update and leaves the weights untouched
"""

import os

import pytest
import torch

from tests._dist import SharedLaunches
from tests.train.update_helpers import dp_share, moe_update_trainer, tiny_llama, tiny_moe, update_config, update_trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory, tie=False, seed=7)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (8, 12), generator=g)
    labels = torch.roll(ids, -1, 1)
    mask = torch.zeros(8, 12)
    for i in range(8):
        mask[i, 4 : 4 + 1 + i % 7] = 1  # responses of different lengths
    labels[mask == 0] = -100
    rewards = torch.randn(8, generator=g)  # with a zero baseline the advantage is the reward
    return dict(input_ids=ids, labels=labels, response_mask=mask, rewards=rewards, baseline=torch.zeros(8))


def _trainer(world, model_dir, tp, pp, overrides, **build_kw):
    """A Trainer over a megatron DDP actor and the interface's optimizer (no engine: Updater.train_on only)."""
    from remax_megatron.parallel import ParallelLayout

    groups = ParallelLayout(tp=tp, pp=pp, world_size=world).initialize(seed=0)
    return update_trainer(groups, update_config(*overrides), model_dir, tp, pp, **build_kw)


def _update_body(rank, world, model_dir, tp, pp, micro_batch_size, poison, out_path, sp=False, recompute=None):
    from remax_megatron.weights import export_hf_weights

    trainer, actor, _, _ = _trainer(
        world,
        model_dir,
        tp,
        pp,
        [
            f"trainer.micro_batch_size={micro_batch_size}",
            "optim.lr=1e-2",
            "optim.grad_clip=0",
            "optim.eps=1e-3",
        ],  # a large eps keeps Adam's first step linear in the grads
        sequence_parallel=sp,
        recompute_granularity=recompute,
    )
    assert actor.config.sequence_parallel == sp and actor.config.recompute_granularity == recompute
    batch = _batch()
    if poison:
        batch["rewards"][3] = float("nan")
    stats = trainer.updater.train_on(batch, None, None).stats
    weights = {n: t.clone() for n, t in export_hf_weights(actor)}
    if rank == 0:
        torch.save({"stats": stats, "weights": weights, "skipped": trainer.updater.skipped_updates}, out_path)


def _max_rel(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item() for k in b)


LAYOUT_CASES = [
    (2, 1, 4, False, None),
    (1, 2, 4, False, None),
    (1, 1, 1, False, None),
    (1, 1, 8, False, None),
    (2, 1, 4, True, None),
    (2, 1, 4, True, "selective"),
    (1, 2, 4, False, "full"),
]  # tp, pp, mbs, sp, rc


def _cases(model_dir, top):
    """{world: {case: (body, args)}}: every multi-process body of this module, one launch per world size
    (process starts and imports are most of a small case's time on CPU). Bodies save to top/<case>.pt."""
    cases = {1: {}, 2: {}, 4: {}}

    def out(name):
        return os.path.join(top, name + ".pt")

    def update(tp, pp, mbs=4, poison=False, sp=False, recompute=None):
        name = f"update-tp{tp}-pp{pp}-mbs{mbs}-poison{poison}-sp{sp}-rc{recompute}"
        cases[tp * pp][name] = (_update_body, (model_dir, tp, pp, mbs, poison, out(name), sp, recompute))
        return name

    update(1, 1)
    for tp, pp, mbs, sp, rc in LAYOUT_CASES:
        update(tp, pp, mbs=mbs, sp=sp, recompute=rc)
    update(1, 2, poison=True)
    cases[2]["offload"] = (_offload_body, (model_dir, 2))
    for tp, pp, dp, mbs in DP_LAYOUTS:
        cases[tp * pp * dp][f"dp-{tp}{pp}{dp}"] = (_dp_update_body, (model_dir, tp, pp, mbs, out(f"dp-{tp}{pp}{dp}")))
    for tp, pp in [(2, 1), (1, 2)]:
        cases[2][f"saved-{tp}{pp}"] = (_saved_forward_body, (model_dir, tp, pp, out(f"saved-{tp}{pp}")))
    cases[1]["recompute"] = (_recompute_body, (model_dir, out("recompute")))
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        cases[tp * pp][f"hint-{tp}{pp}"] = (_gradient_hint_body, (model_dir, tp, pp, out(f"hint-{tp}{pp}")))
    for tp, pp, dp, sp in BUDGET_LAYOUTS:
        name = f"budget-{tp}{pp}{dp}"
        cases[tp * pp * dp][name] = (_budget_body, (model_dir, tp, pp, sp, out(name)))
    return cases


@pytest.fixture(scope="module")
def launched(model_dir, tmp_path_factory):
    """result(case): that case's saved output (None if it saves none), from the one launch of its world size."""
    top = str(tmp_path_factory.mktemp("update"))
    launches = SharedLaunches(_cases(model_dir, top), top)

    def result(name):
        launches.check(name)
        path = os.path.join(top, name + ".pt")
        return torch.load(path) if os.path.exists(path) else None

    return result


def _update(launched, tp, pp, mbs=4, poison=False, sp=False, recompute=None):
    return launched(f"update-tp{tp}-pp{pp}-mbs{mbs}-poison{poison}-sp{sp}-rc{recompute}")


@pytest.mark.slow
def test_update_matches_across_layouts_and_micro_batches(model_dir, launched):
    from safetensors.torch import load_file

    base = _update(launched, 1, 1, mbs=4)
    initial = load_file(f"{model_dir}/model.safetensors")
    assert _max_rel(base["weights"], initial) > 1e-4  # the update moved the weights
    for tp, pp, mbs, sp, rc in LAYOUT_CASES:
        other = _update(launched, tp, pp, mbs=mbs, sp=sp, recompute=rc)
        assert abs(other["stats"]["loss"] - base["stats"]["loss"]) < 1e-5, (tp, pp, mbs, sp, rc)
        assert abs(other["stats"]["grad_norm"] - base["stats"]["grad_norm"]) < 1e-4 * base["stats"]["grad_norm"]
        assert _max_rel(other["weights"], base["weights"]) < 1e-4, (tp, pp, mbs, sp, rc)


@pytest.mark.slow
def test_nonfinite_loss_skips_update(model_dir, launched):
    from safetensors.torch import load_file

    out = _update(launched, 1, 2, poison=True)
    assert out["skipped"] == 1
    initial = load_file(f"{model_dir}/model.safetensors")
    assert all(torch.equal(out["weights"][k], initial[k]) for k in initial)


def _offload_body(rank, world, model_dir, tp):
    from remax_megatron.memory import TrainStateOffload

    trainer, actor, ddp, opt = _trainer(world, model_dir, tp, 1, ["optim.lr=1e-2"])
    batch = _batch()
    trainer.updater.train_on(batch, None, None)  # Adam state exists from here on
    state = list(actor.parameters()) + opt.state_tensors()
    assert len(opt.state_tensors()) >= 2 * len(list(actor.parameters()))
    before = [t.detach().clone() for t in state]
    grad_buffers = [b.grad_data for b in ddp.buffers]
    for g in grad_buffers:
        g.fill_(1.0)  # stale grads: dropped by the offload, zeros after the reload

    offload = TrainStateOffload(ddp, opt)
    for _ in range(2):  # the second round reuses the host buffers
        offload.offload()
        assert offload.offloaded_bytes >= sum(t.numel() * t.element_size() for t in state)
        assert all(t.untyped_storage().nbytes() == 0 for t in state), "a storage was not freed"
        assert all(g.untyped_storage().nbytes() == 0 for g in grad_buffers)
        offload.reload()
        for a, b in zip(state, before):
            assert a.dtype == b.dtype and torch.equal(a, b)  # bitwise
        assert all(g.abs().sum() == 0 for g in grad_buffers)  # grads come back zeroed
        for g in grad_buffers:
            g.fill_(1.0)
        # main_grad views into the grad buffer are usable again
        assert all(p.main_grad.untyped_storage().nbytes() > 0 for p in actor.parameters())
    trainer.updater.train_on(batch, None, None)  # and training goes on


@pytest.mark.slow
def test_offload_reload_round_trip_is_bitwise(launched):
    launched("offload")  # its checks run inside the processes


LOSS_AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
DP_LAYOUTS = [(1, 1, 1, 2), (2, 1, 2, 2), (1, 2, 2, 2), (1, 1, 4, 1)]  # tp, pp, dp, micro-batch size


def _dp_update_body(rank, world, model_dir, tp, pp, micro_batch_size, out_path):
    """One update per loss aggregation mode; this DP rank trains on its contiguous share of the
    global batch (as RolloutDispatch.share gives it), the counts are global."""
    from remax_megatron.weights import export_hf_weights

    results = {}
    for mode in LOSS_AGG:
        trainer, actor, _, _ = _trainer(
            world,
            model_dir,
            tp,
            pp,
            [
                f"trainer.micro_batch_size={micro_batch_size}",
                "optim.lr=1e-2",
                "optim.grad_clip=0",
                "optim.eps=1e-3",
                f"algo.loss_agg={mode}",
            ],
        )
        local = dp_share(trainer, _batch())
        rows = local["input_ids"].shape[0]
        assert rows // micro_batch_size > 1, "the test needs more than one micro-batch per rank"
        stats = trainer.updater.train_on(local, None, None).stats
        results[mode] = {"stats": stats, "weights": {n: t.clone() for n, t in export_hf_weights(actor)}}
    if rank == 0:
        torch.save(results, out_path)


@pytest.mark.slow
def test_data_parallel_update_equals_one_replica(launched):
    """(tp2, dp2), (pp2, dp2) and dp4 each equal the DP=1 update on the same global batch, in every
    loss aggregation mode: loss, grad norm and weights within 1e-6 (fp32)."""
    runs = {(tp, pp, dp): launched(f"dp-{tp}{pp}{dp}") for tp, pp, dp, _ in DP_LAYOUTS}
    base = runs.pop((1, 1, 1))
    for layout, result in runs.items():
        for mode in LOSS_AGG:
            ref, got = base[mode], result[mode]
            assert abs(got["stats"]["loss"] - ref["stats"]["loss"]) < 1e-6, (layout, mode, got["stats"], ref["stats"])
            assert abs(got["stats"]["grad_norm"] - ref["stats"]["grad_norm"]) < 1e-6, (layout, mode)
            worst = max((got["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
            assert worst < 1e-6, (layout, mode, worst)


def _saved_forward_body(rank, world, model_dir, tp, pp, out_path):
    """The same update twice: with the rollout policy's log-probs from a separate forward pass (the
    pass an on-policy step no longer runs) and from the training forward itself; KL in the reward, so
    the advantages depend on those log-probs."""
    from remax_megatron.weights import export_hf_weights

    results = {}
    for separate in (True, False):
        trainer, actor, _, _ = _trainer(
            world,
            model_dir,
            tp,
            pp,
            [
                "trainer.micro_batch_size=4",
                "optim.lr=1e-2",
                "optim.grad_clip=0",
                "optim.eps=1e-3",
                "algo.kl_mode=reward",
            ],
        )
        trainer.parts.kl.coef = 0.3
        batch = _batch()
        ref = -3.0 * torch.rand(8, 12, generator=torch.Generator().manual_seed(1))  # [B, S] reference log-probs
        old = trainer.updater.logprobs(actor, batch, trainer.updater.micro_batch_plan(batch)[1]) if separate else None
        update = trainer.updater.train_on(batch, old, ref)
        results[separate] = {
            "stats": update.stats,
            "logprobs": update.logprobs,
            "advantages": update.advantages,
            "weights": {n: t.clone() for n, t in export_hf_weights(actor)},
        }
    if trainer.groups.is_last_stage and trainer.groups.tp_rank == 0:
        torch.save(results, out_path)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_on_policy_update_without_the_separate_logprob_pass_is_unchanged(launched, tp, pp):
    """Issue 14: skipping the old-log-prob forward (on-policy) leaves the update as it was: advantages,
    loss, grad norm and weights within 1e-6 of the update that used a separate forward pass."""
    runs = launched(f"saved-{tp}{pp}")
    before, after = runs[True], runs[False]
    mask = _batch()["response_mask"].bool()
    kl_part = (after["advantages"] - _batch()["rewards"][:, None])[mask]
    assert kl_part.abs().max() > 0.05, "the KL term must move the advantages for this test to mean anything"
    assert (after["logprobs"] - before["logprobs"])[mask].abs().max() < 1e-6
    assert (after["advantages"] - before["advantages"]).abs().max() < 1e-6
    assert abs(after["stats"]["loss"] - before["stats"]["loss"]) < 1e-6
    assert abs(after["stats"]["grad_norm"] - before["stats"]["grad_norm"]) < 1e-6
    worst = max((after["weights"][k] - before["weights"][k]).abs().max().item() for k in before["weights"])
    assert worst < 1e-6, worst


def _gradient_hint_body(rank, world, model_dir, tp, pp, out_path):
    """The same on-policy update twice: with the loss's gradient handed to the fused log-prob kernel
    (the trainer's default without KL) and without it (logprob_gradient patched to give none);
    counts the backward recomputations of the logit tiles in each."""
    import remax_megatron.update as update_module
    from remax_megatron.kernels.logprobs_torch import TorchBackend
    from remax_megatron.weights import export_hf_weights

    recomputes, recompute, hint = [], TorchBackend.backward_grads, update_module.logprob_gradient
    TorchBackend.backward_grads = lambda self, *a, **k: recomputes.append(1) or recompute(self, *a, **k)
    results = {}
    try:  # the launch runs other cases in this process afterwards: patches are undone
        for hinted in (True, False):
            update_module.logprob_gradient = hint if hinted else (lambda *a, **k: None)
            trainer, actor, _, _ = _trainer(
                world,
                model_dir,
                tp,
                pp,
                [
                    "trainer.micro_batch_size=2",
                    "optim.lr=1e-2",
                    "optim.grad_clip=1.0",
                    "optim.eps=1e-3",
                    "algo.loss_agg=seq-mean-token-mean",
                    "algo.advantage_clip=0.8",
                ],
            )
            recomputes.clear()
            update = trainer.updater.train_on(_batch(), None, None)
            results[hinted] = {
                "stats": update.stats,
                "recomputes": len(recomputes),
                "weights": {n: t.clone() for n, t in export_hf_weights(actor)},
            }
    finally:
        TorchBackend.backward_grads, update_module.logprob_gradient = recompute, hint
    if trainer.groups.is_last_stage and trainer.groups.tp_rank == 0:
        torch.save(results, out_path)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_gradient_taken_in_the_log_prob_forward_leaves_the_update_unchanged(launched, tp, pp):
    """Issue 14: on-policy without KL the fused kernel takes the loss's gradient in its forward pass
    (no logit tile recomputed in the backward; 4 micro-batches recompute 4 times without it), and the
    update is the one without it: loss, grad norm (clipped at 1.0) and weights within 1e-6."""
    runs = launched(f"hint-{tp}{pp}")
    after, before = runs[True], runs[False]
    assert after["recomputes"] == 0 and before["recomputes"] == 4
    assert abs(after["stats"]["loss"] - before["stats"]["loss"]) < 1e-6
    assert before["stats"]["grad_norm"] > 1.0, "the clip must act for the test to cover it"
    assert abs(after["stats"]["grad_norm"] - before["stats"]["grad_norm"]) < 1e-6 * before["stats"]["grad_norm"]
    worst = max((after["weights"][k] - before["weights"][k]).abs().max().item() for k in before["weights"])
    assert worst < 1e-6, worst


def _recompute_body(rank, world, model_dir, out_path):
    """Forward calls of the transformer layers and of their core attention in one update of 2
    micro-batches, per recompute mode (module forward hooks also fire when the backward re-runs them)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    counts = {}
    for recompute in (None, "full", "selective"):
        trainer, actor, _, _ = _trainer(
            world, model_dir, 1, 1, ["trainer.micro_batch_size=4"], recompute_granularity=recompute
        )
        calls = {"layer": 0, "core_attention": 0}

        def count(calls, key):
            def hook(module, args, output):
                calls[key] += 1

            return hook

        for module in actor.modules():
            if isinstance(module, TransformerLayer):
                module.register_forward_hook(count(calls, "layer"))
                module.self_attention.core_attention.register_forward_hook(count(calls, "core_attention"))
        trainer.updater.train_on(_batch(), None, None)
        counts[str(recompute)] = dict(calls)
    torch.save(counts, out_path)


@pytest.mark.slow
def test_recompute_really_recomputes(launched):
    """Recompute is proven by the forward calls, not by the config flag: full recompute runs every
    layer again in the backward, selective only the core attention."""
    counts = launched("recompute")
    layers, micro_batches = 2, 2
    once = layers * micro_batches
    assert counts["None"] == {"layer": once, "core_attention": once}, counts
    assert counts["full"] == {"layer": 2 * once, "core_attention": 2 * once}, counts
    assert counts["selective"] == {"layer": once, "core_attention": 2 * once}, counts


# ---- mixture of experts ----------------------------------------------------------------------------------

MOE_LAYOUTS = [(1, 1, 2, 2), (2, 1, 2, 2), (2, 1, 2, 4), (1, 2, 2, 4)]  # tp, pp, ep, world (DP = the rest)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tiny_moe(tmp_path_factory, "moe", "qwen3_moe", seed=3)


def _moe_batch():
    batch = _batch()
    batch["lengths"] = torch.tensor([5 + i % 7 + i % 3 for i in range(8)])  # prompt + response tokens per row
    return batch


def _moe_update_body(rank, world, model_dir, tp, pp, ep, kind, micro_batch_size, out_path, overrides=(), batch_fn=None):
    """One update of a tiny Qwen3-MoE (load-balancing coefficient 0.5, so it moves the update) on this DP
    rank's share of the global batch; whole experts split over EP, sequence parallel at TP=2."""
    from remax_megatron.weights import export_hf_weights

    trainer, actor, _, _ = moe_update_trainer(
        world,
        model_dir,
        tp,
        pp,
        ep,
        [
            f"trainer.micro_batch_size={micro_batch_size}",
            "optim.lr=1e-2",
            "optim.grad_clip=0",
            "optim.eps=1e-3",
            f"algo.moe_aux_loss={kind}",
            "algo.moe_aux_loss_coef=0.5",
            *overrides,
        ],
    )
    stats = trainer.updater.train_on(dp_share(trainer, (batch_fn or _moe_batch)()), None, None).stats
    weights = {n: t.clone() for n, t in export_hf_weights(actor)}
    if rank == 0:
        torch.save({"stats": stats, "weights": weights}, out_path)


def _aux_vs_megatron_body(rank, world, model_dir, out_path):
    """One training forward + backward at world 1 with megatron's own load-balancing loss switched on beside
    the trainer's hooks: both values per layer, over the same valid tokens."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.moe import LoadBalancing, padding_mask, routers
    from remax_megatron.parallel import ParallelLayout

    groups = ParallelLayout(tp=1, pp=1, world_size=world).initialize(seed=0)
    actor = build_policy(read_hf_config(model_dir), tp=1, pp=1)
    for router in routers(actor):
        router.routing_type = "aux_loss"  # megatron's own aux loss, coefficient 1
    actor.config.moe_aux_loss_coeff = 1.0
    balance = LoadBalancing(actor, "aux", 1.0, groups.tp, groups.dp, groups.pp)
    batch = _moe_batch()
    balance.begin_update(float(batch["lengths"].sum()), 8.0)
    clear_aux_losses_tracker()
    hidden = actor(
        batch["input_ids"],
        torch.arange(12).expand(8, 12),
        attention_mask=None,
        padding_mask=padding_mask(actor, batch["input_ids"], batch["lengths"]),
    )
    hidden.sum().backward()
    ours = balance._aux.clone()
    theirs = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].clone()
    torch.save({"ours": ours, "megatron": theirs, "metrics": balance.end_update()}, out_path)


def _moe_launches(moe_dir, top):
    cases = {1: {}, 2: {}, 4: {}}
    for kind in ("aux", "seq_aux"):
        for mbs in (2, 4):
            cases[1][f"moe-{kind}-111-w1-mbs{mbs}"] = (
                _moe_update_body,
                (moe_dir, 1, 1, 1, kind, mbs, os.path.join(top, f"moe-{kind}-111-w1-mbs{mbs}.pt")),
            )
        for tp, pp, ep, world in MOE_LAYOUTS:
            name = f"moe-{kind}-{tp}{pp}{ep}-w{world}-mbs2"
            cases[world][name] = (_moe_update_body, (moe_dir, tp, pp, ep, kind, 2, os.path.join(top, name + ".pt")))
    cases[1]["aux-vs-megatron"] = (_aux_vs_megatron_body, (moe_dir, os.path.join(top, "aux-vs-megatron.pt")))
    for tp, pp, ep, world in MOE_PACKED_LAYOUTS:
        for variant, overrides in (("fixed", ()), ("packed", BUDGET_VARIANTS["packed"]))[world > 1 :]:
            name = f"moe-seq_aux-{tp}{pp}{ep}-w{world}-{variant}"
            cases[world][name] = (
                _moe_update_body,
                (moe_dir, tp, pp, ep, "seq_aux", 2, os.path.join(top, name + ".pt"), overrides, _var_batch),
            )
    return cases


@pytest.fixture(scope="module")
def moe_launched(moe_dir, tmp_path_factory):
    top = str(tmp_path_factory.mktemp("moe-update"))
    launches = SharedLaunches(_moe_launches(moe_dir, top), top)

    def result(name):
        launches.check(name)
        return torch.load(os.path.join(top, name + ".pt"))

    return result


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["aux", "seq_aux"])
def test_moe_update_equals_one_rank(moe_launched, kind):
    """(ep2, dp2), (tp2, ep2) on 2 and on 4 processes and (pp2, ep2, dp2) each equal the world-1 update on the
    same global batch in 4 micro-batches: loss including the load-balancing loss, that loss itself, grad
    norm and weights within 1e-6 (fp32)."""
    base = moe_launched(f"moe-{kind}-111-w1-mbs2")
    assert base["stats"]["moe/aux_loss"] > 0.9 and base["stats"]["moe/expert_load"] >= 1.0
    assert base["stats"]["loss"] - base["stats"]["pg_loss"] > 0.5, "the load-balancing loss must count here"
    for tp, pp, ep, world in MOE_LAYOUTS:
        got = moe_launched(f"moe-{kind}-{tp}{pp}{ep}-w{world}-mbs2")
        for key in ("loss", "moe/aux_loss", "grad_norm"):
            assert abs(got["stats"][key] - base["stats"][key]) < 1e-6, (
                tp,
                pp,
                ep,
                world,
                key,
                got["stats"],
                base["stats"],
            )
        assert got["stats"]["moe/expert_load"] == pytest.approx(base["stats"]["moe/expert_load"], abs=1e-9)
        worst = max((got["weights"][k] - base["weights"][k]).abs().max().item() for k in base["weights"])
        assert worst < 1e-6, (tp, pp, ep, world, worst)


@pytest.mark.slow
def test_moe_load_balancing_is_normalised_over_the_update(moe_launched):
    """seq_aux (per sequence over the update's sequences) does not depend on how the rows are grouped into
    micro-batches: 4 micro-batches of 2 == 2 of 4. The batch-level aux does (f and P are micro-batch
    statistics), which shows the grouping is not ignored by the comparison."""
    seq2, seq4 = moe_launched("moe-seq_aux-111-w1-mbs2"), moe_launched("moe-seq_aux-111-w1-mbs4")
    assert abs(seq2["stats"]["moe/aux_loss"] - seq4["stats"]["moe/aux_loss"]) < 1e-7
    assert abs(seq2["stats"]["loss"] - seq4["stats"]["loss"]) < 1e-6
    worst = max((seq2["weights"][k] - seq4["weights"][k]).abs().max().item() for k in seq2["weights"])
    assert worst < 1e-6, worst
    aux2, aux4 = moe_launched("moe-aux-111-w1-mbs2"), moe_launched("moe-aux-111-w1-mbs4")
    assert abs(aux2["stats"]["moe/aux_loss"] - aux4["stats"]["moe/aux_loss"]) > 1e-4


@pytest.mark.slow
def test_load_balancing_loss_is_megatrons_formula(moe_launched):
    """The trainer's per-layer load-balancing loss over one micro-batch equals megatron-core's own
    (switch_load_balancing_loss_func, padding excluded), computed in the same forward."""
    out = moe_launched("aux-vs-megatron")
    assert out["ours"].shape == out["megatron"].shape == (2,)
    assert torch.allclose(out["ours"].float(), out["megatron"].float(), rtol=1e-5, atol=1e-6), out
    assert out["metrics"]["moe/aux_loss"] == pytest.approx(out["ours"].mean().item(), rel=1e-6)


# ---- token-budget micro-batches and packed rows (issue 29) --------------------------------------------------

BUDGET_LAYOUTS = [(1, 1, 1, False), (2, 1, 1, True), (1, 2, 1, False), (1, 1, 2, False)]  # tp, pp, dp, sp
# fixed: 2 rows per micro-batch, all 12 wide; budget: <= 24 tokens per micro-batch, each as wide as its longest
# row; packed: rows of 12 holding several sequences, 2 rows per micro-batch. The longest sequence (4 prompt +
# 8 response tokens) fits the budget's check.
BUDGET_VARIANTS = {
    "fixed": ["trainer.micro_batch_size=2"],
    "budget": ["trainer.micro_batch_tokens=24", "data.max_prompt_tokens=4", "rollout.max_new_tokens=8"],
    "packed": [
        "trainer.micro_batch_tokens=24",
        "trainer.pack_sequences=true",
        "data.max_prompt_tokens=4",
        "rollout.max_new_tokens=8",
    ],
}


def _var_batch():
    """_batch() as the trainer packs it: rows of 6..12 tokens (4 prompt tokens, responses of 1..7 labelled
    tokens), right-padded with 0, with their lengths."""
    batch = _batch()
    batch["lengths"] = torch.tensor([6 + i % 7 for i in range(8)])
    batch["input_ids"][torch.arange(12)[None, :] >= batch["lengths"][:, None]] = 0
    batch["response_mask"] = batch["response_mask"].bool()
    return batch


def _budget_body(rank, world, model_dir, tp, pp, sp, out_path):
    """One update per loss mode and micro-batching variant on this DP rank's contiguous share of _var_batch()
    (as RolloutDispatch.share gives it); with a budget, the trainer balances the rows over DP by tokens. The
    separate log-prob pass (what old / reference log-probs use) over the same micro-batches gives the
    training forward's log-probs (checked here, on the last stage)."""
    from remax_megatron.weights import export_hf_weights

    results = {}
    # The padded update at other layouts equals world 1's (test_update_matches_across_layouts_and_micro_batches,
    # test_data_parallel_update_equals_one_replica): only world 1 runs it here.
    variants = BUDGET_VARIANTS if world == 1 else {k: v for k, v in BUDGET_VARIANTS.items() if k != "fixed"}
    for mode in LOSS_AGG:
        for variant, overrides in variants.items():
            trainer, actor, _, _ = _trainer(
                world,
                model_dir,
                tp,
                pp,
                [*overrides, "optim.lr=1e-2", "optim.grad_clip=0", "optim.eps=1e-3", f"algo.loss_agg={mode}"],
                sequence_parallel=sp,
            )
            local, plan = trainer.updater.micro_batch_plan(dp_share(trainer, _var_batch()))
            # the separate log-prob pass (old / reference log-probs) runs the same micro-batches
            separate = trainer.updater.logprobs(actor, local, plan)
            update = trainer.updater.train_on(local, None, None, plan)
            if trainer.groups.is_last_stage:
                gap = (separate - update.logprobs)[local["response_mask"]].abs().max().item()
                assert gap < 1e-6, (mode, variant, gap)
            results[mode, variant] = {
                "stats": update.stats,
                "computed": update.computed_tokens,
                "weights": {n: t.clone() for n, t in export_hf_weights(actor)},
            }
    if rank == 0:
        torch.save(results, out_path)


@pytest.mark.slow
def test_token_budget_and_packed_updates_equal_the_padded_update(launched):
    """Issue 29: with token-budget micro-batches (each as wide as its longest row) and with packed rows
    (several sequences per row, attention kept inside each), one update equals the padded fixed-count update
    of the same batch at world 1, at tp1, tp2 with sequence parallel, pp2 (micro-batches of several shapes)
    and dp2 (rows balanced over DP by tokens), in every loss mode: loss, grad norm and weights within 1e-6
    (fp32). The forward computes fewer tokens than the padded one."""
    base = launched("budget-111")
    for tp, pp, dp, _sp in BUDGET_LAYOUTS:
        runs = launched(f"budget-{tp}{pp}{dp}")
        for mode in LOSS_AGG:
            ref = base[mode, "fixed"]
            for variant in BUDGET_VARIANTS if (tp, pp, dp) == (1, 1, 1) else ("budget", "packed"):
                got = runs[mode, variant]
                where = (tp, pp, dp, mode, variant)
                assert abs(got["stats"]["loss"] - ref["stats"]["loss"]) < 1e-6, (where, got["stats"], ref["stats"])
                assert abs(got["stats"]["grad_norm"] - ref["stats"]["grad_norm"]) < 1e-6, where
                worst = max((got["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
                assert worst < 1e-6, (where, worst)
            for variant in ("budget", "packed"):  # fewer tokens computed than the padded update's 8 x 12
                assert runs[mode, variant]["computed"] < base[mode, "fixed"]["computed"] == 8 * 12, (variant, runs)


MOE_PACKED_LAYOUTS = [(1, 1, 1, 1), (2, 1, 2, 2), (1, 2, 2, 4)]  # tp, pp, ep, world


@pytest.mark.slow
def test_moe_packed_update_equals_the_padded_one(moe_launched):
    """Issue 29: packed rows (several sequences per row, rows balanced over DP) leave a MoE update with the
    per-sequence load-balancing loss (seq_aux, coefficient 0.5) unchanged: loss, that loss, grad norm and
    weights within 1e-6 of the padded fixed-count update at world 1, at world 1, (tp2 + SP, ep2) and
    (pp2, ep2, dp2)."""
    base = moe_launched("moe-seq_aux-111-w1-fixed")
    assert base["stats"]["loss"] - base["stats"]["pg_loss"] > 0.5, "the load-balancing loss must count here"
    for tp, pp, ep, world in MOE_PACKED_LAYOUTS:
        got = moe_launched(f"moe-seq_aux-{tp}{pp}{ep}-w{world}-packed")
        for key in ("loss", "moe/aux_loss", "grad_norm"):
            assert abs(got["stats"][key] - base["stats"][key]) < 1e-6, (tp, pp, ep, world, key)
        worst = max((got["weights"][k] - base["weights"][k]).abs().max().item() for k in base["weights"])
        assert worst < 1e-6, (tp, pp, ep, world, worst)
