"""step_metrics.py: the step record's DP reductions against an fp64 computation over the global batch (2 gloo
ranks, data parallel 2, each holding its half), and the pieces beside them (optimizer state size, the weight swap
of the behaviour check)."""

from types import SimpleNamespace

import torch

from remax_megatron.rollout import Completion, PromptRollout
from remax_megatron.step_metrics import optimizer_state_mib, swap_data
from tests._dist import run_distributed

N = 2  # rollout.n


def _global_step():
    """Both ranks' inputs, [rank] -> (batch, rollouts, r_sampled, r_greedy, logprobs, advantages, ref)."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for rank in range(2):
        prompts = 2 + rank  # rank 1 holds more rows: a mean over ranks must weigh rows, not ranks
        rows, width = prompts * N, 7
        mask = torch.rand(rows, width, generator=gen) > 0.4
        batch = {"response_mask": mask, "engine_logprobs": -torch.rand(rows, width, generator=gen) * mask}
        rollouts = [
            PromptRollout(
                sampled=[
                    Completion([p, s] * (1 + s), [-1.0] * 2 * (1 + s), "length" if s else "stop") for s in range(N)
                ],
                greedy=Completion([p, 0], [-1.0, -1.0], "stop"),
            )
            for p in range(prompts)
        ]
        r_sampled = torch.randint(0, 3, (rows,), generator=gen).double().tolist()
        r_greedy = torch.randint(0, 3, (prompts,), generator=gen).double().tolist()
        # trainer.skip_zero_advantage: skipped rows have advantage 0 and no log-probs (0 where the forward
        # did not run), so kl/mean and the engine gap must be taken over the other rows
        batch["skipped"] = torch.rand(rows, generator=gen) > 0.6
        ran = mask & ~batch["skipped"][:, None]
        logprobs = -torch.rand(rows, width, generator=gen) * ran
        advantages = torch.randn(rows, width, generator=gen) * ran
        ref = -torch.rand(rows, width, generator=gen) * mask
        out.append((batch, rollouts, r_sampled, r_greedy, logprobs, advantages, ref))
    return out


def _record_body(rank, world):
    from remax_megatron.config import load_config
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.step_metrics import DpReduce, StepMetrics

    groups = ParallelLayout(tp=1, pp=1, world_size=world).initialize(seed=0)
    cfg = load_config(None, ["reward.functions=[exact_match]", f"rollout.n={N}", "rollout.logprob_warn_threshold=100"])
    parts = SimpleNamespace(actor=SimpleNamespace(module=None))
    everything = _global_step()
    batch, rollouts, r_sampled, r_greedy, logprobs, advantages, ref = everything[rank]
    update = SimpleNamespace(
        stats={"loss": 1.0, "pg_loss": 2.0, "entropy": 3.0, "clip_frac": 0.0, "grad_norm": 4.0},
        logprobs=logprobs,
        advantages=advantages,
        skipped_rows=float(sum(int(e[0]["skipped"].sum()) for e in everything)),
    )
    record = StepMetrics(cfg, parts, DpReduce(groups)).record(5, batch, rollouts, r_sampled, r_greedy, update, ref, {})

    # the same statistics over the global batch, in fp64, without any reduction
    mask = torch.cat([e[0]["response_mask"] for e in everything])
    skipped = torch.cat([e[0]["skipped"] for e in everything])
    all_adv = torch.cat([e[5] for e in everything])
    adv = all_adv[mask].double()
    zero_rows = ((all_adv != 0) & mask).sum(1).eq(0)
    assert zero_rows.any() and zero_rows.sum() < len(zero_rows)
    mask_all, mask = mask, mask & ~skipped[:, None]  # kl, gap: over the rows the forward ran
    kl = (torch.cat([e[4] for e in everything]) - torch.cat([e[6] for e in everything]))[mask].double()
    gap = (torch.cat([e[4] for e in everything]) - torch.cat([e[0]["engine_logprobs"] for e in everything])).abs()
    sampled = [r for e in everything for r in e[2]]
    greedy = [r for e in everything for r in e[3]]
    ties = [float(r == e[3][i // N]) for e in everything for i, r in enumerate(e[2])]
    lengths = [len(c.token_ids) for e in everything for r in e[1] for c in r.sampled]
    want = {
        "step": 5,
        "advantage/mean": adv.mean().item(),
        "advantage/std": adv.std(unbiased=False).item(),
        "kl/mean": kl.mean().item(),
        "reward/sampled_mean": sum(sampled) / len(sampled),
        "reward/greedy_mean": sum(greedy) / len(greedy),
        "reward/tie_frac": sum(ties) / len(ties),
        "response/length_mean": sum(lengths) / len(lengths),
        "reward/min": min(sampled + greedy),
        "reward/max": max(sampled + greedy),
        "logprob/engine_vs_actor_max_diff": gap[mask].max().item(),
        "logprob/engine_vs_actor_mean_diff": gap[mask].double().mean().item(),
        "loss": 1.0,
        "grad_norm": 4.0,
        "batch/zero_advantage_frac": zero_rows.double().mean().item(),
        "batch/skipped_rows": float(skipped.sum()),
        "batch/computed_rows": float((~skipped).sum()),
    }
    assert mask_all.sum() > mask.sum()
    for key, value in want.items():
        assert abs(record[key] - value) < 1e-6, (key, record[key], value)


def test_the_record_reduces_over_data_parallel_like_the_global_batch():
    run_distributed(_record_body, world_size=2)


def test_optimizer_state_counts_each_storage_once():
    moment = torch.zeros(256, dtype=torch.float32)  # 1 KiB
    optimizer = SimpleNamespace(state_tensors=lambda: [moment, moment, moment[:10], torch.zeros(512)])
    assert optimizer_state_mib(optimizer) * 2**20 == 1024 + 2048


def test_swap_data_exchanges_and_a_second_swap_restores():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(2))]
    held = [torch.full((3,), 7.0), torch.full((2,), 9.0)]
    swap_data(params, held)
    assert params[0].tolist() == [7.0] * 3 and held[0].tolist() == [1.0] * 3
    swap_data(params, held)
    assert params[1].tolist() == [0.0] * 2 and held[1].tolist() == [9.0] * 2
