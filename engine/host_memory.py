"""How much page-locked host memory a plan may take on this machine.

Pinned memory cannot be swapped out, so a plan whose CPU storage is larger than what the host
has free would fail when the engine pins it, after compile, or push the rest of the machine into
swap. ``pinnable_bytes`` is the figure compile checks a plan against: the memory the kernel
reports available (MemAvailable: free pages plus caches it can drop) less a reserve for everything
else the process and machine still need (the model's own CPU copy, batches, the Python heap).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..ir.budget import format_bytes

RESERVE_FRACTION = 0.10  # of the host's total memory, kept out of reach of pinning
RESERVE_MIN = 4 << 30  # bytes, kept at least


def host_memory(meminfo: str | Path = "/proc/meminfo") -> tuple[int, int] | None:
    """(total, available) bytes of host memory, or None where the system does not say (not Linux).
    Where /proc/meminfo is missing, sysconf gives total and free pages (free undercounts
    available: it leaves out the page cache)."""
    try:
        fields = {}
        for line in Path(meminfo).read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        if "MemTotal" in fields and "MemAvailable" in fields:
            return fields["MemTotal"], fields["MemAvailable"]
    except OSError:
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        return None


def pinnable_bytes(memory: tuple[int, int] | None = None) -> int | None:
    """Bytes a plan's pinned CPU storage may take here: available memory less the reserve
    (RESERVE_FRACTION of the total, at least RESERVE_MIN); None when the host does not say."""
    memory = memory if memory is not None else host_memory()
    if memory is None:
        return None
    total, available = memory
    return max(0, available - max(RESERVE_MIN, int(RESERVE_FRACTION * total)))


def describe_host(memory: tuple[int, int] | None = None) -> str:
    memory = memory if memory is not None else host_memory()
    if memory is None:
        return "this host does not report its memory"
    total, available = memory
    limit = pinnable_bytes(memory)
    return (f"this host has {format_bytes(available)} of {format_bytes(total)} available, of which "
            f"{format_bytes(limit)} may be pinned (a reserve of {format_bytes(available - limit)} stays free)")
