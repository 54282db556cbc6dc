"""From solver columns to Decisions, and from Decisions to the Plan that BuildMemGraph consumes."""

from __future__ import annotations

from collections import defaultdict

from ..ir.plan import CPU, Plan, Recompute
from ..ir.taskgraph import TaskGraph
from .ilp import Formulation
from .memory import Decisions, Evaluation
from .model import OFFLOAD, RECOMPUTE, Problem


def from_solution(problem: Problem, f: Formulation, values: list[float]) -> Decisions:
    kinds = []
    for gi, g in enumerate(problem.groups):
        chosen = max(range(len(g.options)), key=lambda oi: values[f.x[gi, oi]])
        kinds.append(g.options[chosen].kind)
    cpu = [values[f.y[ii]] > 0.5 for ii in range(len(problem.items))]
    return Decisions(kinds, cpu)


def recompute_list(problem: Problem, ev: Evaluation) -> list[Recompute]:
    """Copies in the order they run: by the position they precede, then program order (a
    topological order of the forward pass, so chains come out producer first)."""
    at_pos: dict[int, set[int]] = defaultdict(set)
    for gi, g in enumerate(problem.groups):
        oi = ev.options[gi]
        if oi < 0 or g.options[oi].kind != RECOMPUTE:
            continue
        at_pos[g.options[oi].at].update(g.chain)  # a transient shared by two chains runs once
        at_pos[g.options[oi].at].add(g.vertex)
    out = []
    for p in sorted(at_pos):
        before = problem.order[p]
        out.extend(Recompute(v, before) for v in sorted(at_pos[p]))
    return out


def to_plan(problem: Problem, decisions: Decisions, ev: Evaluation, planner: str, stats: dict) -> Plan:
    offload = set()
    for gi, g in enumerate(problem.groups):
        oi = ev.options[gi]
        if oi >= 0 and g.options[oi].kind == OFFLOAD:
            offload.update(g.saved)
    home, release_after = {}, {}
    for ii, item in enumerate(problem.items):
        if decisions.cpu[ii]:
            home.update({v: CPU for v in item.values})
            for v in item.values:
                runs = item.present.get(v, [])
                if len(runs) > 1:  # (first reader, last reader) positions of each fetch
                    release_after[v] = [int(problem.order[last]) for _first, last in runs[:-1]]
    tg: TaskGraph = problem.tg
    stats = dict(stats)
    stats.update(ev.mix)
    stats.update({
        "values_peak": ev.peak,
        "objective": ev.objective,
        "cap": problem.cap,
        "headroom": problem.headroom,
        "alignment": problem.alignment,
        "max_workspace": problem.max_workspace,
        "windows": problem.n_windows,
        "groups": len(problem.groups),
        "home_items": len(problem.items),
        "pinned_bytes": int(ev.cpu_bytes),
        "compute_seconds": float(problem.base_compute.sum()),
        "host_per_vertex": problem.host_per_vertex,
        "unplanned_peak": int(tg.live_peak(alignment=problem.alignment)),
    })
    return Plan(gpu_budget=problem.gpu_budget,
                cpu_budget=None if problem.cpu_cap == float("inf") else int(problem.cpu_cap),
                order=list(problem.order), recompute=recompute_list(problem, ev), offload=offload, home=home,
                release_after=release_after,
                planner=planner, predicted_time=ev.time, predicted_peak=int(ev.peak + problem.max_workspace),
                stats=stats)
