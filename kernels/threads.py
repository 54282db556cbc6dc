"""Intra-op threads for kernels run beside the engine's loop thread (the host lane's optimizer updates)."""

from __future__ import annotations

import torch


def host_threads() -> int:
    """Intra-op threads for the host lane's kernels: one fewer than torch uses, since the loop thread
    keeps a core busy polling; a kernel split over every core waits for the chunk that shares it
    (bench/results/h100: gpt350m at 25% with every update on the host, 477 ms on 16 threads, 295 ms
    on 14)."""
    return max(1, torch.get_num_threads() - 1)


def set_kernel_threads(threads: int) -> None:
    """The intra-op thread count of kernels the calling thread runs: torch.set_num_threads, whose
    OpenMP part is a setting of the calling thread. Its MKL part is the process's: a CPU matmul
    elsewhere then also runs on ``threads`` threads (the host lane is created only for plans with
    host updates). Setting OpenMP's count alone, through ctypes, measured slower on the H100 machine
    (gpt350m at 25% with every update on the host: 274 ms this way, 424 and 509 ms through ctypes)."""
    torch.set_num_threads(threads)
