"""The native engine's sampler: every engine-side draw, one batched operation, keyed per row.

    keys = row_keys(seeds)                                 # once per request: [B] int64
    tokens, logprobs = sample_tokens(logits, temperature, greedy, keys, positions, top_k, top_p)

A row's draw at a position is a function of (its seed, the position, its logits) and nothing else:
not of the other rows in the batch, the row's place in it, rollout.tp, placement or resume. That is
what makes a prompt's samples the same whichever rank, wave or batch decodes it (rollout/engine.py's
seed convention: sample j of prompt p is stream seeds[p] + j).

Noise: counter-based, as vLLM's GPU runner (Philox over (seed, position, token id)) and SGLang's
`multinomial_with_seed` (a hash of (seed, position, column)) do. Here splitmix64's finaliser
(`mix64`, Steele et al. 2014), in int64 torch ops that wrap identically on CPU and CUDA:

    stream   = mix64(seed)                         per row, row_keys
    counter  = mix64(stream + position * G)        per row and position
    bits     = mix64(counter + (token + 1) * G)    per row, position and token: [B, V]
    u        = (top 23 bits of bits + 1/2) / 2^23  in (0, 1), exact in float32 (24 bits would round to 1)
    gumbel   = -log(-log u)

Draw (Gumbel-max): argmax over tokens of logits / T + gumbel, with tokens outside top-k / top-p set to
-inf first; an exact sample of the truncated, renormalised softmax(logits / T) (vLLM's semantics:
top-k first, then top-p on what is left). Greedy rows take argmax of the raw logits.

Log-probs (rollout/engine.py's convention): log softmax(logits / T)[token] before the truncation, with
T = 1 on greedy rows (the caller passes temperature 1 there).
"""

from __future__ import annotations

import functools

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment (2^64 / golden ratio)
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN, MUL1, MUL2 = _signed(_GOLDEN), _signed(_MUL1), _signed(_MUL2)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: it copies the sign bit in)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (the bits of uint64; products wrap mod 2^64): a bijection whose
    outputs for neighbouring inputs look independent."""
    x = x ^ _shift_right(x, 30)
    x = x * MUL1
    x = x ^ _shift_right(x, 27)
    x = x * MUL2
    return x ^ _shift_right(x, 31)


def row_keys(seeds) -> torch.Tensor:
    """Each row's stream key from its seed: [B] int64 (a list or a tensor of seeds)."""
    return mix64(torch.as_tensor(seeds, dtype=torch.int64))


@functools.lru_cache(maxsize=8)
def _token_counters(vocab: int, device: torch.device) -> torch.Tensor:
    """(token id + 1) * G for every token [V] int64 (made once per vocabulary and device)."""
    return torch.arange(1, vocab + 1, device=device, dtype=torch.int64) * GOLDEN


def gumbel_noise(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [B] int64 (row_keys), positions [B] int64 (the token's index in its completion)
    -> Gumbel(0, 1) noise [B, vocab] float32, a function of (key, position, token id) alone."""
    counter = mix64(keys + positions * GOLDEN)  # [B]
    bits = mix64(counter.unsqueeze(-1) + _token_counters(vocab, keys.device))  # [B, V]
    u = _shift_right(bits, 41).to(torch.float32).mul_(2.0**-23).add_(2.0**-24)  # [2^-24, 1 - 2^-24]: never 0 or 1
    return torch.log(u).neg_().log_().neg_()


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """scaled logits [B, V] -> the same with tokens outside top-k / top-p set to -inf.

    top-k first (k largest; ties at the k-th value are kept), then top-p on the
    renormalised rest: a token is kept when the mass of the tokens ranked above
    it is < top_p, so the most likely token always survives.
    """
    out = scaled
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]  # [B, 1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)  # [B, V]
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    top_k: int = 0,
    top_p: float = 1.0,
    all_greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row, all rows at once (no host sync, no loop over rows; CUDA-graph capturable).

    logits [B, V] float32, temperature [B] float32 (1 on greedy rows), greedy [B] bool,
    keys [B] int64 (row_keys), positions [B] int64; all_greedy: the caller knows every row is greedy
    (an eval request), so no noise is made
    -> (tokens [B] int64, logprobs [B] float32: log softmax(logits / temperature)[token]).
    """
    scaled = logits / temperature.unsqueeze(-1)  # [B, V]
    if all_greedy:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    scores = filter_logits(scaled, top_k, top_p) + gumbel_noise(keys, positions, logits.shape[-1])
    tokens = torch.where(greedy, logits.argmax(-1), scores.argmax(-1))
    logprobs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs
