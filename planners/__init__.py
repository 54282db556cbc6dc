"""Planners: decide what to keep, offload or recompute, and where weights live.

    plan = planners.plan(taskgraph, gpu_budget, cpu_budget=None, method="auto")

method: "auto" (the ILP, the greedy plan when the ILP finds nothing in time), "ilp", "greedy".
"""

from __future__ import annotations

from ..ir.errors import InfeasibleBudget
from ..ir.plan import CPU, GPU, Plan, Recompute
from .driver import plan_candidates, run_plan

__all__ = ["CPU", "GPU", "InfeasibleBudget", "Plan", "Recompute", "plan", "plan_candidates"]


def plan(taskgraph, gpu_budget: int, cpu_budget: int | None = None, method: str = "auto",
         time_limit: float | None = None, costs=None, **opts) -> Plan:
    """Plan one training step within `gpu_budget` bytes (and `cpu_budget` pinned bytes).

    costs: a turnip.planners.costs.CostModel (default: measured on the graph's CUDA device when
    present, analytic H100-class rates otherwise); it fills vertex.time/workspace where unset.
    time_limit: seconds the MILP solver may run (it starts from the greedy plan, so it always has
    one); None scales it to the problem (planners.driver.ilp_time_limit: 0.25 ms per binary
    variable, 15 ms with op costs measured on the GPU, within 0.5-10 s, for all the rounds of the
    block search). Options: tie_blocks (default True: each repeated block's instances choose
    among whole-block patterns found in rounds, planners/block_search.py), headroom (fraction of budget - workspace
    planned with, default 0.92, slack for fragmentation and prefetching), alignment (default 256 on CUDA, 64 otherwise), windows
    (overlap windows, default n/8 up to 160), gap (relative MIP gap to stop at, default 0.005),
    depth/max_candidates/max_chain (recompute chain limits), max_items (home decisions before
    they are grouped by module, default 512), order (a serial order; default: program order with
    each parameter's update right after its gradient), solver ("auto" | "highs" | "cbc"), msg,
    reload_room (experimental, default False: a planned reload holds its bytes from the window
    its prefetch is charged to, not only from its use; not yet measured on a GPU), replay_receives
    (default False; memgraph/per_device.py sets it: a value received from another device of this
    process may be received again for a recomputation).

    The Plan carries predicted_time (seconds per step), predicted_peak (arena bytes plus the
    largest workspace) and, in stats, the solver's status and gap and the mix (bytes kept,
    offloaded, recomputed; weights and optimizer states streamed).
    Raises InfeasibleBudget (a ValueError) naming the smallest budget that could work (.minimum).
    """
    return run_plan(taskgraph, gpu_budget, cpu_budget=cpu_budget, method=method, time_limit=time_limit,
                    costs=costs, **opts)
