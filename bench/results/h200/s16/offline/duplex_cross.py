"""Plans made believing the link moves 75 GB/s both ways, simulated where it moves 100 (and the reverse)."""
import json
import sys
from pathlib import Path

import torch
from turnip.bench.replan import ALIGNMENT, budget_bytes, offline_costs
from turnip.engine.timing_sim import simulate
from turnip.ir.step_file import load_step
from turnip.memgraph.compiler import built_walks, compact_walks, everything_kept, plan_step
from turnip.memgraph.progress import Phases

step = Path('/work/main/bench/results/h200/steps/step_gpt1.3b.step')
facts = json.loads(step.with_suffix('.json').read_text())
budget_frac = float(sys.argv[1]) if len(sys.argv) > 1 else 0.25
costs = {}
for rate in (75, 100):
    f = dict(facts, duplex_bandwidth=rate * 1e9)
    costs[rate] = offline_costs(f)
tg = load_step(step)
costs[100].annotate(tg)
peak = everything_kept(tg, ALIGNMENT)[1]
budget = budget_bytes(str(budget_frac), facts.get('eager_peak_allocated'), peak)
for believed in (75, 100):
    plans = plan_step(tg, budget, None, "auto", torch.device("cuda"), costs[believed], ALIGNMENT,
                      Phases([], enabled=False), {"time_limit": 10}, "off", 1.0)
    built, _ = built_walks(tg, plans, ALIGNMENT, costs[believed], "cuda", compact_walks(budget, peak), stand=True)
    rows = []
    for b in built:
        rows.append((simulate(b.mg, costs[believed], backend="cuda").step_time * 1e3,
                     simulate(b.mg, costs[100 if believed == 75 else 75], backend="cuda").step_time * 1e3,
                     f"{b.plan.planner}#{b.index}/{b.walk}"))
    pick = min(rows)
    print(f"believed {believed} GB/s: picked {pick[2]} sim {pick[0]:.1f} ms believed, {pick[1]:.1f} ms at the other rate")
    for r in sorted(rows): print(f"    {r[2]:28s} believed {r[0]:.1f}  other {r[1]:.1f}")
