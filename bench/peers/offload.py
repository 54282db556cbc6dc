"""Activation offloading with torch.autograd.graph.save_on_cpu(pin_memory=True), alone and with checkpointing.

save_on_cpu copies every tensor autograd saves to pinned host memory at pack time
and back at unpack time. With per-block checkpointing (non-reentrant) the only
tensors saved inside a block are the block's inputs, so "checkpoint + offload"
keeps one activation per block, on the CPU. The real save_on_cpu hooks do the
work; this module only wraps them to count the bytes each way.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import eager
from .checkpoint import checkpoint_blocks
from .common import PeerResult, Workload


@dataclass
class ByteCounter:
    device_type: str  # count tensors on this device (the ones that cross the link on CUDA)
    h2d: int = 0
    d2h: int = 0

    def reset(self) -> None:
        self.h2d = self.d2h = 0


def counted_save_on_cpu(counter: ByteCounter):
    """torch.autograd.graph.save_on_cpu(pin_memory=True) whose hooks also add up the bytes they copy."""
    ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
    pack, unpack = ctx.pack_hook, ctx.unpack_hook

    def counting_pack(tensor):
        if tensor.device.type == counter.device_type:
            counter.d2h += tensor.numel() * tensor.element_size()
        return pack(tensor)

    def counting_unpack(packed):
        tensor = unpack(packed)
        if tensor.device.type == counter.device_type:
            counter.h2d += tensor.numel() * tensor.element_size()
        return tensor

    # saved_tensors_hooks.__enter__ reads these attributes, so replacing them before entering is enough
    ctx.pack_hook, ctx.unpack_hook = counting_pack, counting_unpack
    return ctx


def _run(system: str, workload: Workload, device, steps: int, with_checkpoint: bool, **kw) -> PeerResult:
    counter = ByteCounter(torch.device(device).type)

    @contextlib.contextmanager
    def forward_context():
        counter.reset()  # per step: the last step's counts are reported
        with counted_save_on_cpu(counter):
            yield

    def read_counts(result: PeerResult) -> None:
        result.bytes_h2d, result.bytes_d2h = counter.h2d, counter.d2h

    prepare = checkpoint_blocks if with_checkpoint else None
    return eager.run_with(system, workload, device, steps, prepare=prepare, forward_context=forward_context,
                          after_step=read_counts, **kw)


def run(workload: Workload, device, steps: int, **kw) -> PeerResult:
    return _run("offload", workload, device, steps, with_checkpoint=False, **kw)


def run_checkpoint_offload(workload: Workload, device, steps: int, **kw) -> PeerResult:
    return _run("checkpoint_offload", workload, device, steps, with_checkpoint=True, **kw)
