"""What a turnip step allocates beside its arena: the CUDA allocations live at the step's peak.

    python -m turnip.bench.memory_audit [--model gpt350m] [--budget none|0.6]

Compiles the model, runs one step (allocation, library handles), then records the caching
allocator's history over a second step and lists, at the moment of the step's peak, every live
block except the arena with its size and the Python frame that allocated it. Writes
bench/results/memory_audit_<model>.json. The point: the compile-time budget check must count
everything listed here.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from turnip.bench.models.sizes import make_workload
from turnip.bench.results import result_path, run_metadata

from turnip import engine, memgraph

log = logging.getLogger(__name__)


def live_at_peak(snapshot: dict) -> tuple[int, list[dict]]:
    """Replay the allocator trace: (peak bytes allocated, blocks live at that moment)."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for trace in snapshot["device_traces"]:
        for event in trace:
            if event["action"] == "alloc":
                live[event["addr"]] = event
                total += event["size"]
            elif event["action"] == "free_completed" and event["addr"] in live:
                total -= live.pop(event["addr"])["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
    return peak, at_peak


def frame_of(event: dict) -> str:
    frames = [f for f in event.get("frames", []) if f.get("filename", "").endswith(".py")]
    for f in frames:
        if "/turnip/" in f["filename"] or "/kernels/" in f["filename"] or "/engine/" in f["filename"]:
            return f"{f['filename'].rsplit('/', 2)[-2]}/{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    return f"{frames[0]['filename'].rsplit('/', 1)[-1]}:{frames[0]['line']}" if frames else "?"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt350m")
    parser.add_argument("--budget", default="none", help="'none' (keep everything) or a fraction of the peak")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    workload = make_workload(args.model)
    batch = workload.batch_on("cuda")
    optimizer = workload.optimizer([p for p in workload.model.parameters() if p.requires_grad])
    budget = None if args.budget == "none" else float(args.budget)
    mg = memgraph.compile(workload.model, workload.loss_fn, batch, optimizer=optimizer, budget=budget, device="cuda")
    engine.run(mg, batch)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    engine.run(mg, batch)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    arena = mg.arena_bytes
    blocks = [b for b in snapshot["segments"] for b in b["blocks"] if b["state"] == "active_allocated"]
    persistent = sorted((b["size"] for b in blocks if b["size"] != arena and b["size"] < arena), reverse=True)
    _, at_peak = live_at_peak(snapshot)
    step_blocks = sorted(({"bytes": e["size"], "where": frame_of(e)} for e in at_peak), key=lambda b: -b["bytes"])
    result = {"benchmark": "memory_audit", **run_metadata(), "model": args.model, "budget": args.budget,
              "gpu_budget": mg.plan.gpu_budget, "arena_bytes": arena, "unplanned_peak": mg.stats.get("unplanned_peak"),
              "max_workspace": max((v.workspace for v in mg.taskgraph.vertices), default=0),
              "allocated_between_steps": before, "peak_allocated_in_step": torch.cuda.max_memory_allocated(),
              "persistent_blocks_besides_arena": persistent[:20], "allocated_during_step_at_peak": step_blocks[:20]}
    path = result_path(f"memory_audit_{args.model}.json")
    path.write_text(json.dumps(result, indent=2, default=str))
    log.info("%s", json.dumps({k: v for k, v in result.items() if k not in ("commit", "date")}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
