"""rollout.placement=separate: the engine runs on its own ranks; the training ranks reach it over a bridge.

    # training ranks (startup.build): a RolloutEngine like any other
    engine = RemoteEngine(split.bridge, dtype=torch.float32)
    ticket = engine.submit(prompts, n, sampling, seeds)   # returns at once: the rollout ranks decode
    ...                                                  # the update runs meanwhile
    rollouts = engine.collect(ticket)

    # rollout ranks (train.py): the engine, serving until the training ranks stop
    serve(build_engine(...), split.bridge)

Every training rank calls `submit` with its own prompts (as with a local engine); the prompts of all
training ranks are gathered to training rank 0, which sends ONE request over the bridge. The K rollout
ranks split the request's prompts in contiguous shares (each rank of a rollout.tp engine its own, as
under colocation), decode them, and rollout rank 0 sends every completion back to training rank 0 (point
to point), which hands each training rank its own. Weight syncs stream the actor's export (the same buckets as a
local sync) from training rank 0 to every rollout rank by broadcast, one flat tensor per bucket; each rollout rank
loads them into its engine in ONE update_weights call, as the colocated sync does.

The bridge carries one conversation in order (parallel/split.py): a request in flight is received
(and kept) before training rank 0 sends anything else, so a weight sync or an eval request issued
while the rollout ranks decode waits for that batch and never crosses it.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from remax_megatron.rollout.engine import (
    Completion,
    PromptRollout,
    RolloutEngine,
    SamplingParams,
    check_generate_args,
    world_size_and_rank,
)

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


class Bridge:
    """Objects and tensors over the bridge group (a c10d ProcessGroup used through its own methods)."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, torch.device(device)

    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self.group.broadcast(tensor, root).wait()

    def send(self, obj, root: int) -> None:
        """`obj` from bridge rank `root` (the caller) to every other bridge rank."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._broadcast(torch.tensor([len(data)], dtype=torch.int64, device=self.device), root)
        self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), root)

    def recv(self, root: int):
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size, root)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(data, root)
        return pickle.load(io.BytesIO(data.cpu().numpy().tobytes()))

    def tensor(self, tensor: torch.Tensor, root: int) -> None:
        """Broadcast `tensor` in place (the root's values to every bridge rank)."""
        self._broadcast(tensor, root)

    def send_to(self, obj, dst: int) -> None:
        """`obj` to bridge rank `dst` alone (point to point: the other rollout ranks are not involved)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.group.send([torch.tensor([len(data)], dtype=torch.int64, device=self.device)], dst, 0).wait()
        self.group.send([torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)], dst, 1).wait()

    def recv_from(self, src: int):
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.group.recv([size], src, 0).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.group.recv([data], src, 1).wait()
        return pickle.load(io.BytesIO(data.cpu().numpy().tobytes()))


@dataclass
class Ticket:
    """A submitted request: its id and how many prompts each training rank gave (training rank 0 only)."""

    id: int
    counts: list[int]


class RemoteEngine(RolloutEngine):
    """The training ranks' view of the engine on the rollout ranks (every training rank holds one)."""

    name = "remote"

    def __init__(self, bridge_group, *, dtype: torch.dtype, seed: int = 0):
        super().__init__(seed)
        self.dtype = dtype
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )
        self.is_root = dist.get_rank() == 0
        self.bridge = Bridge(bridge_group, self.device) if self.is_root else None
        self._next_id = 0
        self._in_flight: Ticket | None = None  # training rank 0: sent, its result not received yet
        self._received: dict[int, tuple] = {}  # training rank 0: results received ahead of their collect
        self._send_buffer: torch.Tensor | None = None
        self.stopped = False

    # ---- generation --------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams, seeds: list[int]) -> Ticket:
        """Collective over the training ranks: send every training rank's prompts as one request."""
        check_generate_args(prompt_token_ids, n, sampling)
        if len(seeds) != len(prompt_token_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_token_ids)} prompts: give one seed per prompt")
        mine = ([list(map(int, p)) for p in prompt_token_ids], [int(s) for s in seeds])
        every = [None] * dist.get_world_size() if self.is_root else None
        dist.gather_object(mine, every, dst=0)
        ticket = Ticket(self._next_id, [len(p) for p, _ in every] if self.is_root else [])
        self._next_id += 1
        if self.is_root:
            self._settle()
            prompts = [p for ps, _ in every for p in ps]
            self.bridge.send(("generate", ticket.id, prompts, n, sampling, [s for _, ss in every for s in ss]), 0)
            self._in_flight = ticket
        self.num_requests += 1
        return ticket

    def collect(self, ticket: Ticket) -> list[PromptRollout]:
        """Collective over the training ranks: this rank's rollouts of `ticket` (waits for them)."""
        shares = None
        if self.is_root:
            if ticket.id not in self._received:
                self._settle()
            rollouts, decoded = self._received.pop(ticket.id)
            self.decoded_tokens += decoded
            shares, at = [], 0
            for count in ticket.counts:
                shares.append(rollouts[at : at + count])
                at += count
        out = [None]
        dist.scatter_object_list(out, shares, src=0)
        return out[0]

    def _generate(self, prompts, n, sampling, seeds):
        return self.collect(self.submit(prompts, n, sampling, seeds))

    def _generate_rows(self, contexts, greedy, sampling, seeds, limits) -> list[Completion]:
        """Collective over the training ranks: every rank's rows as one request, each rank's completions back."""
        every = [None] * dist.get_world_size() if self.is_root else None
        dist.gather_object((contexts, greedy, seeds, limits), every, dst=0)
        ticket = Ticket(self._next_id, [len(part[0]) for part in every] if self.is_root else [])
        self._next_id += 1
        if self.is_root:
            self._settle()
            rows = [[x for part in every for x in part[k]] for k in range(4)]  # contexts, greedy, seeds, limits
            self.bridge.send(("rows", ticket.id, *rows, sampling), 0)
            self._in_flight = ticket
        return self.collect(ticket)

    def generate(self, prompt_token_ids, n, sampling, seeds=None):
        if seeds is None:
            raise ValueError("the remote engine needs one seed per prompt (RolloutDispatch.submit gives them)")
        return self._generate(prompt_token_ids, n, sampling, seeds)

    def _settle(self) -> None:
        """Training rank 0: receive the result of the request in flight (before anything else is sent)."""
        if self._in_flight is None:
            return
        kind, request_id, rollouts, decoded = self.bridge.recv_from(1)
        assert kind == "result" and request_id == self._in_flight.id, (kind, request_id, self._in_flight)
        self._received[request_id] = (rollouts, decoded)
        self._in_flight = None

    # ---- weights -----------------------------------------------------------------------
    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """Collective over the training ranks (the export's); training rank 0 streams the buckets."""
        if not self.is_root:
            for _ in buckets:  # every training rank takes part in the export's gathers and broadcasts
                pass
            return
        self._settle()
        self.bridge.send(("sync",), 0)
        for bucket in buckets:
            header, total = [], 0
            for name, tensor in bucket:
                header.append((name, tuple(tensor.shape), total))
                total += tensor.numel()
            if self._send_buffer is None or self._send_buffer.numel() < total:
                self._send_buffer = torch.empty(total, dtype=self.dtype, device=self.device)
            flat = self._send_buffer[:total]
            for (_, shape, at), (_, tensor) in zip(header, bucket):
                flat[at : at + tensor.numel()].view(shape).copy_(tensor)
            self.bridge.send(("bucket", header, total, str(self.dtype)), 0)
            self.bridge.tensor(flat, 0)
        self.bridge.send(("end",), 0)

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def shutdown(self) -> None:
        """Training rank 0: wait out a request in flight (its batch is dropped), then stop the rollout ranks."""
        if self.is_root and not self.stopped:
            self._settle()
            self._received.clear()
            self.bridge.send(("stop",), 0)
        self.stopped = True


