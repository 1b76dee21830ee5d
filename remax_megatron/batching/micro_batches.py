"""A step's rows -> the micro-batches the training forward runs: token budgets, packed rows, DP balance.

    plan = plan_step(lengths_by_rank, mini_batches=1, budget=4096, multiple=1, pack=True)
    batch = exchange_rows(batch, plan.sources, dp_rank, width, dp_group)   # this rank's rows after the balance
    for micro in plan.updates[dp_rank][u]:
        mb = assemble(batch, micro)                                 # tensors of one micro-batch

With `trainer.micro_batch_tokens` = 0 the trainer keeps fixed-count micro-batches (`fixed_micro_batches`):
`micro_batch_size` rows each, all as wide as the step's longest row. With a budget B:

- **DP balance.** The lengths of each update's rows are gathered over DP and the rows dealt by length
  (longest first, to the rank with the fewest tokens so far), so every DP rank trains on near-equal
  token counts; then one all-to-all moves each row to the rank it was dealt to (a rank sends and
  receives about its own batch, where gathering every rank's batch was DP times that). A row is a
  sample with its reward AND its prompt's greedy reward (`baseline`): they travel together, so the
  ReMax pairing holds wherever the row lands.
- **Token budget, padded rows.** Longest first, rows join a micro-batch while rows x width <= B, the
  width being its longest row rounded up to `multiple` (TP with sequence parallel).
- **Packed rows** (`trainer.pack_sequences`): sequences go first-fit-decreasing into rows as wide as
  the update's longest sequence (rounded), floor(B / width) rows per micro-batch (the token budget).
  The model then sees the micro-batch's sequences back to back in ONE row in megatron's THD format
  (PackedSeqParams with cu_seqlens; trailing padding up to the sequence multiple is a segment of its
  own): Transformer Engine's attention where its spec runs, else models/attention.py, which attends
  each document alone, so a packed row costs what its documents cost (no [s, s] mask). RoPE depends
  on relative positions only (tests/models/test_parity.py checks each sequence of a packed row against
  transformers 1900+ positions in, plain and llama3-scaled RoPE).
- **Same count everywhere.** Megatron's schedule (and expert-parallel collectives, which span DP
  replicas) need every DP rank to run the same number of micro-batches: a rank with fewer splits
  its largest ones, and runs an empty "ghost" micro-batch (one row of padding, no label) only when
  it has no row left to split.

The loss and the fused log-prob kernel see each micro-batch in the sequence layout of
`batching.padding.pad_sequences` (`labels`, `response_mask`, rewards per row, trimmed to the
micro-batch's width): packed rows only change what the model's forward runs (`input_ids` and the
attention boundaries); `to_rows` / `to_sequences` move per-token values between the two layouts. The
trainer normalises the loss by the update's GLOBAL token (sequence) counts, so the grouping into
micro-batches, the packing and the DP balance leave the update unchanged (tests/train/test_update.py).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from remax_megatron.kernels import IGNORE_INDEX
from remax_megatron.parallel.layout import comm_device
from remax_megatron.sizes import check_token_budget, round_up

# Fill of each per-token key beyond a row's length (anything else: 0).
_FILL = {"labels": IGNORE_INDEX, "routed_experts": -1}


@dataclass
class MicroBatch:
    """Rows of the rank's batch trained together. `width`: the longest of them rounded up to the
    sequence multiple (the sequence layout's width). Packed: `bins` lists, per packed row, positions
    in `rows`; `row_width` is the packed rows' width. No rows: a ghost (one padding row, no label)."""

    rows: list[int]
    width: int
    bins: list[list[int]] | None = None
    row_width: int = 0

    @property
    def ghost(self) -> bool:
        return not self.rows


@dataclass
class StepPlan:
    """Per DP rank: where its rows come from ((source rank, source row) in order) and its micro-batches
    per update (rows index the rank's new batch)."""

    sources: list[list[tuple[int, int]]]
    updates: list[list[list[MicroBatch]]] = field(default_factory=list)


def fixed_micro_batches(rows: list[int], micro_batch_size: int, width: int) -> list[MicroBatch]:
    """Fixed-count micro-batches: `rows` in order, `micro_batch_size` of them each, all `width` wide."""
    return [MicroBatch(rows[s : s + micro_batch_size], width) for s in range(0, len(rows), micro_batch_size)]


def balance_rows(lengths_by_rank: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Deal the rows of every rank ((rank, row) with its length) over the same ranks by tokens: longest
    first, each to the rank with the fewest tokens so far (then the fewest rows, then the lowest rank).
    Every rank computes the same result from the same lengths."""
    ranks = len(lengths_by_rank)
    rows = sorted(
        ((length, r, i) for r, lengths in enumerate(lengths_by_rank) for i, length in enumerate(lengths)),
        key=lambda x: (-x[0], x[1], x[2]),
    )
    tokens, dealt = [0] * ranks, [[] for _ in range(ranks)]
    for length, r, i in rows:
        target = min(range(ranks), key=lambda k: (tokens[k], len(dealt[k]), k))
        dealt[target].append((r, i))
        tokens[target] += length
    return [sorted(d) for d in dealt]


def plan_micro_batches(
    lengths: list[int], budget: int, multiple: int = 1, pack: bool = False, rows: list[int] | None = None
) -> list[MicroBatch]:
    """Rows (`rows`, default 0..n-1, with `lengths`) grouped into micro-batches of <= `budget` tokens
    computed (padding included; see the module docstring)."""
    rows = list(range(len(lengths))) if rows is None else list(rows)
    if not rows:
        return []
    longest = round_up(max(lengths), multiple)
    check_token_budget(budget, longest)
    order = sorted(range(len(rows)), key=lambda j: (-lengths[j], rows[j]))
    if pack:
        return _packed(order, lengths, rows, longest, budget // longest)
    out: list[MicroBatch] = []
    for j in order:
        if out and (len(out[-1].rows) + 1) * out[-1].width <= budget:
            out[-1].rows.append(rows[j])
        else:
            out.append(MicroBatch([rows[j]], round_up(lengths[j], multiple)))
    return out


def _packed(
    order: list[int], lengths: list[int], rows: list[int], row_width: int, rows_per_micro: int
) -> list[MicroBatch]:
    """First-fit decreasing into packed rows of `row_width`, `rows_per_micro` packed rows per micro-batch."""
    bins: list[list[int]] = []
    room: list[int] = []
    for j in order:
        k = next((k for k, free in enumerate(room) if free >= lengths[j]), None)
        if k is None:
            bins.append([])
            room.append(row_width)
            k = len(bins) - 1
        bins[k].append(j)
        room[k] -= lengths[j]
    out = []
    for s in range(0, len(bins), rows_per_micro):
        group = bins[s : s + rows_per_micro]
        members = [j for b in group for j in b]
        index = {j: p for p, j in enumerate(members)}
        out.append(
            MicroBatch(
                [rows[j] for j in members], row_width, bins=[[index[j] for j in b] for b in group], row_width=row_width
            )
        )
    return out


def equalize(micro: list[MicroBatch], count: int, lengths: dict[int, int], multiple: int) -> list[MicroBatch]:
    """`micro` made `count` long: split the micro-batch with the most rows in two (packed: each half
    re-packed into rows of the same width) while one has two rows or more; then ghosts."""
    micro = list(micro)
    while len(micro) < count:
        k = max(range(len(micro)), key=lambda i: (len(micro[i].rows), -i), default=None)
        if k is None or len(micro[k].rows) < 2:
            micro.append(MicroBatch([], multiple))
            continue
        big = micro.pop(k)
        order = sorted(big.rows, key=lambda r: (-lengths[r], r))
        halves = [order[0::2], order[1::2]]  # alternate: both halves keep long and short rows
        for half in halves:
            if big.bins is not None:
                micro.insert(
                    k, _packed(list(range(len(half))), [lengths[r] for r in half], half, big.row_width, len(half))[0]
                )
            else:
                micro.insert(k, MicroBatch(half, round_up(max(lengths[r] for r in half), multiple)))
            k += 1
    return micro


def plan_step(
    lengths_by_rank: list[list[int]],
    mini_batches: int,
    budget: int,
    multiple: int = 1,
    pack: bool = False,
    skipped_by_rank: list[list[bool]] | None = None,
) -> StepPlan:
    """The whole step's plan, the same on every rank: per update (each rank's u-th contiguous share of
    its rows), the rows balanced over the DP ranks by tokens, then grouped into micro-batches under
    `budget`; every rank gets as many micro-batches as the busiest one (at least one).

    `skipped_by_rank`: rows the forward leaves out (trainer.skip_zero_advantage). They are still dealt to a
    rank (the step's metrics and the loss's counts read them there) but weigh nothing in the balance and
    join no micro-batch."""
    ranks = len(lengths_by_rank)
    skipped_by_rank = skipped_by_rank or [[False] * len(lengths) for lengths in lengths_by_rank]
    plan = StepPlan(sources=[[] for _ in range(ranks)], updates=[[] for _ in range(ranks)])
    for u in range(mini_batches):
        shares = []
        for lengths, skipped in zip(lengths_by_rank, skipped_by_rank):
            per = len(lengths) // mini_batches
            shares.append([(i, lengths[i], skipped[i]) for i in range(u * per, (u + 1) * per)])
        dealt = balance_rows([[0 if skip else length for _, length, skip in share] for share in shares])
        micro, lengths_of = [], []
        for r in range(ranks):
            start = len(plan.sources[r])
            plan.sources[r].extend((src, shares[src][i][0]) for src, i in dealt[r])
            lens = {start + p: shares[src][i][1] for p, (src, i) in enumerate(dealt[r]) if not shares[src][i][2]}
            lengths_of.append(lens)
            micro.append(plan_micro_batches(list(lens.values()), budget, multiple, pack, rows=list(lens)))
        count = max(1, max(len(m) for m in micro))
        for r in range(ranks):
            plan.updates[r].append(equalize(micro[r], count, lengths_of[r], multiple))
    return plan


def exchange_rows(batch: dict, sources: list[list[tuple[int, int]]], rank: int, width: int, group) -> dict:
    """This DP rank's batch after the balance: the rows `sources[rank]` ((source rank, row) pairs, in
    order) gathered from the ranks that rolled them out, each rank sending every other only the rows it
    takes (one all-to-all). Per-token tensors padded to `width` (the widest batch of the DP group), as
    `take_rows` over every rank's batch gives."""
    tensors = {k: v for k, v in batch.items() if torch.is_tensor(v)}
    outgoing = [
        {k: v[[i for r, i in sources[dest] if r == rank]] for k, v in tensors.items()} for dest in range(len(sources))
    ]
    mine, outgoing[rank] = outgoing[rank], {}  # this rank's own rows stay here
    incoming = all_to_all_objects(outgoing, group)
    incoming[rank] = mine
    taken, local = [0] * len(sources), []  # (source rank, row within what it sent)
    for r, _ in sources[rank]:
        local.append((r, taken[r]))
        taken[r] += 1
    return take_rows(incoming, local, width)


