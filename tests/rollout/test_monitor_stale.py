"""The floor-judged monitor on a real engine and actor (tp1, one process): an engine synced every step is quiet
in fp32 and bf16; when the sync is skipped after updates at a high learning rate, the first skipped step (its
fp32 gap >= 1e-2) warns in both dtypes, naming the floor."""

import warnings

import pytest
import torch

from tests._dist import run_distributed

SYNCED, SKIPPED = 3, 2  # steps synced, then steps whose sync is skipped
LR = 3e-2  # an update moves every weight by LR x the tensor's mean |w| (random direction): a high rate


def _body(rank, world, model_dir, out):
    from remax_megatron.batching import pad_sequences
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.forward import forward_only
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.rollout import SamplingParams, WeightSync, flatten_rollouts
    from remax_megatron.rollout.monitor import LogprobMismatchWarning, MismatchFloor, logprob_mismatch
    from remax_megatron.rollout.native import NativeEngine
    from remax_megatron.weights import load_hf_weights

    groups = ParallelLayout(tp=1, pp=1, world_size=world).initialize(seed=0)
    arch = read_hf_config(model_dir)
    prompts = torch.randint(4, arch.vocab_size, (16, 6), generator=torch.Generator().manual_seed(0)).tolist()
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        actor = build_policy(arch, tp=1, pp=1, params_dtype=dtype, trainable=False)
        load_hf_weights(actor, model_dir)
        engine = NativeEngine(hf_dir=model_dir, dtype=dtype, device="cpu")
        sync, rule, g = WeightSync(engine, actor, bucket_mb=1, groups=groups), MismatchFloor(), torch.Generator()
        g.manual_seed(1)
        steps = []
        for step in range(SYNCED + SKIPPED):
            if step < SYNCED:
                sync()
            rollouts = engine.generate(
                prompts, n=3, sampling=SamplingParams(max_new_tokens=8), seeds=list(range(len(prompts)))
            )
            rows_p, rows_c = flatten_rollouts(prompts, rollouts, include_greedy=True)
            batch = pad_sequences(rows_p, rows_c, pad_id=0)
            (actor_lp,) = forward_only(
                actor,
                [{"input_ids": batch["input_ids"], "labels": batch["labels"]}],
                lambda m, hidden, b: m.token_logprobs(hidden, b["labels"])[0],
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                stats = logprob_mismatch(actor_lp, batch["engine_logprobs"], batch["response_mask"], threshold=rule)
            texts = [str(w.message) for w in caught if issubclass(w.category, LogprobMismatchWarning)]
            steps.append({"max": stats["max"], "mean": stats["mean"], "warnings": texts})
            with torch.no_grad():  # the update (the engine sees it only through a sync)
                for p in actor.parameters():
                    p.add_(LR * p.float().abs().mean() * torch.randn(p.shape, generator=g))
        result[str(dtype)] = {"steps": steps, "floor": rule.floor}
    torch.save(result, out)


@pytest.mark.slow
def test_a_skipped_sync_warns_at_its_first_step_in_fp32_and_bf16(tiny_llama, tmp_path):
    out = str(tmp_path / "stale.pt")
    run_distributed(_body, world_size=1, args=(tiny_llama, out))
    result = torch.load(out)
    fp32, bf16 = result["torch.float32"], result["torch.bfloat16"]
    assert fp32["steps"][SYNCED]["max"] >= 1e-2, fp32  # the first skipped step: an fp32 gap >= 1e-2
    for name, run in (("fp32", fp32), ("bf16", bf16)):
        synced, first_skipped = run["steps"][:SYNCED], run["steps"][SYNCED]
        assert all(not s["warnings"] for s in synced), (name, run)
        assert first_skipped["warnings"] and "floor's mean" in first_skipped["warnings"][0], (name, run)
        assert f"{run['floor']['mean']:.3g}" in first_skipped["warnings"][0]
