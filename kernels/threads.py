"""Intra-op threads for kernels run beside the engine's loop thread (the host lane's optimizer updates)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def host_threads() -> int:
    """Intra-op threads for the host lane's kernels: one fewer than torch uses, since the loop thread
    keeps a core busy polling; a kernel split over every core waits for the chunk that shares it
    (bench/results/h100: gpt350m at 25% with every update on the host, 477 ms on 16 threads, 295 ms
    on 14)."""
    return max(1, torch.get_num_threads() - 1)


@contextlib.contextmanager
def kernel_threads(threads: int, restore: int) -> Iterator[None]:
    """Run the calling thread's kernels on ``threads`` intra-op threads, then set ``restore`` again.

    torch.set_num_threads sets OpenMP's count for the calling thread and, with some MKL builds (the
    H100 machine's), MKL's for the whole process: left at ``threads``, a CPU matmul anywhere in the
    process would run on that many threads afterwards, and sum differently from eager's (a CPU test
    that ran after a CUDA test's host lane differed from eager by 7e-10,
    bench/results/test_logs/cuda_tests_decf6b0.txt). So the count is set back after every job. Setting
    OpenMP's count alone, through ctypes, measured slower on the H100 machine (gpt350m at 25% with
    every update on the host: 274 ms this way, 424 and 509 ms through ctypes)."""
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(restore)
