"""Run by test_triton_interpreter.py in a subprocess with TRITON_INTERPRET=1
(the env var must be set before the Triton kernels are imported). Prints one
JSON object: check name -> "ok" or the failure message."""

import json
import os
import sys
import traceback

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from tests.kernels.cases import CASES, check_parity, make_inputs, oracle, run_fused  # noqa: E402


def _bf16(case, hint=False):
    """hint: the loss holds the log-probs only and grad_hint is (a multiple of) their gradient."""
    h, w, labels, temp, g_lp, g_ent = make_inputs(case, torch.bfloat16)
    if hint:
        g_ent = torch.zeros_like(g_ent)
    kw = dict(grad_hint=(g_lp * 0.5).float()) if hint else {}
    lp, ent, gh, gw = run_fused(h, w, labels, temp, g_lp, None if hint else g_ent, impl="triton", **kw)
    rlp, rent, rh, rw, big = oracle(h, w, labels, temp)
    ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
    assert (lp.double() - rlp).abs().max() < 1e-5 * max(1.0, big)
    assert (ent.double() - rent).abs().max() < 1e-5 * max(1.0, big)
    assert (gh.double() - rh.grad).abs().max() < 1e-2 * rh.grad.abs().max()
    assert (gw.double() - rw.grad).abs().max() < 1e-2 * rw.grad.abs().max()


def _gemm_passes():
    """The hinted backward: 3 GEMM passes (logits with the statistics, dz @ W, dz.T @ x) and no
    recomputing kernel; without the hint 4 (the logits twice). Whole-vocab tiles and tiny ones."""
    from tests.kernels.gemm_count import hint_and_recompute_passes

    for chunk in (None, 32):
        (hinted, hinted_launches), (plain, plain_launches) = hint_and_recompute_passes(chunk_elems=chunk)
        assert hinted == 3.0, f"chunk {chunk}: hinted GEMM passes {hinted} != 3"
        assert plain == 4.0, f"chunk {chunk}: plain GEMM passes {plain} != 4"
        assert "_bwd_dlogits" not in hinted_launches, hinted_launches
        assert hinted_launches["_hint_dlogits_kernel"] == hinted_launches["_fwd_stats"] >= 1, hinted_launches
        assert plain_launches["_bwd_dlogits"] >= 1 and "_hint_dlogits_kernel" not in plain_launches


def _fixed_blocks():
    """Under the interpreter the kernels are not autotuned: fixed 16 x 16 x 16 blocks."""
    import remax_megatron.kernels.logprobs_triton as lt

    assert lt._fwd_stats is lt._fwd_stats_kernel and lt._bwd_dlogits is lt._bwd_dlogits_kernel
    assert lt._blocks() == dict(BLOCK_N=16, BLOCK_V=16, BLOCK_D=16)


def _wrong_hint(what):
    """A gradient that is not a multiple of the hint, or an entropy gradient: recomputed, exact."""
    if what == "not_a_multiple":
        check_parity(
            "ignored_rows",
            torch.float32,
            impl="triton",
            entropy_grad=False,
            grad_hint=lambda g_lp: g_lp + torch.linspace(0, 1e-3, g_lp.numel(), dtype=g_lp.dtype),
        )
    else:
        check_parity("ignored_rows", torch.float32, impl="triton", grad_hint=lambda g_lp: g_lp)


def _advantages(kl, clip, block):
    from remax_megatron.kernels import compute_advantages_reference
    from remax_megatron.kernels.advantages_triton import advantages_triton

    g = torch.Generator().manual_seed(1)
    b, t = 5, 13
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0] = False  # fully masked row
    mask[1] = False
    mask[1, 4] = True  # response of length 1
    r, rb = torch.randn(b, generator=g), torch.randn(b, generator=g)
    lp, ref = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)
    want = compute_advantages_reference(r, rb, mask, lp, ref, kl_coef=kl, clip=clip)
    got = advantages_triton(r, rb, mask, lp if kl else None, ref if kl else None, kl, clip, block_t=block)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def main():
    checks = {}
    for case in sorted(CASES):
        for chunk in (None, 32):  # 32 elements: several backward vocab chunks
            checks[f"logprobs_fp32_{case}_chunk{chunk}"] = lambda c=case, k=chunk: check_parity(
                c, torch.float32, impl="triton", chunk_elems=k
            )
        for chunk in (None, 32):  # the gradient hint: 32 elements = one row per whole-vocab tile
            checks[f"logprobs_fp32_{case}_chunk{chunk}_hint"] = lambda c=case, k=chunk: check_parity(
                c, torch.float32, impl="triton", chunk_elems=k, entropy_grad=False, grad_hint=lambda g: g * 0.5
            )
    checks["logprobs_fp64_basic"] = lambda: check_parity("temperature", torch.float64, impl="triton", lp_tol=1e-5)
    checks["logprobs_fp64_hint"] = lambda: check_parity(
        "temperature", torch.float64, impl="triton", lp_tol=1e-5, entropy_grad=False, grad_hint=lambda g: g * 2.0
    )
    for case in ("basic", "ignored_rows"):
        checks[f"logprobs_bf16_{case}"] = lambda c=case: _bf16(c)
        checks[f"logprobs_bf16_{case}_hint"] = lambda c=case: _bf16(c, hint=True)
    for what in ("not_a_multiple", "entropy_grad"):
        checks[f"logprobs_hint_{what}_recomputes"] = lambda w=what: _wrong_hint(w)
    checks["logprobs_gemm_passes_hint3_plain4"] = _gemm_passes
    checks["logprobs_interpreter_fixed_blocks"] = _fixed_blocks
    for kl, clip, block in ((0.0, None, 16), (0.1, None, 4), (0.3, 0.5, 4), (0.1, None, 16)):
        checks[f"advantages_kl{kl}_clip{clip}_block{block}"] = lambda a=kl, b=clip, c=block: _advantages(a, b, c)
    results = {}
    for name, fn in checks.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=3)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
