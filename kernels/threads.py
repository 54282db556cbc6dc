"""Intra-op threads for kernels run beside the engine's loop thread (the host lane's optimizer updates)."""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)


def host_threads() -> int:
    """Intra-op threads for the host lane's kernels: one fewer than torch uses, since the loop thread
    keeps a core busy polling; a kernel split over every core waits for the chunk that shares it
    (bench/results/h100: gpt350m at 25% with every update on the host, 477 ms on 16 threads, 295 ms
    on 14)."""
    return max(1, torch.get_num_threads() - 1)


def limit_openmp_threads(threads: int) -> None:
    """OpenMP's thread count for parallel regions the calling thread starts (an OpenMP setting of that
    thread alone), through the OpenMP runtime torch is linked with. Not torch.set_num_threads: that
    also sets MKL's count for the whole process, and a CPU matmul elsewhere would then sum in
    another order. A torch without OpenMP keeps its own count."""
    try:
        setter = ctypes.CDLL(torch._C.__file__).omp_set_num_threads
    except (OSError, AttributeError):
        log.info("torch's intra-op threads are not OpenMP's here: the host lane uses %d threads",
                 torch.get_num_threads())
        return
    setter(int(threads))
