"""compile's ``process_group=``: the ranks a step runs on, made to agree before any of them plans.

Every rank compiles its own MemGraph (trace/ranks.py gives it its share of the step), so what the
ranks must share is settled here first, through the process group itself:

- the configuration (devices per rank, device type, budget, the example batch's shapes, the model's
  parameters, the optimizer), compared field by field against rank 0's, so a mismatch is refused
  on every rank naming the first field that differs and the ranks that differ, where it would
  otherwise pair messages of different sizes or hang;
- the weights, broadcast from rank 0 (as DDP's constructor does), so every replica starts equal;
- every pair of ranks' link, set up in one order, and on CUDA its bandwidth, measured once;
- the traced step (its digest), and the one decision a rank makes from its own share that changes
  the step every rank traces (whether the weights' casts travel: if any rank needs them to).

The exchanges carry JSON, never pickles: nothing a rank receives runs code.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..ir.memgraph import MemGraph, Stream
from ..ir.taskgraph import flatten_batch_structure
from ..trace.errors import UnsupportedFeature

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ranks:
    """The process group a step runs over, this process's rank in it, and their count."""

    group: Any
    rank: int
    count: int
    backend: str

    @classmethod
    def of(cls, group) -> Ranks:
        return cls(group, dist.get_rank(group), dist.get_world_size(group), str(dist.get_backend(group)).lower())

    def wire(self, device: torch.device) -> torch.device:
        """Where a tensor sent through the group lives: NCCL moves GPU memory, gloo host memory."""
        return device if "nccl" in self.backend else torch.device("cpu")

    def exchange(self, obj: Any, device: torch.device) -> list[Any]:
        """Every rank's ``obj`` (JSON-able), in rank order."""
        payload = torch.frombuffer(bytearray(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)
        where = self.wire(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=where)
        sizes = [torch.empty_like(size) for _ in range(self.count)]
        dist.all_gather(sizes, size, group=self.group)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=where)
        padded[:payload.numel()] = payload.to(where)
        gathered = [torch.empty_like(padded) for _ in range(self.count)]
        dist.all_gather(gathered, padded, group=self.group)
        return [json.loads(bytes(g[:int(n.item())].cpu().tolist()).decode()) for g, n in zip(gathered, sizes)]


def read_process_group(process_group, device: torch.device) -> Ranks | None:
    """compile's ``process_group=`` checked: None (the default) is the initialized world group if
    there is one; a group of one rank is one process."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    elif not (dist.is_available() and dist.is_initialized()):
        raise UnsupportedFeature("process_group= was given but torch.distributed is not initialized: call "
                                 "torch.distributed.init_process_group first (torchrun sets up its environment)")
    ranks = Ranks.of(process_group)
    if ranks.count == 1:
        return None
    wanted = "nccl" if device.type == "cuda" else "gloo"
    if wanted not in ranks.backend:
        raise UnsupportedFeature(f"a step on {device.type} over {ranks.count} ranks sends its messages through "
                                 f"{wanted}; this process group's backend is {ranks.backend!r}: initialize it "
                                 f"with backend={wanted!r}")
    return ranks


def connect(ranks: Ranks, device: torch.device) -> None:
    """Set up every pair of ranks' link now, one pair at a time in one order on every rank. NCCL sets
    up a pair's communicator at its first message, blocking the host until the peer does too: the
    first step would pay it, one pair after another as its messages come."""
    token = torch.zeros(1, dtype=torch.uint8, device=ranks.wire(device))
    for low in range(ranks.count):
        for high in range(low + 1, ranks.count):
            if ranks.rank not in (low, high):
                continue
            peer = high if ranks.rank == low else low
            if ranks.rank == low:
                dist.send(token, group=ranks.group, group_dst=peer)
            else:
                dist.recv(token, group=ranks.group, group_src=peer)


def configuration(model: torch.nn.Module, example_batch, optimizer, device: torch.device, devices: int,
                  budget, options: dict) -> dict:
    """What every rank must give compile alike, as JSON: compared by `agree`."""
    leaves, spec = flatten_batch_structure(example_batch)
    return {
        "device type": device.type,
        "devices per rank": devices,
        "budget": repr(budget),
        "example batch": [[list(x.shape), str(x.dtype)] if isinstance(x, torch.Tensor) else repr(x) for x in leaves],
        "example batch structure": str(spec),
        "model parameters": [[name, list(t.shape), str(t.dtype), t.requires_grad]
                             for name, t in model.named_parameters()],
        "model buffers": [[name, list(t.shape), str(t.dtype)] for name, t in model.named_buffers()],
        "optimizer": None if optimizer is None else [type(optimizer).__name__, [
            {k: repr(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]],
        "options": {k: repr(v) for k, v in sorted(options.items())},
    }


def agree(ranks: Ranks, mine: dict, device: torch.device, what: str = "compile's arguments") -> None:
    """Refuse, on every rank alike, a ``mine`` that differs between ranks: naming the first field
    that differs from rank 0's and the ranks whose value differs."""
    every = ranks.exchange(mine, device)
    for key in every[0]:
        values = [json.dumps(r.get(key), sort_keys=True) for r in every]
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            ours, theirs = every[0].get(key), every[differ[0]].get(key)
            where = ""
            if isinstance(ours, list) and isinstance(theirs, list):  # the first entry that differs
                i = next(i for i in range(max(len(ours), len(theirs)))
                         if i >= len(ours) or i >= len(theirs) or ours[i] != theirs[i])
                where = f" at entry {i}"
                ours = ours[i] if i < len(ours) else "nothing"
                theirs = theirs[i] if i < len(theirs) else "nothing"
            raise UnsupportedFeature(
                f"the {ranks.count} ranks must compile alike, and {what} differ in {key!r}{where}: rank 0 has "
                f"{_short(ours)}, rank {differ[0]} has {_short(theirs)}"
                + (f" (ranks {differ} differ from rank 0)" if len(differ) > 1 else ""))


