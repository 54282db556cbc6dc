"""A message to or from another rank (TaskGraph SEND / RECV, trace/ranks.py) through torch.distributed.

Bound once like a PreparedVertex (the same call), to the arena view it sends from or receives into.
The send and the receive of one message carry the same tag, the message's position among the step's
messages: the engine runs each rank's messages in tag order on one lane, so every pair of ranks
posts its messages in the same order (NCCL pairs them by that order; gloo by tag as well).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..ir.taskgraph import SEND, TensorRef, Vertex


class MessageError(RuntimeError):
    """A message another rank did not answer: it stopped, hung past the group's timeout, or failed."""


class PreparedMessage:
    """A SEND or RECV vertex bound to its buffer and the process group of the step's ranks."""

    def __init__(self, vertex: Vertex, resolve: Callable[[TensorRef], torch.Tensor],
                 outputs: Sequence[torch.Tensor | None], group):
        self.vertex = vertex
        self.sends = vertex.op == SEND
        self.peer = int(vertex.kwargs["peer"])
        self.tag = int(vertex.kwargs["tag"])
        self.buffer = resolve(vertex.args[0]) if self.sends else outputs[0]
        if self.buffer is None or not self.buffer.is_contiguous():
            raise ValueError(f"vertex {vertex.id} ({vertex.op}): a message needs a dense buffer")
        self.group = group

    def __call__(self, scalars, rng_state, device: torch.device) -> None:
        try:
            if self.sends:
                dist.send(self.buffer, group=self.group, group_dst=self.peer, tag=self.tag)
            else:
                dist.recv(self.buffer, group=self.group, group_src=self.peer, tag=self.tag)
        except (RuntimeError, dist.DistBackendError) as err:
            me = dist.get_rank(self.group)
            what = (f"sending {self.buffer.nbytes} bytes to rank {self.peer}" if self.sends
                    else f"receiving {self.buffer.nbytes} bytes from rank {self.peer}")
            raise MessageError(f"rank {me}: {what} (message {self.tag} of the step) failed: rank {self.peer} "
                               f"stopped, or did not answer within the process group's timeout ({err})") from err