def received_buckets(bridge: Bridge, device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Rollout ranks: the buckets of one sync as (name, view) lists into a reused receive buffer (a view is
    valid until the next bucket is requested), up to the sync's end marker."""
    buffer = None
    while True:
        message = bridge.recv(0)
        if message[0] == "end":
            return
        _, header, total, dtype = message
        dtype = _DTYPES[dtype]
        if buffer is None or buffer.numel() < total or buffer.dtype != dtype:
            buffer = torch.empty(total, dtype=dtype, device=device)  # kept: fresh pages fault on CPU
        flat = buffer[:total]
        bridge.tensor(flat, 0)
        yield [(name, flat[at : at + _numel(shape)].view(shape)) for name, shape, at in header]


def _numel(shape) -> int:
    count = 1
    for s in shape:
        count *= s
    return count


def serve(engine: RolloutEngine, bridge_group) -> int:
    """Rollout ranks: run the training ranks' requests on `engine` until they stop; returns the requests served.

    A request's prompts are split over the rollout ranks in contiguous shares; each rank generates its own
    (the ranks of a rollout.tp engine together, as under colocation), and rollout rank 0 returns them all."""
    bridge = Bridge(bridge_group, engine.device if engine.device.type == "cuda" else torch.device("cpu"))
    world, rank = world_size_and_rank()
    served = 0
    while True:
        message = bridge.recv(0)
        kind = message[0]
        if kind == "stop":
            return served
        if kind == "sync":
            engine.update_weights(received_buckets(bridge, bridge.device))
            continue
        assert kind in ("generate", "rows"), kind
        request_id, count = message[1], len(message[2])
        base, extra = divmod(count, world)
        lo = rank * base + min(rank, extra)
        hi = lo + base + (rank < extra)
        before = engine.decoded_tokens
        # every rank calls the engine, an empty share too: the ranks of a TP engine decode in lockstep
        if kind == "generate":
            _, _, prompts, n, sampling, seeds = message
            rollouts = engine.generate(prompts[lo:hi], n=n, sampling=sampling, seeds=seeds[lo:hi])
        else:  # a turn of multi-turn rollouts (rollout/agent.py): one completion per context
            _, _, contexts, greedy, seeds, limits, sampling = message
            rollouts = engine.generate_rows(contexts[lo:hi], greedy[lo:hi], sampling, seeds[lo:hi], limits[lo:hi])
        engine.sleep()
        # every rank of a TP engine counts its engine's tokens: count each engine once
        decoded = (engine.decoded_tokens - before) / engine.group_size
        shares = [None] * world
        if world > 1:
            dist.all_gather_object(shares, (rollouts, decoded))
        else:
            shares = [(rollouts, decoded)]
        if rank == 0:
            bridge.send_to(
                ("result", request_id, [r for share, _ in shares for r in share], sum(d for _, d in shares)), 0
            )
        served += 1
