"""Offline: the simulated step of the 2 x H200 export's greedy plans with the loop charged 15, 45 and
85 us per launch (the simulator's figure, and what calls 1 and 3 measured), the device's news taken
only when no report waits (the engine before 99a8f65) or every LOOK_WHILE_BUSY_S as well.
usage: python look_while_busy.py STEP FRACTION_OF_EAGER_PEAK"""
import json
import logging
import math
import sys
from pathlib import Path

import torch
from turnip.bench.replan import offline_costs
from turnip.engine import timing_sim
from turnip.engine.timing_sim import simulate
from turnip.ir.errors import InfeasibleBudget
from turnip.ir.step_file import load_step
from turnip.memgraph.builder import build_walks
from turnip.memgraph.compiler import plan_step
from turnip.memgraph.progress import Phases

logging.basicConfig(level=logging.ERROR)
step = Path(sys.argv[1]); frac = float(sys.argv[2])
tg = load_step(step); facts = json.loads(step.with_suffix(".json").read_text())
costs = offline_costs(facts); costs.annotate(tg)
plans = plan_step(tg, int(frac * 39829110784), None, "greedy", torch.device("cuda"), costs, 256, Phases([], enabled=False), {}, "off")
for plan in plans:
    try:
        mg = build_walks(tg, plan, alignment=256, walks=("ahead",))["ahead"]
    except InfeasibleBudget:
        continue
    out = []
    for host in (15e-6, 45e-6, 85e-6):
        row = []
        for look in (math.inf, 200e-6):
            timing_sim.LOOK_WHILE_BUSY_S = look
            row.append(simulate(mg, costs, backend="cuda", host_per_vertex=host).step_time * 1e3)
        out.append(f"host {host*1e6:.0f} us: looked only when idle {row[0]:.1f}, every 200 us {row[1]:.1f}")
    print(plan.planner, " | ".join(out), flush=True)
