"""Capture a run of kernel launches as one CUDA graph (the engine's segments, the cost model's timing)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


def captured(launch: Callable[[], None], pool: tuple | None = None) -> torch.cuda.CUDAGraph:
    """``launch()`` captured on the current stream (which must not be the legacy default stream),
    its temporaries from ``pool`` (a torch.cuda.graph_pool_handle or a MemPool's id; None: a private pool).
    Thread-local capture, so another thread's CUDA calls do not break it. Nothing runs: replay
    the graph for that. Raises whatever the capture raises; the stream is left capturing nothing."""
    graph = torch.cuda.CUDAGraph()
    device = torch.cuda.current_device()  # the capture's: its pool is marked on this device
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        launch()
    finally:
        with warnings.catch_warnings():  # ops that launch nothing (empty_like) make an empty graph: fine
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            try:
                graph.capture_end()
            except Exception:
                if pool is not None:
                    _stop_allocating_to(device, pool)
                raise
    return graph


def _stop_allocating_to(device: int, pool: tuple) -> None:
    """End the allocator's capture into ``pool`` that a failed capture left open: torch's capture_end
    raises before it ends it, and a pool left so refuses every later capture or use_mem_pool
    ("beginAllocateToPool: already recording to mempool_id": gpt1.3b on four H100s at 10% lost
    its step 2 so). torch.cuda.use_mem_pool ends its pool with the same call."""
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError:  # the capture failed before it began allocating to the pool: nothing is open
        pass
