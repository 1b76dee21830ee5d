"""MoE checks that need CUDA (collected only with CUDA; run by tools/gpu_check.sh on one GPU).

- Transformer Engine's grouped experts (TEGroupedMLP, actor.moe_experts=grouped) load the same HF weights
  as megatron's SequentialMLP and give transformers' logits (fp32 and bf16), for Qwen3-MoE and GLM-4.5
  (megatron's TE decoder block spec: a dense first layer, shared experts, the float32 correction bias);
- vLLM's CUDA engine after in-place reloads of a MoE actor: log-probs vs the actor, with the engine's
  CPU-only expert re-processing off (does CUDA need it? this test says).
One GPU: expert parallelism itself (EP > 1) is covered on CPU by the gloo tests.
"""

import importlib.util

import pytest
import torch

from tests._dist import run_distributed
from tools.make_tiny_model import make_tiny_model


def _moe_model(tmp_path, family="qwen3_moe"):
    return make_tiny_model(
        str(tmp_path / family),
        family,
        hidden=128,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=64,
        vocab=300,
        experts=4,
        top_k=2,
        seed=12,
    )


def _grouped_body(rank, world, model_dir, dtype_name, out_path):
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.arch import ExpertOptions
    from remax_megatron.models.forward import forward_only
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import export_hf_weights, load_hf_weights

    ParallelLayout(tp=1, pp=1, world_size=world).initialize()
    arch = read_hf_config(model_dir)
    dtype = getattr(torch, dtype_name)
    results = {}
    for grouped in (False, True):
        model = build_policy(arch, tp=1, pp=1, params_dtype=dtype, experts=ExpertOptions(grouped_gemm=grouped))
        load_hf_weights(model, model_dir)
        ids = torch.randint(4, arch.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        (logits,) = forward_only(model, [{"input_ids": ids}], lambda m, h, b: m.full_logits(h).float().cpu())
        exported = {n: t.detach().cpu().clone() for n, t in export_hf_weights(model)}
        results[grouped] = {
            "logits": logits,
            "exported": exported,
            "names": [n for n, _ in model.named_parameters() if "experts" in n][:4],
        }
    torch.save(results, out_path)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="Transformer Engine not installed")
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.1)])
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])  # glm4_moe: TE's decoder block spec, dense layer 0
def test_grouped_experts_match_sequential_and_transformers(tmp_path, dtype, tol, family):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir = _moe_model(tmp_path, family)
    out = str(tmp_path / "grouped.pt")
    run_distributed(_grouped_body, world_size=1, args=(model_dir, dtype, out))
    results = torch.load(out)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(4, hf.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
    assert any(n.endswith("weight0") for n in results[True]["names"]), results[True]["names"]  # TE's names
    for grouped in (False, True):
        err = (results[grouped]["logits"] - expected).abs().max().item()
        assert err < tol, (grouped, dtype, err)
    source = load_file(f"{model_dir}/model.safetensors")
    for name, tensor in source.items():  # the grouped experts' names map back to HF's
        if not name.endswith("e_score_correction_bias"):  # the correction bias stays float32 (TensorRule.fp32)
            tensor = tensor.to(getattr(torch, dtype))
        assert torch.equal(results[True]["exported"][name].float(), tensor.float()), name


def _vllm_moe_body(rank, world, model_dir, out_path):
    from tests.rollout.test_vllm_engine import _body

    _body(rank, world, model_dir, 1, 1, 1, "auto", 1, False)  # reprocess=False: vLLM's own reload only
    torch.save("ok", out_path)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_vllm_cuda_reload_of_moe_experts_needs_no_reprocessing(tmp_path):
    """On CUDA the engine does not re-process experts after a reload (remax_megatron/rollout/vllm_engine.py
    needs_moe_reprocess): this checks that vLLM's own reload leaves them right there (3 updates)."""
    model_dir = _moe_model(tmp_path)
    run_distributed(_vllm_moe_body, world_size=1, args=(model_dir, str(tmp_path / "ok.pt")))