def _short(value: Any, limit: int = 300) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def broadcast_weights(model: torch.nn.Module, ranks: Ranks, device: torch.device) -> None:
    """rank 0's parameters and buffers into every rank's model, in place (as DDP's constructor)."""
    source = dist.get_global_rank(ranks.group, 0)
    wire = ranks.wire(device)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type != wire.type:
                moved = tensor.detach().to(wire)
                dist.broadcast(moved, src=source, group=ranks.group)
                tensor.copy_(moved)
            else:
                dist.broadcast(tensor.detach(), src=source, group=ranks.group)


def check_message_order(mg: MemGraph) -> None:
    """A rank's MemGraph posts its messages in tag order (the engine runs them so, and every rank
    the same): its serial order must have them so, or a rank would wait on a message it posts later."""
    tasks = mg.taskgraph.vertices
    tags = [tasks[mv.task_vertex].kwargs["tag"] for mv in (mg.vertices[vid] for vid in mg.serial)
            if mv.stream is Stream.COMM]
    if tags != sorted(tags):
        first = next(i for i in range(1, len(tags)) if tags[i] < tags[i - 1])
        raise RuntimeError(f"internal error: the built step of rank {mg.taskgraph.rank} posts message {tags[first]} "
                           f"after message {tags[first - 1]}; its messages must keep the order every rank shares")


RANK_LINK_BYTES = 256 << 20
RANK_LINK_RUNS = 3


def measure_rank_bandwidth(ranks: Ranks, device: torch.device) -> float:
    """Bytes/s of a message between ranks 0 and 1 (each way, by a round trip of RANK_LINK_BYTES, the
    best of RANK_LINK_RUNS), as every rank learns it from rank 0: the planners' and the simulator's
    figure for every pair of ranks."""
    seconds = 0.0
    if ranks.rank < 2:
        peer = 1 - ranks.rank
        payload = torch.empty(RANK_LINK_BYTES, dtype=torch.uint8, device=device)
        best = float("inf")
        for run in range(RANK_LINK_RUNS + 1):  # the first round sets up the pair's communicator
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            for turn in (0, 1):
                if ranks.rank == turn:
                    dist.send(payload, group=ranks.group, group_dst=peer)
                else:
                    dist.recv(payload, group=ranks.group, group_src=peer)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if run:
                best = min(best, time.perf_counter() - started)
        seconds = best / 2
    measured = ranks.exchange(seconds, device)[0]
    bandwidth = RANK_LINK_BYTES / measured
    log.info("messages between ranks: %.1f GB/s each way (measured between ranks 0 and 1)", bandwidth / 1e9)
    return bandwidth


def gather_state_dict(mg: MemGraph, dst: int = 0) -> dict | None:
    """The whole model's state dict, on rank ``dst`` of a MemGraph compiled over several ranks (each
    rank's ``mg.state_dict()`` holds its share: the parameters it owns, their replicas aside); None
    on the other ranks. Every rank calls it."""
    return _gathered(mg, mg.state_dict(), dst)


def gather_optimizer_state_dict(mg: MemGraph, dst: int = 0) -> dict | None:
    """The whole optimizer's state dict (torch.optim's form, as ``mg.optimizer.state_dict()`` gives
    it on one process), on rank ``dst``; None on the other ranks. Every rank calls it."""
    if mg.optimizer is None:
        raise ValueError("this MemGraph was compiled without an optimizer: it has no optimizer state")
    mine = mg.optimizer.state_dict()
    flat = {f"{index}/{key}": value if isinstance(value, torch.Tensor) else torch.tensor(value)
            for index, state in mine["state"].items() for key, value in state.items()}
    every = _gathered(mg, flat, dst)
    if every is None:
        return None
    state: dict[int, dict] = {}
    for name, value in every.items():
        index, key = name.split("/", 1)
        state.setdefault(int(index), {})[key] = value
    return {"state": dict(sorted(state.items())), "param_groups": mine["param_groups"]}


def _gathered(mg: MemGraph, local: dict, dst: int) -> dict | None:
    """Every rank's ``local`` (name -> tensor) merged on rank ``dst``, in rank order."""
    group = mg.process_group
    if group is None:
        raise ValueError("this MemGraph runs in one process: its state_dict() is the whole state")
    ranks = Ranks.of(group)
    if not 0 <= dst < ranks.count:
        raise ValueError(f"dst={dst} is not a rank of this step's {ranks.count} ranks")
    device = torch.device(mg.device)
    wire = ranks.wire(device)
    listed = ranks.exchange([[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in local.items()],
                            device)
    if ranks.rank != dst:
        for tensor in local.values():
            dist.send(tensor.contiguous().to(wire), group=group, group_dst=dst)
        return None
    merged = dict(local)
    for peer in range(ranks.count):
        if peer == dst:
            continue
        for name, shape, dtype in listed[peer]:
            buffer = torch.empty(shape, dtype=getattr(torch, dtype), device=wire)
            dist.recv(buffer, group=group, group_src=peer)
            merged[name] = buffer.cpu()
    return merged
