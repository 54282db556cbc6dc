"""Offline: compile's pick (build_candidates) on an exported step at the given budgets, and the seconds it took."""
import json, sys, time, logging
from pathlib import Path
import torch
from turnip.bench.replan import load_step, offline_costs, budget_bytes, ALIGNMENT, plan_step, Phases, everything_kept
from turnip.memgraph.compiler import build_candidates, compact_walks, simulated_step
step = Path(sys.argv[1])
tg = load_step(step); facts = json.loads(step.with_suffix('.json').read_text())
costs = offline_costs(facts); costs.annotate(tg)
peak = everything_kept(tg, ALIGNMENT)[1]
for text in sys.argv[2].split(','):
    budget = budget_bytes(text, facts['eager_peak_allocated'], peak)
    plans = plan_step(tg, budget, None, 'auto', torch.device('cuda'), costs, ALIGNMENT, Phases([], enabled=False), {}, 'off', 1.0)
    t = time.perf_counter()
    mg, walk, _ = build_candidates(tg, plans, ALIGNMENT, costs, 'cuda', compact_walks(budget, peak))
    print(step.stem, text, mg.plan.planner, walk, round(simulated_step(mg, costs, 'cuda') * 1e3, 1), 'ms; building', round(time.perf_counter() - t, 2), 's', flush=True)
