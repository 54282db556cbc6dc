"""Two runtimes of one multi-device MemGraph in one process (gpt1.3b on two GPUs at a budget): the
compiled MemGraph A and a copy B (dataclasses.replace, runtime of its own), stepped in turn. In the
second call of the eighteenth session, with single compute vertices replayed as one-vertex graphs,
A's first step after B had run raised "CUDA error: invalid argument" from a graph replay. This
checks the code as it is: every step of both runs, and each pair of losses at the same step is
bitwise equal.
usage: python two_runtimes.py BUDGET_BYTES OUT.json"""
import dataclasses
import json
import logging
import sys
import traceback
from pathlib import Path

import torch
from turnip.bench.models.sizes import make_workload
from turnip.bench.peers.common import trainable

from turnip import engine, memgraph

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
budget, out = int(sys.argv[1]), sys.argv[2]
w = make_workload("gpt1.3b")
a = memgraph.compile(w.model, w.loss_fn, w.batch_on("cuda"), optimizer=w.optimizer(trainable(w.model)),
                     budget=budget, device="cuda", devices=2, verbose=False)
b = dataclasses.replace(a)
b.runtime = None
batch = [w.batch_on("cpu") for _ in range(2)]
rows, error = [], None
order = ["a"] * 3 + ["b"] * 3 + ["a", "b"] * 3
try:
    for name in order:
        mg = a if name == "a" else b
        loss = float(engine.run(mg, batch)["loss"])
        torch.cuda.synchronize()
        rows.append({"runtime": name, "step": mg.runtime.step, "loss": loss})
        logging.info("%s step %d: loss %r", name, mg.runtime.step, loss)
except Exception:  # noqa: BLE001 - the point is to see it
    error = traceback.format_exc()
    logging.error("stopped after %d steps: %s", len(rows), error)
by_step = {}
for r in rows:
    by_step.setdefault(r["step"], {})[r["runtime"]] = r["loss"]
pairs = {s: v for s, v in by_step.items() if len(v) == 2}
doc = {"budget": budget, "segments": len(a.segments), "rows": rows, "error": error,
       "pairs_equal": all(v["a"] == v["b"] for v in pairs.values()), "pairs": len(pairs)}
Path(out).write_text(json.dumps(doc, indent=1))
print(json.dumps({k: v for k, v in doc.items() if k != "rows"}))
