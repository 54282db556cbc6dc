"""Pinned host memory: what this host may pin (engine/host_memory.py), and compile's decision when a
plan pins more (memgraph/compile.within_host): plan again within the host's memory, or refuse
clearly before any step runs."""

from __future__ import annotations

import pytest
import torch
from turnip.engine.host_memory import RESERVE_MIN, describe_host, host_memory, pinnable_bytes
from turnip.ir.errors import InfeasibleBudget
from turnip.memgraph.compiler import GIB, within_host

MEMINFO = """MemTotal:       131072000 kB
MemFree:         2000000 kB
MemAvailable:   100000000 kB
Buffers:          100000 kB
HugePages_Total:       0
"""


def test_meminfo_is_read_in_bytes(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO)
    assert host_memory(path) == (131072000 * 1024, 100000000 * 1024)


def test_pinnable_keeps_a_reserve():
    total, available = 128 * GIB, 100 * GIB
    assert pinnable_bytes((total, available)) == available - int(0.10 * total)  # 12.8 GiB reserve
    assert pinnable_bytes((16 * GIB, 10 * GIB)) == 10 * GIB - RESERVE_MIN  # at least 4 GiB kept
    assert pinnable_bytes((16 * GIB, 2 * GIB)) == 0
    assert "may be pinned" in describe_host((total, available))


def test_this_host_reports_something_sane():
    memory = host_memory()
    if memory is None:
        pytest.skip("this system does not report its memory")
    total, available = memory
    assert 0 < available <= total


def test_a_plan_within_the_host_is_left_alone():
    assert within_host(10 * GIB, 20 * GIB, None, replannable=True) is None
    assert within_host(10 * GIB, None, None, replannable=True) is None  # unknown host, or a CPU plan


def test_a_plan_over_the_host_is_planned_again_within_it_in_whole_gib():
    assert within_host(30 * GIB, 20 * GIB + 12345, None, replannable=True) == 20 * GIB


def test_refused_when_planning_again_cannot_help():
    with pytest.raises(InfeasibleBudget, match=r"pinned host memory within cpu_budget='40GiB'") as info:
        within_host(30 * GIB, 20 * GIB, "40GiB", replannable=True)  # the user fixed the CPU budget
    assert info.value.resource == "cpu" and info.value.minimum == 30 * GIB
    with pytest.raises(InfeasibleBudget, match="larger GPU budget"):
        within_host(30 * GIB, 20 * GIB, None, replannable=False)  # nothing was planned


def test_huge_page_buffer_is_aligned_writable_and_exactly_sized():
    from turnip.engine.cuda import HUGE_PAGE, _huge_page_buffer

    buf = _huge_page_buffer(3 * HUGE_PAGE + 123)
    assert buf.numel() == 3 * HUGE_PAGE + 123 and buf.dtype is torch.uint8
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert buf.untyped_storage().data_ptr() == buf.data_ptr()  # registered from the storage's first byte
    buf.fill_(7)
    assert int(buf[-1]) == 7 and int(buf.sum()) == 7 * buf.numel()