def all_to_all_objects(objects: list, group) -> list:
    """`objects[k]` (picklable) to rank k of `group`; returns what each rank sent this one. Two
    `all_to_all_single` calls (sizes, then bytes), on the device the group's backend needs."""
    device = comm_device(group)
    payloads = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in objects]
    send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.long, device=device)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    sent = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).to(device)
    received = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8, device=device)
    dist.all_to_all_single(
        received, sent, output_split_sizes=recv_sizes.tolist(), input_split_sizes=send_sizes.tolist(), group=group
    )
    data = received.cpu().numpy().tobytes()
    out, start = [], 0
    for size in recv_sizes.tolist():
        out.append(pickle.loads(data[start : start + size]))
        start += size
    return out


def take_rows(batches: list[dict], sources: list[tuple[int, int]], width: int | None = None) -> dict:
    """The rows `sources` ((rank, row) pairs) of the ranks' batches as one batch: per-token tensors
    ([B, S, ...]) padded to `width` (default: the widest batch; labels -100, routes -1, else 0); per-row
    ones as they are."""
    width = width or max(b["input_ids"].shape[1] for b in batches)
    out = {}
    for key, value in batches[0].items():
        if not torch.is_tensor(value):
            continue
        picked = []
        for r, i in sources:
            source = batches[r][key]
            row = source[i]
            per_token = source.dim() >= 2 and source.shape[1] == batches[r]["input_ids"].shape[1]
            if per_token and row.shape[0] < width:
                pad = torch.full((width - row.shape[0], *row.shape[1:]), _FILL.get(key, 0), dtype=row.dtype)
                row = torch.cat([row, pad])
            picked.append(row)
        out[key] = torch.stack(picked) if picked else value[:0]
    return out


