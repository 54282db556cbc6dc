"""Offline: plan llama at 60% on an exported step as compile does; simulate each plan's ahead walk, write timelines."""
import json, sys
from pathlib import Path
import torch
from turnip.bench.replan import load_step, offline_costs, budget_bytes, ALIGNMENT, plan_step, Phases, everything_kept
from turnip.memgraph.builder import build_walks
from turnip.engine.timing_sim import simulate, idle_by_wait
step = Path(sys.argv[1]); out = Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
tg = load_step(step); facts = json.loads(step.with_suffix('.json').read_text())
costs = offline_costs(facts); costs.annotate(tg)
peak = everything_kept(tg, ALIGNMENT)[1]
budget = budget_bytes('0.6', facts['eager_peak_allocated'], peak)
plans = plan_step(tg, budget, None, 'auto', torch.device('cuda'), costs, ALIGNMENT, Phases([], enabled=False), {}, 'off', 1.0)
desc = {}
for k, plan in enumerate(plans):
    mg = build_walks(tg, plan, alignment=ALIGNMENT, walks=('ahead',))['ahead']
    sim = simulate(mg, costs, backend='cuda')
    sim.write_timeline(out / f'{plan.planner}{k}.sim.json', mg)
    print(k, plan.planner, plan.stats.get('variant'), round(plan.predicted_time*1e3,1), round(sim.step_time*1e3,1),
          {a: round(b*1e3,1) for a, b in idle_by_wait(mg, sim).items()})
    name = lambda v: f'{tg.vertices[v].op}@{tg.vertices[v].module}'
    desc[f'{plan.planner}{k}'] = {'offload': sorted(f'{tg.values[x].producer if hasattr(tg.values[x],"producer") else x}' for x in plan.offload),
                                 'recompute': sorted(name(r.vertex) + f'<{r.before}' for r in plan.recompute),
                                 'cpu': sorted(str(v) for v, h in plan.home.items() if h != 'gpu' and h != 'GPU')}
json.dump(desc, open(out / 'plans.json', 'w'), indent=0)
