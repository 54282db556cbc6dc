"""Planners: decide what to keep, offload or recompute, and where weights live.

    plan = planners.plan(taskgraph, gpu_budget, cpu_budget=None, method="auto")

method: "auto" (the ILP, the greedy plan when the ILP finds nothing in time), "ilp", "greedy".
The heavy modules (numpy, PuLP) load on first use: memgraph imports this package for Plan.
"""

from __future__ import annotations

from turnip.planners.plan import CPU, GPU, Plan, Recompute

__all__ = ["CPU", "GPU", "Plan", "Recompute", "plan"]


def plan(taskgraph, gpu_budget: int, cpu_budget: int | None = None, method: str = "auto",
         time_limit: float = 30.0, costs=None, **opts) -> Plan:
    """Plan one training step within `gpu_budget` bytes (and `cpu_budget` pinned bytes).

    costs: a turnip.planners.costs.CostModel (default: measured on the graph's CUDA device when
    present, analytic H100-class rates otherwise); it fills vertex.time/workspace where unset.
    Options: headroom (fraction of the budget planned with, default 0.92, for fragmentation),
    alignment, windows, gap (relative MIP gap to stop at), depth/max_candidates/max_chain
    (recompute chain limits), max_items (home decisions before grouping by module), msg.
    Raises turnip.memgraph.build.InfeasibleBudget (ValueError where the builder is absent)
    naming the smallest budget that could work.
    """
    from turnip.planners.driver import run_plan

    return run_plan(taskgraph, gpu_budget, cpu_budget=cpu_budget, method=method, time_limit=time_limit,
                    costs=costs, **opts)
