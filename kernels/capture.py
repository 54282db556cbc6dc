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
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        launch()
    finally:
        with warnings.catch_warnings():  # ops that launch nothing (empty_like) make an empty graph: fine
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            graph.capture_end()
    return graph
