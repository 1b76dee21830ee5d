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


def _bf16(case):
    h, w, labels, temp, g_lp, g_ent = make_inputs(case, torch.bfloat16)
    lp, ent, gh, gw = run_fused(h, w, labels, temp, g_lp, g_ent, impl="triton")
    rlp, rent, rh, rw, big = oracle(h, w, labels, temp)
    ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
    assert (lp.double() - rlp).abs().max() < 1e-5 * max(1.0, big)
    assert (ent.double() - rent).abs().max() < 1e-5 * max(1.0, big)
    assert (gh.double() - rh.grad).abs().max() < 1e-2 * rh.grad.abs().max()
    assert (gw.double() - rw.grad).abs().max() < 1e-2 * rw.grad.abs().max()


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
    checks["logprobs_fp64_basic"] = lambda: check_parity("temperature", torch.float64, impl="triton", lp_tol=1e-5)
    for case in ("basic", "ignored_rows"):
        checks[f"logprobs_bf16_{case}"] = lambda c=case: _bf16(c)
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
