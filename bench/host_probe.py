"""How fast the host runs the loop's kind of Python right now, and what else wants its cores.

On two H200s one MemGraph's event loop spent 46 us per launch in one process and 92 in another
(gpt1.3b at 25% per GPU, bench/results/2026-11-29_h200x2_reserved-within-budget-loop-variance.md):
every function of the loop took about twice as long, so the host ran the same Python at half speed,
and nothing in the process said why. A row that records this probe before and after its timed steps
says whether the host was slow (the fixed workload took longer), busy (runnable threads beyond its
cores, the load average) or clocked down (the cores' MHz where Linux reports them).

    host_probe()  # {"python_us": ..., "loadavg_1m": ..., "runnable": ..., "cpus": ..., "cpu_mhz": ...}
"""

from __future__ import annotations

import collections
import os
import time
from pathlib import Path

WORKLOAD_ITEMS = 2_000  # about 0.3-1 ms of Python: short beside a step, long beside the timer
REPEATS = 5


def python_us() -> float:
    """Microseconds the fastest of REPEATS runs of a fixed workload took: dict reads and writes, deque
    appends and pops, attribute reads and small calls, as the loop does per launch."""

    class Unit:
        __slots__ = ("id", "ready")

        def __init__(self, uid: int) -> None:
            self.id, self.ready = uid, False

    def mark(unit: Unit) -> int:
        unit.ready = True
        return unit.id

    units = [Unit(k) for k in range(WORKLOAD_ITEMS)]
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        seen, queue = {}, collections.deque()
        for unit in units:
            queue.append(unit)
            seen[unit.id] = seen.get(unit.id - 1, 0) + 1
        while queue:
            mark(queue.popleft())
        best = min(best, time.perf_counter() - started)
    return best * 1e6


def _runnable() -> int | None:
    """Threads runnable on the whole host now (/proc/stat procs_running; None off Linux)."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("procs_running"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _cpu_mhz() -> float | None:
    """The cores' mean clock as Linux reports it (/proc/cpuinfo; None where it does not)."""
    try:
        mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("cpu MHz")]
    except (OSError, ValueError):
        return None
    return sum(mhz) / len(mhz) if mhz else None


def host_probe() -> dict:
    """The probe's figures now (see the module docstring)."""
    return {"python_us": python_us(), "loadavg_1m": os.getloadavg()[0], "runnable": _runnable(),
            "cpus": len(os.sched_getaffinity(0)), "cpu_mhz": _cpu_mhz()}
