"""Plans made believing the engine's loop costs one host time per launch, simulated at another."""
import json
import sys
from pathlib import Path

import torch
from turnip.bench.replan import ALIGNMENT, budget_bytes, offline_costs
from turnip.engine.timing_sim import simulate
from turnip.ir.step_file import load_step
from turnip.memgraph.compiler import built_walks, compact_walks, everything_kept, plan_step
from turnip.memgraph.progress import Phases

step = Path(sys.argv[1]); budget_frac = float(sys.argv[2]); rates = (15, 40)
facts = json.loads(step.with_suffix('.json').read_text())
costs = {us: offline_costs(dict(facts, host_per_vertex=us * 1e-6)) for us in rates}
tg = load_step(step)
costs[15].annotate(tg)
peak = everything_kept(tg, ALIGNMENT)[1]
budget = budget_bytes(str(budget_frac), facts.get('eager_peak_allocated'), peak)
for believed in rates:
    other = rates[1] if believed == rates[0] else rates[0]
    plans = plan_step(tg, budget, None, "auto", torch.device("cuda"), costs[believed], ALIGNMENT,
                      Phases([], enabled=False), {"time_limit": 10}, "off", 1.0)
    built, _ = built_walks(tg, plans, ALIGNMENT, costs[believed], "cuda", compact_walks(budget, peak), stand=True)
    rows = sorted((simulate(b.mg, costs[believed], backend="cuda").step_time * 1e3,
                   simulate(b.mg, costs[other], backend="cuda").step_time * 1e3,
                   f"{b.plan.planner}#{b.index}/{b.walk}", len(b.mg.segments), len(b.mg.vertices)) for b in built)
    print(f"{step.stem} {budget_frac}: believed {believed} us per launch")
    for r in rows:
        print(f"    {r[2]:28s} at {believed} us {r[0]:.1f} ms, at {other} us {r[1]:.1f} ms ({r[3]} segments, {r[4]} vertices)")
