"""Where each GPU's reserved bytes beyond the allocated ones sit, for gpt1.3b on two GPUs at a budget:
the caching allocator's segments after three steps, by pool and stream, with their free bytes.
usage: python reserved_diag.py BUDGET_BYTES OUT.json"""
import collections
import json
import logging
import sys
from pathlib import Path

import torch
from turnip.bench.models.sizes import make_workload
from turnip.bench.peers.common import trainable

from turnip import engine, memgraph

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
budget, out = int(sys.argv[1]), sys.argv[2]
w = make_workload("gpt1.3b")
mg = memgraph.compile(w.model, w.loss_fn, w.batch_on("cuda"), optimizer=w.optimizer(trainable(w.model)),
                      budget=budget, device="cuda", devices=2, verbose=False)
batch = [w.batch_on("cpu") for _ in range(2)]
stats = {}
for d in range(2):
    torch.cuda.reset_peak_memory_stats(d)
for step in range(3):
    engine.run(mg, batch)
    torch.cuda.synchronize()
    stats[step] = [{"allocated": torch.cuda.memory_allocated(d), "reserved": torch.cuda.memory_reserved(d),
                    "peak_allocated": torch.cuda.max_memory_allocated(d),
                    "peak_reserved": torch.cuda.max_memory_reserved(d)} for d in range(2)]
segments = []
for s in torch.cuda.memory_snapshot():
    segments.append({"device": s["device"], "stream": s["stream"], "pool": str(s.get("segment_pool_id")),
                     "type": s["segment_type"], "total": s["total_size"], "allocated": s["allocated_size"],
                     "blocks": [(b["size"], b["state"]) for b in s["blocks"]][:12]})
groups = collections.defaultdict(lambda: {"segments": 0, "total": 0, "allocated": 0, "sizes": []})
for s in segments:
    g = groups[f"dev{s['device']} pool {s['pool']} stream {s['stream']} {s['type']}"]
    g["segments"] += 1
    g["total"] += s["total"]
    g["allocated"] += s["allocated"]
    g["sizes"].append(s["total"])
doc = {"budget": budget, "arena_bytes": mg.arena_bytes, "stats": stats, "groups": groups, "segments": segments,
       "runtime_reserve": mg.taskgraph.runtime_reserve, "largest_workspace": mg.taskgraph.largest_workspace()}
Path(out).write_text(json.dumps(doc, indent=1, default=str))
for k, g in sorted(groups.items()):
    print(f"{k}: {g['segments']} segments, {g['total'] / 2**20:.1f} MiB reserved, {g['allocated'] / 2**20:.1f} MiB "
          f"allocated, free {(g['total'] - g['allocated']) / 2**20:.1f} MiB; sizes {sorted(g['sizes'])[-6:]}")
print(json.dumps(stats[2]))
