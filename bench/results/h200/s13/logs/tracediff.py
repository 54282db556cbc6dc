"""This tree's tracer against the session-start tree's (scratch/oldpkg/turnip_old) on the bench workloads:
the same TaskGraph (digests of the traced and finished graphs) and the tracing seconds, alternately.

    python3 scratch/tracediff.py cuda OUT.json gpt1.3b,llama,gpt350m 3

scratch/oldpkg/turnip_old is the session start (git archive 45ec163): its turnip/ folder as the package,
with ir, trace, memgraph, planners, engine, kernels and bench copied into it."""
import gc
import json
import sys
import time

import torch

sys.path.insert(0, "scratch/oldpkg")
import turnip.trace.tracer as new
import turnip_old.trace.tracer as old
from turnip.bench.models.sizes import make_workload
from turnip.planners.cache import taskgraph_digest as dnew
from turnip_old.planners.cache import taskgraph_digest as dold

device = sys.argv[1]
rows = []
for name in sys.argv[3].split(","):
    w = make_workload(name.removesuffix("-tiny"), tiny=name.endswith("-tiny"))
    trainable = [p for p in w.model.parameters() if p.requires_grad]
    batch = w.batch_on(device)
    times = {"old": [], "new": []}
    graphs = {}
    for rep in range(int(sys.argv[4])):
        for side, mod in (("old", old), ("new", new)):
            gc.collect()
            t = time.perf_counter()
            step = mod.trace_step(w.model, w.loss_fn, batch, optimizer=w.optimizer(trainable), device=device)
            times[side].append(time.perf_counter() - t)
            graphs[side] = step
    same_raw = dold(graphs["old"].graph) == dnew(graphs["new"].graph)
    same_finished = dold(graphs["old"].finished()) == dnew(graphs["new"].finished())
    row = {"model": name, "device": device, "vertices": len(graphs["new"].graph.vertices), "same_traced_graph": same_raw,
           "same_finished_graph": same_finished, "trace_s_old": times["old"], "trace_s_new": times["new"]}
    print(json.dumps(row), flush=True)
    rows.append(row)
    del w, graphs
with open(sys.argv[2], "w") as out:
    json.dump({"torch": torch.__version__, "rows": rows}, out, indent=1)
