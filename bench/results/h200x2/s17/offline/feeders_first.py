"""Offline: does launching first what another device waits for shorten the simulated 2-GPU step?
The s6 casts export of gpt1.3b on 2 x H200 at 25%, plans as compile makes them (greedy and auto), each
simulated with the serial ranks and with units feeding another device (and their same-device
predecessors, depth D) moved K places earlier."""
import json
import logging
import sys
from pathlib import Path

import torch
from turnip.bench.replan import offline_costs
from turnip.engine.policy import Policy, serial_positions
from turnip.engine.timing_sim import simulate
from turnip.ir.errors import InfeasibleBudget
from turnip.ir.step_file import load_step
from turnip.memgraph.builder import build_walks
from turnip.memgraph.compiler import plan_step
from turnip.memgraph.progress import Phases

logging.basicConfig(level=logging.WARNING)
step = Path(sys.argv[1]); frac = float(sys.argv[2]); method = sys.argv[3]
tg = load_step(step)
facts = json.loads(step.with_suffix(".json").read_text())
costs = offline_costs(facts); costs.annotate(tg)
budget = int(frac * 39829110784)
plans = plan_step(tg, budget, None, method, torch.device("cuda"), costs, 256, Phases([], enabled=False), {"time_limit": 10}, "off")

class Boost(Policy):
    name = "nondeterministic"
    def __init__(self, k, depth): self.k, self.depth = k, depth
    def ranks(self, mg):
        rank = serial_positions(mg)
        succ = mg.successors(); pred = mg.predecessors()
        def device(v):
            places = list(v.writes.values()) or list(v.reads.values())
            if places:
                return places[0].device
            return mg.taskgraph.vertices[v.task_vertex].device if v.task_vertex >= 0 else 0
        dev = [device(v) for v in mg.vertices]
        feeders = {v for v in range(len(mg.vertices)) if any(dev[s] != dev[v] for s in succ[v])}
        frontier, boosted = set(feeders), set(feeders)
        for _ in range(self.depth):
            frontier = {p for v in frontier for p in pred[v] if dev[p] == dev[v]} - boosted
            boosted |= frontier
        return [r - self.k if v in boosted else r for v, r in enumerate(rank)]

for i, plan in enumerate(plans):
    try:
        mg = build_walks(tg, plan, alignment=256, walks=("ahead",))["ahead"]
    except InfeasibleBudget as exc:
        print(i, plan.planner, "does not build:", exc)
        continue
    base = simulate(mg, costs, backend="cuda").step_time
    out = [f"{i} {plan.planner}: serial {base*1e3:.1f}"]
    for k, d in ((20, 0), (100, 0), (100, 1), (400, 1), (100, 3)):
        t = simulate(mg, costs, backend="cuda", ordering=Boost(k, d)).step_time
        out.append(f"k{k}d{d} {t*1e3:.1f}")
    print(" | ".join(out), flush=True)
