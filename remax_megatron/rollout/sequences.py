"""The engine's side of sequences: prompts left-padded for decoding, rollouts flattened into rows.

input_ids, attention_mask, positions = left_pad(prompts, pad_id)
rows_p, rows_c = flatten_rollouts(prompts, rollouts, include_greedy=True)   # for batching.pad_sequences
"""

from __future__ import annotations

import torch


def left_pad(prompts: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad prompts for batched decoding.

    Returns input_ids [P, L], attention_mask [P, L] (1 on tokens) and position_ids
    [P, L] (0 at each prompt's first token, so padding does not shift RoPE).
    """
    if not prompts:
        raise ValueError("left_pad got no prompts")
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, length - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, length - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def flatten_rollouts(
    prompts: list[list[int]], rollouts: list, include_greedy: bool = False
) -> tuple[list[list[int]], list]:
    """(prompt per row, completion per row) for batching.pad_sequences: each prompt's n sampled
    completions in order, then (include_greedy) its greedy one."""
    if len(prompts) != len(rollouts):
        raise ValueError(f"{len(prompts)} prompts but {len(rollouts)} rollouts")
    rows_p, rows_c = [], []
    for prompt, ro in zip(prompts, rollouts):
        for comp in list(ro.sampled) + ([ro.greedy] if include_greedy else []):
            rows_p.append(prompt)
            rows_c.append(comp)
    return rows_p, rows_c
