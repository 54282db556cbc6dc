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
    """The intra-op thread count of the calling thread's kernels, through OpenMP's own setting (one
    per thread), in the OpenMP runtime torch uses: the first ``omp_set_num_threads`` among torch's
    library and the libgomp copies mapped into the process after which torch reads the new count.
    Not torch.set_num_threads, which also sets MKL's count for the whole process (a CPU matmul
    elsewhere would then sum in another order); that only where no OpenMP setter takes, logged."""
    for path in _openmp_candidates():
        try:
            setter = ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        setter(int(threads))
        if torch.get_num_threads() == threads:
            return
    log.info("no OpenMP setter of this thread reaches torch's kernels: torch.set_num_threads(%d), which also "
             "sets MKL's thread count for the process", threads)
    torch.set_num_threads(threads)


def _openmp_candidates() -> list[str]:
    """torch's extension (its dependencies resolve the symbol), then every libgomp mapped here
    (a wheel bundles its own copy under a hashed name; another library may have loaded the system's)."""
    paths = [torch._C.__file__]
    try:
        with open("/proc/self/maps") as maps:
            mapped = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    except OSError:
        mapped = set()
    return paths + sorted(mapped, key=lambda p: "torch" not in p)
