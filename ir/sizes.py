"""Sizes derived from a TaskGraph and a budget, each computed here and nowhere else.

- ``aligned``: the bytes a value takes in an arena (at least one alignment unit, so a 0-byte value
  still has a place of its own);
- ``arena_capacity``: the arena bytes a GPU budget leaves once the step's workspace is set aside;
- ``ALLOCATOR_SLACK`` and ``lane_block``: what CUDA's caching allocator reserves beside the arena
  beyond the bytes it hands out, and so the one block a compute lane's pool starts with.

The smallest budget any plan can run in is ``planners.driver.smallest_budget`` (a planner's input);
the smallest for one plan is ``memgraph.schedule.Schedule.plan_floor`` (the builder's). The two agree
on a plan that homes every weight on the CPU (tests/test_budget_parsing.py pins them together).
"""

from __future__ import annotations

# CUDA's caching allocator reserves in segments: a request of 1 MiB or less takes a 2 MiB small
# segment of its pool, a larger one a segment rounded up to 2 MiB. Beside the arena a step's GPU holds
# the lane pool's prewarmed block (the largest op workspace and the library workspaces, which cuBLAS
# carves from that pool on the lane's first matmul; rounded up), the lane pool's small segment
# (cuBLASLt's 1 MiB) and the caller's pool's small segment (generator states, scalars, the batch):
# three segments more than the bytes handed out. gpt1.3b on two H200s reserved 43 MiB over its budget
# per GPU when the lane block held the largest op workspace alone: cuBLAS's 32 MiB came out of it and
# an op's temporaries no longer fitted (bench/results/h200x2/s17/call3/reserved_100.json). With those
# three, the same step at 25% and 20% per GPU still reserved up to 3.4 MiB over (bench/results/h200x2/s18/call1):
# the arena is a segment of its own, rounded up to 2 MiB (up to 2 MiB more), and the first GPU held
# one 2 MiB segment more than the second: a small segment of the default pool on a second stream of it
# (bench/results/h200x2/s18/call2/reserved_25.log). With five, every row was within its budget (call3).
ALLOCATOR_SEGMENT = 2 << 20
ALLOCATOR_SLACK = 5 * ALLOCATOR_SEGMENT


def aligned(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``, at least one unit."""
    alignment = max(1, int(alignment))
    return -(-max(int(nbytes), 1) // alignment) * alignment


def arena_capacity(gpu_budget: int, step_workspace: int, alignment: int) -> int:
    """Arena bytes within ``gpu_budget``: the budget less the step's workspace (the largest op
    workspace plus the runtime's reserve, ``TaskGraph.step_workspace()``), rounded down to the alignment."""
    alignment = max(1, int(alignment))
    return (gpu_budget - step_workspace) // alignment * alignment


def lane_block(largest_workspace: int, step_workspace: int) -> int:
    """The bytes a compute lane's memory pool is first given: the step's workspace
    (``TaskGraph.step_workspace()``) less the allocator's slack, and never less than the largest op
    workspace (a step whose runtime reserve was not measured)."""
    return max(int(largest_workspace), int(step_workspace) - ALLOCATOR_SLACK)