def assemble(batch: dict, micro: MicroBatch, extra: dict | None = None, multiple: int = 1) -> dict:
    """The tensors of one micro-batch: every tensor of `batch` (and of `extra`, e.g. reference
    log-probs [B, S]) at the micro-batch's rows, per-token ones trimmed to its width (the sequence
    layout), and `padding` [b, w] (True past each row's length) when the batch has `lengths`.

    Packed micro-batches: `input_ids`, `padding` and `routed_experts` are the model's input row instead
    ([1, tokens rounded up to `multiple`]), with `row_labels` (the labels at the same places), `segments`
    (sequence per position, -1 padding), `unpack` (the flat position of each sequence-layout token in the
    row) and the documents' boundaries `cu_seqlens` and `max_seqlen`; see the module docstring."""
    width_of_batch = batch["input_ids"].shape[1]
    sources = {k: v for k, v in batch.items() if torch.is_tensor(v)}
    sources.update({k: v for k, v in (extra or {}).items() if v is not None})
    if micro.ghost:
        return _ghost(sources, width_of_batch, micro.width)
    index = torch.tensor(micro.rows, dtype=torch.long)
    mb = {}
    for key, value in sources.items():
        picked = value[index]
        if value.dim() >= 2 and value.shape[1] == width_of_batch:
            picked = picked[:, : micro.width]
        mb[key] = picked
    if "lengths" in mb:
        mb["padding"] = torch.arange(micro.width)[None, :] >= mb["lengths"][:, None]
    if micro.bins is not None:
        mb.update(_pack_rows(mb, micro, multiple))
    return mb


