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
    device = torch.cuda.current_device()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()  # known, to end it on failure
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        launch()
    finally:
        try:
            with warnings.catch_warnings():  # ops that launch nothing (empty_like) make an empty graph: fine
                warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                graph.capture_end()
        except BaseException:
            _stop_allocating_to(device, pool)  # graph.pool() refuses to answer after a failed capture
            raise
    return graph


def _stop_allocating_to(device: int, pool: tuple) -> None:
    """End the caching allocator's capture into ``pool`` after a capture that failed. torch's
    capture_end raises on an invalidated capture before it ends it, and the allocator then counts
    the capture as underway for good: it aborts the process at its next synchronize of freed blocks
    ("captures_underway.empty() INTERNAL ASSERT FAILED", gpt1.3b on two H200s at 10%, when the step
    released its memory)."""
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError:  # capture_end failed after ending it itself ("not currently recording")
        pass
