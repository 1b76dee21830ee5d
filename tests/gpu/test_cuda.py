"""GPU checks (collected only with CUDA; run by tools/gpu_check.sh).

- compiled Triton log-prob / advantage kernels vs the fp64 oracle (the CPU interpreter's cases, on CUDA,
  plus a bf16 case at a realistic vocab), with and without the gradient hint (autotuned blocks), and the
  hinted backward's GEMM passes (3; 4 without the hint);
- the actor at TP=1 in bf16 (and fp32) vs transformers on the GPU;
- the optimizer interface: megatron's DistributedOptimizer (GPU path) and CpuAdamW (CPU path, a
  CUDA_VISIBLE_DEVICES= subprocess) give the same weights after a step on the same gradients;
- the train-state offload with the DistributedOptimizer: GPU memory freed, bitwise round trip;
  the reward model's parameters all on the GPU.
"""

import pytest
import torch

from tests.kernels.cases import CASES, check_parity, make_inputs, oracle, run_fused
from tests.train.test_optimizer_paths import expected_after, run_step
from tools.make_tiny_model import make_tiny_model


def _cuda_inputs(case, dtype):
    h, w, labels, temp, g_lp, g_ent = make_inputs(case, dtype)
    return h.cuda(), w.cuda(), labels.cuda(), temp, g_lp.cuda(), g_ent.cuda()


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_logprobs_fp32_on_cuda(case, monkeypatch):
    import tests.kernels.cases as cases

    monkeypatch.setattr(cases, "make_inputs", _cuda_inputs)
    torch.backends.cuda.matmul.allow_tf32 = False
    check_parity(case, torch.float32, impl="triton")


def test_triton_logprobs_bf16_large_vocab():
    torch.manual_seed(0)
    n, d, v = 1024, 512, 50_257  # odd vocab: a partial last tile
    h = (torch.randn(n, d, device="cuda") / d**0.5).bfloat16()
    w = torch.randn(v, d, device="cuda").bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[:10] = -100
    g_lp, g_ent = torch.randn(n, device="cuda", dtype=torch.float64), torch.randn(n, device="cuda", dtype=torch.float64)
    lp, ent, gh, gw = run_fused(h, w, labels, 1.0, g_lp, g_ent, impl="triton")
    rlp, rent, rh, rw, _ = oracle(h, w, labels, 1.0)
    ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
    assert (lp.double() - rlp).abs().max() < 1e-3  # bf16 inputs, fp32 accumulation
    assert (ent.double() - rent).abs().max() < 1e-3
    assert (gh.double() - rh.grad).abs().max() < 2e-2 * rh.grad.abs().max()
    assert (gw.double() - rw.grad).abs().max() < 2e-2 * rw.grad.abs().max()


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_logprobs_grad_hint_fp32_on_cuda(case, monkeypatch):
    import tests.kernels.cases as cases

    monkeypatch.setattr(cases, "make_inputs", _cuda_inputs)
    torch.backends.cuda.matmul.allow_tf32 = False
    check_parity(case, torch.float32, impl="triton", entropy_grad=False, grad_hint=lambda g_lp: g_lp * 0.5)


def test_triton_logprobs_grad_hint_bf16_large_vocab():
    """bf16 at a 50257 vocab in several whole-vocab row tiles (chunk 2^24: 333 rows each): the hinted
    gradients match the oracle as the recomputed ones do, and each other closely."""
    torch.manual_seed(0)
    n, d, v = 1024, 512, 50_257
    h = (torch.randn(n, d, device="cuda") / d**0.5).bfloat16()
    w = torch.randn(v, d, device="cuda").bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[:10] = -100
    g_lp = torch.randn(n, device="cuda", dtype=torch.float64)
    lp, _, gh, gw = run_fused(h, w, labels, 1.0, g_lp, None, impl="triton", grad_hint=g_lp.float(), chunk_elems=1 << 24)
    _, _, ph, pw = run_fused(h, w, labels, 1.0, g_lp, None, impl="triton")
    rlp, _, rh, rw, _ = oracle(h, w, labels, 1.0)
    (rlp * g_lp).sum().backward()
    assert (lp.double() - rlp).abs().max() < 1e-3
    assert (gh.double() - rh.grad).abs().max() < 2e-2 * rh.grad.abs().max()
    assert (gw.double() - rw.grad).abs().max() < 2e-2 * rw.grad.abs().max()
    assert (gh.double() - ph.double()).abs().max() < 1e-2 * ph.double().abs().max()
    assert (gw.double() - pw.double()).abs().max() < 1e-2 * pw.double().abs().max()


