"""How fast the host runs the loop's kind of Python right now, and what else wants its cores.

On two H200s one MemGraph's event loop spent 46 us per launch in one process and 92 in another
(gpt1.3b at 25% per GPU, bench/results/2026-11-29_h200x2_reserved-within-budget-loop-variance.md):
every function of the loop took about twice as long, so the host ran the same Python at half speed,
and nothing in the process said why. A row that records this probe before and after its timed steps
says whether the host was slow (the fixed workload took longer), busy (runnable threads beyond its
cores, the load average) or clocked down (the cores' MHz where Linux reports them).

    host_probe()  # {"python_us": ..., "loadavg_1m": ..., "runnable": ..., "cpus": ..., "cpu_mhz": ...,
                  #  "cpu_now": ..., "jiffies": {"busy": ..., "idle": ..., "steal": ...}}
    python -m turnip.bench.host_probe --by-cpu   # the workload on each allowed CPU in turn
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


def cpu_now() -> int | None:
    """The CPU this process last ran on (/proc/self/stat's 39th field; None off Linux)."""
    try:
        return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


def _cpu_jiffies() -> dict | None:
    """The host's CPU time so far, all cores, in clock ticks (/proc/stat's first line): busy, idle, and
    steal, the time a hypervisor ran something else on this machine's virtual CPUs. Two probes' difference
    says what share of the time between them was stolen (None off Linux)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return {"busy": user + nice + system + irq + softirq, "idle": idle + iowait, "steal": steal}


def host_probe() -> dict:
    """The probe's figures now (see the module docstring)."""
    return {"python_us": python_us(), "loadavg_1m": os.getloadavg()[0], "runnable": _runnable(),
            "cpus": len(os.sched_getaffinity(0)), "cpu_mhz": _cpu_mhz(), "cpu_now": cpu_now(),
            "jiffies": _cpu_jiffies()}


def _node_of(cpu: int) -> int | None:
    """The NUMA node of logical CPU ``cpu`` (sysfs; None where Linux does not say)."""
    try:
        nodes = [p.name for p in Path(f"/sys/devices/system/cpu/cpu{cpu}").iterdir() if p.name.startswith("node")]
    except OSError:
        return None
    return int(nodes[0][4:]) if nodes else None


def python_us_by_cpu() -> list[dict]:
    """The fixed workload on each CPU this process may use, the calling thread pinned to it in turn (its
    affinity put back after): whether some cores run the loop's Python slower than others, which would
    make a process's speed depend on where the scheduler first put it. One row per CPU: cpu, node, us."""
    allowed = sorted(os.sched_getaffinity(0))
    rows = []
    try:
        for cpu in allowed:
            os.sched_setaffinity(0, {cpu})
            rows.append({"cpu": cpu, "node": _node_of(cpu), "python_us": python_us()})
    finally:
        os.sched_setaffinity(0, allowed)
    return rows


def main(argv=None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--by-cpu", action="store_true", help="the workload on every allowed CPU in turn")
    parser.add_argument("--out", default=None, help="JSON file (default: printed)")
    args = parser.parse_args(argv)
    result = {"probe": host_probe()}
    if args.by_cpu:
        result["by_cpu"] = python_us_by_cpu()
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
