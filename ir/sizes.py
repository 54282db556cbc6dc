"""Sizes derived from a TaskGraph and a budget, each computed here and nowhere else.

- ``aligned``: the bytes a value takes in an arena (at least one alignment unit, so a 0-byte value
  still has a place of its own);
- ``arena_capacity``: the arena bytes a GPU budget leaves once the step's workspace is set aside.

The smallest budget any plan can run in is ``planners.driver.smallest_budget`` (a planner's input);
the smallest for one plan is ``memgraph.schedule.Schedule.plan_floor`` (the builder's). The two agree
on a plan that homes every weight on the CPU (tests/test_budget_parsing.py pins them together).
"""

from __future__ import annotations


def aligned(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``, at least one unit."""
    alignment = max(1, int(alignment))
    return -(-max(int(nbytes), 1) // alignment) * alignment


def arena_capacity(gpu_budget: int, step_workspace: int, alignment: int) -> int:
    """Arena bytes within ``gpu_budget``: the budget less the step's workspace (the largest op
    workspace plus the runtime's reserve, ``TaskGraph.step_workspace()``), rounded down to the alignment."""
    alignment = max(1, int(alignment))
    return (gpu_budget - step_workspace) // alignment * alignment
