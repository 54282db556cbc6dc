"""Do cyclic collections run during engine.run after a compile, and how long? (eighteenth session, CPU)

    python bench/results/h200x2/s18/offline/gc_probe.py BUDGET PLANNER
"""
import gc
import sys
import time

import torch
import torch.nn.functional as F

from turnip import engine, memgraph
from turnip.gpt import GPT, GPTConfig, example_batch

cfg = GPTConfig(vocab=256, seq=64, d_model=64, n_layers=24, n_heads=4)
torch.manual_seed(0)
model = GPT(cfg)
def loss_fn(m, b):
    idx, t = b
    lg = m(idx); return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), t.reshape(-1))
batch = example_batch(cfg, 2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
t0=time.perf_counter()
mg = memgraph.compile(model, loss_fn, batch, optimizer=opt, budget=float(sys.argv[1]), device="cpu", devices=2, planner=sys.argv[2], verbose=False)
print("compile", round(time.perf_counter()-t0,1), "s; gc counts", gc.get_count(), "objects tracked", len(gc.get_objects()))
log = []
def cb(phase, info):
    if phase == "start": cb.t = time.perf_counter()
    else: log.append((info["generation"], time.perf_counter() - cb.t))
gc.callbacks.append(cb)
for s in range(6):
    log.clear(); t=time.perf_counter()
    engine.run(mg, [batch, batch])
    lt = mg.runtime.last_loop_time
    by = {}
    for g, d in log: by.setdefault(g, [0, 0.0]); by[g][0] += 1; by[g][1] += d
    print(f"step {s}: {1e3*(time.perf_counter()-t):.1f} ms, busy/launch {lt.busy_per_launch_s*1e6:.1f} us, launches {lt.launches}, gc {{gen: [n, ms]}} = { {g:[n, round(1e3*d,2)] for g,(n,d) in by.items()} }")
