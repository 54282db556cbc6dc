"""The host's lane on the CUDA backend: vertices of Stream.HOST (optimizer updates on pinned CPU storage).

A CUDA stream runs its work in order and the loop sees it finish through an event; the host lane
mimics that shape so engine/completions.py keeps one set of books: ``HostStream`` is a worker
thread that runs the units given to it in order (``query``/``synchronize`` like a stream), and
each host unit's entry in the runtime's event list is a ``HostDone`` flag (``query`` like an event).

A host unit is reported to the loop only once it has run (its lane has no launch-ahead), so no
CUDA stream ever has to wait on the device for host work. Before it runs, the worker waits on the
events of its GPU predecessors that the loop has not seen finish (a gradient's copy to pinned
memory is still on the link when the loop, reporting copies at enqueue, launches the update).
torch's CPU kernels release the GIL, so the loop thread keeps launching while the host computes.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable

import torch

from ..kernels.threads import kernel_threads


class HostDone:
    """Set when a host unit has run; stands in the runtime's event list for that unit."""

    __slots__ = ("_flag",)

    def __init__(self):
        self._flag = threading.Event()

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        self._flag.wait()

    def clear(self) -> None:
        self._flag.clear()

    def set(self) -> None:
        self._flag.set()


class HostStream:
    """A worker thread running submitted jobs in order; ``query``/``synchronize`` as a CUDA stream's."""

    host = True  # completions.Lane reads it: no launch-ahead, no cudaLaunchHostFunc
    cuda_stream = None

    def __init__(self, name: str, threads: int | None = None):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._threads = threads
        self._restore = torch.get_num_threads()  # the process's count, set back after each job
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._idle:
            self._pending += 1
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                threads = (contextlib.nullcontext() if self._threads is None
                           else kernel_threads(self._threads, self._restore))
                with threads:
                    job()  # a job reports its own failure (CudaRuntime._host_job): nothing escapes here
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def query(self) -> bool:
        return self._pending == 0

    def synchronize(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def close(self) -> None:
        self.synchronize()
        self._jobs.put(None)
        self._thread.join(timeout=5)
