"""Which compute vertices the engine launched alone (not in a segment) before singles became segments, by op
(eighteenth session, CPU):  python bench/results/h200x2/s18/offline/eager_units.py STEP BUDGET  (min_size=2 there)"""
import collections
import json
import sys
from pathlib import Path

import torch
from turnip.bench.replan import ALIGNMENT, offline_costs
from turnip.ir.errors import InfeasibleBudget
from turnip.ir.memgraph import Kind
from turnip.ir.step_file import load_step
from turnip.memgraph.builder import build_walks
from turnip.memgraph.compiler import plan_step
from turnip.memgraph.progress import Phases
from turnip.memgraph.segments import find_segments

step = Path(sys.argv[1]); budget = int(float(sys.argv[2]) * 39829110784)
tg = load_step(step); facts = json.loads(step.with_suffix(".json").read_text())
costs = offline_costs(facts); costs.annotate(tg)
plans = plan_step(tg, budget, None, "auto", torch.device("cuda"), costs, ALIGNMENT, Phases([], enabled=False), {"time_limit": 10}, "off", 1.0)
for plan in plans:
    try:
        mg = build_walks(tg, plan, alignment=ALIGNMENT, walks=("ahead",))["ahead"]
    except InfeasibleBudget as e:
        print(plan.planner, "does not build", type(e).__name__); continue
    in_seg = {v for s in find_segments(mg, min_size=2) for v in s}
    alone = collections.Counter(); kinds = collections.Counter()
    for v in mg.vertices:
        kinds[v.kind.name] += 1
        if v.kind == Kind.COMPUTE and v.id not in in_seg:
            tv = mg.taskgraph.vertices[v.task_vertex] if v.task_vertex is not None and v.task_vertex >= 0 else None
            op = tv.op if tv is not None else getattr(v, "op", "?")
            alone[op] += 1
    print(plan.planner, "segments", len(mg.segments), "kinds", dict(kinds), "alone", sum(alone.values()))
    for op, n in alone.most_common(25): print(f"   {n:5d} {op}")