@pytest.mark.parametrize("chunk", [None, 1 << 10])
def test_triton_grad_hint_runs_three_gemm_passes_on_cuda(chunk):
    from tests.kernels.gemm_count import hint_and_recompute_passes

    (hinted, launches), (plain, _) = hint_and_recompute_passes("cuda", chunk_elems=chunk)
    assert (hinted, plain) == (3.0, 4.0)
    assert "_bwd_dlogits" not in launches


def test_triton_advantages_on_cuda():
    from remax_megatron.kernels import compute_advantages_reference
    from remax_megatron.kernels.advantages_triton import advantages_triton

    g = torch.Generator().manual_seed(1)
    b, t = 64, 300
    mask = (torch.rand(b, t, generator=g) > 0.3).cuda()
    r, rb = torch.randn(b, generator=g).cuda(), torch.randn(b, generator=g).cuda()
    lp, ref = torch.randn(b, t, generator=g).cuda(), torch.randn(b, t, generator=g).cuda()
    want = compute_advantages_reference(r, rb, mask, lp, ref, kl_coef=0.1, clip=0.5)
    got = advantages_triton(r, rb, mask, lp, ref, 0.1, 0.5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _actor_body(rank, world, model_dir, out):
    """Both dtypes in one rank (one process start for the two tests)."""
    from transformers import AutoModelForCausalLM

    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.forward import forward_only
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights

    torch.backends.cuda.matmul.allow_tf32 = False
    ParallelLayout(tp=1, pp=1, world_size=world).initialize()
    arch = read_hf_config(model_dir)
    ids = torch.randint(4, arch.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    ids, labels = ids.cuda(), labels.cuda()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits.double(), -1)
    ref = ref.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(labels < 0, 0)
    gaps = {}
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        actor = build_policy(arch, tp=1, pp=1, params_dtype=dtype, trainable=False)
        load_hf_weights(actor, model_dir)
        assert all(p.is_cuda and p.dtype == dtype for p in actor.parameters())
        lp = forward_only(
            actor, [{"input_ids": ids, "labels": labels}], lambda m, hidden, b: m.token_logprobs(hidden, b["labels"])[0]
        )[0]
        gaps[dtype_name] = {
            "max": (lp.double() - ref).abs().max().item(),
            "mean": (lp.double() - ref).abs().mean().item(),
        }
    torch.save(gaps, out)


@pytest.fixture(scope="module")
def actor_gaps(tmp_path_factory):
    from tests._dist import run_distributed

    tmp = tmp_path_factory.mktemp("actor")
    model_dir = make_tiny_model(
        str(tmp / "m"), "qwen2", hidden=256, layers=4, heads=8, kv_heads=2, ffn=512, vocab=1000, seed=1
    )
    run_distributed(_actor_body, world_size=1, args=(model_dir, str(tmp / "gaps.pt")))
    return torch.load(str(tmp / "gaps.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("dtype,max_tol,mean_tol", [("float32", 1e-4, 1e-5), ("bfloat16", 0.25, 0.03)])
def test_actor_tp1_matches_transformers_on_cuda(actor_gaps, dtype, max_tol, mean_tol):
    gap = actor_gaps[dtype]
    print(f"actor {dtype} vs transformers fp32: max {gap['max']:.3g}, mean {gap['mean']:.3g}")
    assert gap["max"] < max_tol and gap["mean"] < mean_tol, gap


@pytest.mark.slow  # four processes
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_and_cpu_optimizer_paths_agree(tmp_path, dtype):
    model_dir = make_tiny_model(
        str(tmp_path / "m"), "qwen2", hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=200, seed=4
    )
    gpu = run_step(model_dir, dtype, str(tmp_path / "gpu.pt"))
    cpu = run_step(model_dir, dtype, str(tmp_path / "cpu.pt"), cuda_visible="")
    assert gpu["cuda"] and gpu["optimizer"] == "MegatronOptimizer" and cpu["optimizer"] == "CpuAdamW"
    assert abs(gpu["grad_norm"] - cpu["grad_norm"]) < 1e-5 * cpu["grad_norm"]
    want = expected_after(cpu["before"], cpu["grads"], torch.float32)
    for name, g in gpu["after"].items():
        c = cpu["after"][name]
        assert g.dtype == c.dtype, name
        if dtype == "float32":
            assert (g.double() - c.double()).abs().max() < 1e-6, name
            assert (g.double() - want[name]).abs().max() < 1e-6, name
        else:  # both round the same fp32 main weights: equal but for rare rounding-boundary ties
            assert (g != c).float().mean() < 1e-3, name


def _offload_body(rank, world, model_dir):
    import dataclasses
    import zlib

    from remax_megatron.config import load_config
    from remax_megatron.memory import TrainStateOffload
    from remax_megatron.models import build_policy, build_reward_model, read_hf_config
    from remax_megatron.optimizer import build_optimizer, wrap_ddp
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights

    ParallelLayout(tp=1, pp=1, world_size=world).initialize(seed=0)
    cfg = load_config(None, ["reward.functions=[exact_match]", "optim.distributed_optimizer=true"])
    arch = read_hf_config(model_dir)
    rm = build_reward_model(dataclasses.replace(arch, task="reward"), tp=1, pp=1, params_dtype=torch.bfloat16)
    assert all(p.is_cuda for p in rm.parameters()), "every reward-model parameter on the GPU (ScalarHead too)"
    actor = build_policy(arch, tp=1, pp=1, params_dtype=torch.bfloat16, init_weights=False)
    load_hf_weights(actor, model_dir)
    ddp = wrap_ddp(actor, True)
    opt = build_optimizer(ddp, cfg.optim, torch.bfloat16)
    assert type(opt).__name__ == "MegatronOptimizer"
    for name, p in ddp.module.named_parameters():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        p.main_grad.copy_((torch.randn(p.shape, generator=g) * 1e-2).cuda())
    assert opt.step()[0]  # Adam state and fp32 main shards exist from here on
    state = list(actor.parameters()) + opt.state_tensors()
    before = [t.detach().clone() for t in state]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    offload = TrainStateOffload(ddp, opt)
    offload.offload()
    freed = allocated - torch.cuda.memory_allocated()
    # bf16 params (2 B) + fp32 main weights, exp_avg, exp_avg_sq (12 B) + fp32 grads (4 B) per parameter
    n = sum(p.numel() for p in actor.parameters())
    assert freed >= 0.95 * 18 * n, (freed, 18 * n)
    offload.reload()
    assert all(torch.equal(a, b) for a, b in zip(state, before))
    assert opt.step()[0]  # and training goes on


@pytest.mark.slow
def test_offload_round_trip_with_distributed_optimizer(tmp_path):
    from tests._dist import run_distributed

    model_dir = make_tiny_model(
        str(tmp_path / "m"), "qwen2", hidden=256, layers=4, heads=8, kv_heads=2, ffn=512, vocab=1000, seed=1
    )
    run_distributed(_offload_body, world_size=1, args=(model_dir,))
