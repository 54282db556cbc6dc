"""Issue 31 offline: which groups of device 0's share the greedy keeps, offloads and recomputes, and could
they be recomputed. python share_mix.py <step> <fraction of eager's peak> [once]: "once" plans the
share as before replay_receives (each receive runs once)."""
import json, sys, logging
from collections import Counter, defaultdict
from pathlib import Path
from turnip.bench.replan import load_step, offline_costs, ALIGNMENT
from turnip.memgraph.per_device import sliced, step_order
from turnip.planners.driver import make_problem
from turnip.planners.greedy import greedy
from turnip.planners.model import KEEP, OFFLOAD, RECOMPUTE

logging.basicConfig(level=logging.WARNING)
step = Path(sys.argv[1]); frac = float(sys.argv[2])
tg = load_step(step)
facts = json.loads(step.with_suffix(".json").read_text())
costs = offline_costs(facts); costs.annotate(tg)
costs.rank_bandwidth = costs.d2d_bandwidth
share = sliced(tg, 0, tg.devices, order=step_order(tg)).taskgraph
costs.annotate(share)
budget = int(frac * 39829110784)
problem = make_problem(share, budget, None, costs, alignment=ALIGNMENT,
                       replay_receives=sys.argv[3:4] != ["once"])
dec, ev, stats = greedy(problem)
G = 2**30
by = defaultdict(lambda: Counter())
for gi, g in enumerate(problem.groups):
    opt = problem.groups[gi].options[ev.options[gi]]
    v = share.vertices[g.vertex]
    key = (v.op, "fwd" if g.forward else "bwd", bool(g.chain is not None and (g.rc_time > 0)))
    by[opt.kind][(v.op, g.forward, any(o.kind == RECOMPUTE for o in g.options))] += g.nbytes
for kind, c in by.items():
    print(kind, round(sum(c.values()) / G, 2))
    for (op, fwd, canrc), b in c.most_common(12):
        print(f"    {op:40s} fwd={fwd!s:5s} recomputable={canrc!s:5s} {b / G:.2f} GiB")
print("items home cpu:", round(sum(it.nbytes for ii, it in enumerate(problem.items) if dec.cpu[ii]) / G, 2),
      "of", round(sum(it.nbytes for it in problem.items) / G, 2))
print(Counter(it.kind for it in problem.items))
print("n positions", len(problem.order) if hasattr(problem, "order") else None)
order = step_order(share)
pos = {v: i for i, v in enumerate(order)}
rows = []
for gi, g in enumerate(problem.groups):
    if g.forward or problem.groups[gi].options[ev.options[gi]].kind != KEEP:
        continue
    v = share.vertices[g.vertex]
    for o in g.saved:
        readers = [u.id for u in share.vertices if o in u.inputs()]
        rows.append((g.nbytes, v.op, v.module, g.pos, [ (share.vertices[r].op, pos[r]) for r in readers]))
rows.sort(reverse=True)
for r in rows[:12]: print(round(r[0]/2**20), "MiB", r[1], r[2], "at", r[3], "read by", r[4])
print(len(rows), "kept backward groups")
