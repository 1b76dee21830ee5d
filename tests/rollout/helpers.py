"""Helpers for the rollout tests: HF tensor streams, synced native engines, a chi-square check."""

import math

import torch


def hf_stream(model_dir, scale_final_norm: float = 1.0):
    """(name, tensor) for every tensor of an HF dir; scale_final_norm sharpens the logits."""
    from remax_megatron.weights import HFCheckpointReader

    for name, tensor in HFCheckpointReader(model_dir).tensors():
        if name == "model.norm.weight":
            tensor = tensor * scale_final_norm
        yield name, tensor


def native_engine(model_dir, seed=0, scale_final_norm=1.0):
    from remax_megatron.rollout import sync_weights
    from remax_megatron.rollout.native import NativeEngine

    engine = NativeEngine(hf_dir=model_dir, seed=seed, dtype=torch.float32, device="cpu")
    sync_weights(engine, hf_stream(model_dir, scale_final_norm), bucket_mb=1)
    return engine


def assert_chi_square(counts: torch.Tensor, probs: torch.Tensor, level: float = 1e-3) -> None:
    """Goodness of fit at the `level` (1e-3 or 1e-2; Wilson-Hilferty chi-square quantile; scipy when installed).

    counts [V] observed, probs [V] expected distribution; bins with expected < 5 are pooled.
    """
    z = {1e-3: 3.09, 1e-2: 2.326}[level]  # the standard normal's 1 - level quantile
    total = counts.sum().item()
    expected = probs.double() * total
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if exp[-1] < 5:  # fold the pooled tail into the smallest big bin when it is itself tiny
        obs, exp = obs[:-1], exp[:-1]
        obs[-1] += counts[~big].sum()
        exp[-1] += expected[~big].sum()
    stat = ((obs - exp) ** 2 / exp).sum().item()
    df = len(exp) - 1
    assert df >= 1, "distribution too concentrated for a chi-square test"
    try:
        from scipy.stats import chi2

        crit = chi2.ppf(1 - level, df)
    except ImportError:
        crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert stat < crit, f"chi-square {stat:.1f} >= critical {crit:.1f} (df={df}): samples do not follow the model"
