"""Issue 31 offline: why device 0's offloaded forward groups at 25% (casts layout) are not recomputable."""
import json, sys, logging
from collections import Counter
from pathlib import Path
from turnip.bench.replan import load_step, offline_costs, ALIGNMENT
from turnip.memgraph.per_device import sliced, step_order
from turnip.planners.driver import make_problem
from turnip.planners.model import RECOMPUTE
from turnip.ir.taskgraph import MESSAGE_OPS, ValueKind

logging.basicConfig(level=logging.WARNING)
step = Path(sys.argv[1])
tg = load_step(step)
facts = json.loads(step.with_suffix(".json").read_text())
costs = offline_costs(facts); costs.annotate(tg); costs.rank_bandwidth = costs.d2d_bandwidth
share = sliced(tg, 0, tg.devices, order=step_order(tg)).taskgraph
costs.annotate(share)
problem = make_problem(share, int(0.25 * 39829110784), None, costs, alignment=ALIGNMENT)
group_of = {o: gi for gi, g in enumerate(problem.groups) for o in g.saved}
reasons = Counter()
examples = {}
for gi, g in enumerate(problem.groups):
    if not g.forward or any(o.kind == RECOMPUTE for o in g.options):
        continue
    v = share.vertices[g.vertex]
    why = "message op" if v.op in MESSAGE_OPS else None
    if why is None:
        stack, seen = [g.vertex], set()
        while stack and why is None:
            x = stack.pop()
            for u in share.vertices[x].inputs():
                val = share.values[u]
                if val.kind in (ValueKind.PARAMETER, ValueKind.FROZEN, ValueKind.OPTIMIZER_STATE, ValueKind.BATCH, ValueKind.CONSTANT):
                    continue
                if u in group_of:
                    continue
                p = share.vertices[val.producer] if val.producer >= 0 else None
                if p is not None and p.op in MESSAGE_OPS:
                    why = f"reads an unsaved {p.op} output"
                    break
                if p is not None and p.phase == "forward" and p.id not in seen and not any(o in group_of for o in p.outputs):
                    seen.add(p.id); stack.append(p.id); continue
                why = f"reads {p.op if p else '?'} ({p.phase if p else ''}) output kind {val.kind.name}, forced/other"
                break
        if why is None:
            why = f"chain longer than max_chain ({len(seen)})"
    reasons[(v.op, why)] += g.nbytes
    examples.setdefault((v.op, why), (v.module, g.vertex))
for (op, why), b in reasons.most_common(20):
    print(f"{b/2**30:6.2f} GiB  {op:35s} {why}  e.g. {examples[(op, why)]}")
