"""One memory pool per compute lane for the temporaries its kernels allocate.

The arena holds every value of a step; what the caching allocator still hands out are the temporaries
ops allocate inside themselves (an attention backward's workspace, a reduction's partials: the op
workspace the cost model measures). Left to torch, they would come from two places: kernels launched
plainly from the default pool of their stream, kernels captured in a segment's CUDA graph from the
graph's private pool. Each keeps its own free blocks, and neither merges blocks of different sizes
that arrive smallest first: gpt1.3b on two H100s reserved 0.82 GB in the first and 0.76 GB in the
second beside a largest op workspace of 0.52 GB, and went 1.4 GB per GPU over its budget (the
reserved peak against the allocated one; scratch diagnosis of 2026-11-28).

So each compute lane (one CUDA stream instance) gets one torch.cuda.MemPool: its plain launches
allocate from it (use_mem_pool) and its segments are captured into it. Sharing is safe for the
reason one graph pool per stream is: the lane's work runs in stream order, so a block a graph's
kernels use is never in use by a plain launch at the same time. And the pool is first given one
block (``ir.sizes.lane_block``: the step's largest op workspace and the library workspaces), which
the temporaries then split and give back, so the lane reserves what the budget set aside for
workspace rather than a block per size. The library workspaces belong in that block: cuBLAS takes
its 32 MiB from the lane's pool on the first matmul, and keeps it; with a block of the largest op
workspace alone, gpt1.3b on two H200s then reserved a second 72 MiB segment per GPU for an op's
temporaries (bench/results/h200x2/s17/call3/reserved_100.json).
"""

from __future__ import annotations

import contextlib

import torch


class LanePools:
    """The memory pool of each compute lane (key: the engine's (stream key, instance))."""

    def __init__(self, block: int):
        self.block = block  # bytes each prewarmed pool is first given (ir.sizes.lane_block)
        # (pool, device index): use_mem_pool turns a torch.device into its index in Python on every
        # call (8 us a plain launch in a profile on two H200s), an int it takes as it is
        self.pools: dict[tuple, tuple[torch.cuda.MemPool, int]] = {}
        self.retired: list[torch.cuda.MemPool] = []  # pools a failed capture left unusable (kept: see renew)

    def add(self, lane: tuple, stream: torch.cuda.Stream, prewarm: bool) -> None:
        """Make the pool of ``lane``, whose kernels run on ``stream``. prewarm: give it its first
        block (where the lane is its device's only compute lane: with several, each would hold one)."""
        with torch.cuda.device(stream.device):  # a MemPool exists on the device current when it is made
            pool = torch.cuda.MemPool()
        self.pools[lane] = (pool, stream.device.index)
        if prewarm and self.block > 0:
            with torch.cuda.use_mem_pool(pool, stream.device), torch.cuda.stream(stream):
                block = torch.empty(self.block, dtype=torch.uint8, device=stream.device)
                del block  # its segment stays in the pool, free for the lane's temporaries

    def renew(self, lane: tuple) -> None:
        """Give ``lane`` a new pool after a capture into its pool failed. torch's capture_end raises
        before it stops the allocator capturing into the pool, and a pool left so refuses every
        later capture and use_mem_pool ("beginAllocateToPool: already recording to mempool_id":
        gpt1.3b on two H100s at 25% lost its second step so). kernels/capture.py now ends that
        capture itself (without it, freeing the pool aborted the process), so this new pool may no
        longer be needed; it stays until a GPU run shows the old pool serving again. The old pool
        is kept (its blocks, a workspace's worth at most, stay reserved) and freed with the others
        at release. Not prewarmed."""
        old, device = self.pools[lane]
        self.retired.append(old)
        with torch.cuda.device(device):
            self.pools[lane] = (torch.cuda.MemPool(), device)

    def handle(self, lane: tuple) -> tuple:
        """The id a capture takes as its pool (torch.cuda.graph's pool argument)."""
        return self.pools[lane][0].id

    def allocating_from(self, lane: tuple) -> contextlib.AbstractContextManager:
        """A context in which this thread's allocations on the lane's device come from its pool."""
        pool, device = self.pools[lane]
        return torch.cuda.use_mem_pool(pool, device)

    def clear(self) -> None:
        self.pools.clear()
        self.retired.clear()