def _ghost(sources: dict, width_of_batch: int, width: int) -> dict:
    """One row of padding with no label: runs through the model like any micro-batch, adds nothing."""
    mb = {}
    for key, value in sources.items():
        per_token = value.dim() >= 2 and value.shape[1] == width_of_batch
        shape = (1, width, *value.shape[2:]) if per_token else (1, *value.shape[1:])
        mb[key] = torch.full(shape, _FILL.get(key, 0), dtype=value.dtype)
    mb["padding"] = torch.ones(1, width, dtype=torch.bool)
    return mb


def _pack_rows(mb: dict, micro: MicroBatch, multiple: int) -> dict:
    """The model's input row of a packed micro-batch and the index from the sequence layout into it."""
    lengths = mb["lengths"].tolist()
    b, w = mb["input_ids"].shape
    layout = [[j for members in micro.bins for j in members]]  # every sequence in one row, back to back
    row_width = round_up(sum(lengths), multiple)  # padding only at the end
    rows = len(layout)
    unpack = torch.full((b, w), rows * row_width, dtype=torch.long)  # default: the zero slot past the rows
    segments = torch.full((rows, row_width), -1, dtype=torch.long)
    row_ids = torch.zeros(rows, row_width, dtype=mb["input_ids"].dtype)
    row_labels = torch.full((rows, row_width), IGNORE_INDEX, dtype=mb["labels"].dtype)
    bounds = [0]
    for r, members in enumerate(layout):
        at = 0
        for j in members:
            n = lengths[j]
            unpack[j, :n] = r * row_width + at + torch.arange(n)
            segments[r, at : at + n] = j
            row_ids[r, at : at + n] = mb["input_ids"][j, :n]
            row_labels[r, at : at + n] = mb["labels"][j, :n]
            at += n
            bounds.append(r * row_width + at)
    out = {
        "input_ids": row_ids,
        "row_labels": row_labels,
        "padding": segments < 0,
        "segments": segments,
        "unpack": unpack,
    }
    if "routed_experts" in mb:
        routes = mb["routed_experts"]
        flat = torch.full((rows * row_width + 1, *routes.shape[2:]), -1, dtype=routes.dtype)
        flat[unpack.reshape(-1)] = routes.reshape(b * w, *routes.shape[2:])
        out["routed_experts"] = flat[:-1].view(rows, row_width, *routes.shape[2:])
    if bounds[-1] < row_width:  # the trailing padding is a sequence of its own
        bounds.append(row_width)
    out["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
    out["max_seqlen"] = torch.tensor(max(e - s for s, e in zip(bounds, bounds[1:])), dtype=torch.int32)
    return out


def packed(mb: dict) -> bool:
    return "unpack" in mb


def model_labels(mb: dict) -> torch.Tensor:
    """The labels where the model's output sits: the input rows' (packed) or the sequence layout's."""
    return mb["row_labels"] if packed(mb) else mb["labels"]


def to_rows(mb: dict, values: torch.Tensor) -> torch.Tensor:
    """Per-token values in the sequence layout [b, w] -> the model's input rows (the same tensor when
    the micro-batch is not packed); 0 where no sequence token sits."""
    if not packed(mb):
        return values
    rows, width = mb["input_ids"].shape
    flat = values.new_zeros(rows * width + 1)
    flat[mb["unpack"].reshape(-1)] = values.reshape(-1)
    return flat[:-1].view(rows, width)


def to_sequences(mb: dict, values: torch.Tensor | None) -> torch.Tensor | None:
    """Per-token values on the model's input rows -> the sequence layout [b, w] (0 past each row's
    length); differentiable (a gather)."""
    if values is None or not packed(mb):
        return values
    flat = torch.cat([values.reshape(-1), values.new_zeros(1)])
    return flat[mb["unpack"]]


def model_inputs(mb: dict) -> tuple[torch.Tensor, dict]:
    """(input_ids, keyword arguments) of the model's forward for micro-batch `mb`: padded rows
    (attention_mask None: causal), or a packed row with its documents' boundaries (THD)."""
    if "cu_seqlens" in mb:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu, longest = mb["cu_seqlens"], int(mb["max_seqlen"])
        return mb["input_ids"], {
            "attention_mask": None,
            "packed_seq_params": PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
            ),
        }
    return mb["input_ids"], {"attention_mask": None}
