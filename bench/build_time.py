"""How long BuildMemGraph takes as the graph grows: chain-of-blocks steps at 25% of their unplanned peak.

    python -m turnip.bench.build_time                 # 1k .. 100k vertices, writes bench/results/build_time.json
    python -m turnip.bench.build_time --sizes 1000,10000 --repeat 3 --fraction 0.25 --unconstrained-sizes ""

Each graph is `tests/synthetic.py:chain_of_blocks` (12 vertices per block:
forward, backward, SGD update bound to each weight); the plan is the program
order with every weight GPU-resident and a GPU budget of ``fraction`` times
`TaskGraph.live_peak`. The reported time is the wall time of ``memgraph.build``
(best of ``repeat``), with its phases, and the size of what it built. The
growth exponent is the slope of log(time) over log(vertices). Unconstrained rows
(budget 1000x the peak) show the same graphs with nothing to evict.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import platform
import sys
import time
from pathlib import Path

from ..ir.plan import Plan
from ..memgraph import build

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "build_time.json"
VERTICES_PER_BLOCK = 12


def _synthetic():
    """tests/synthetic.py holds the graph generators shared by tests and benchmarks."""
    spec = importlib.util.spec_from_file_location("turnip_tests_synthetic", REPO / "tests" / "synthetic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(n_vertices: int, fraction: float, repeat: int) -> dict:
    synthetic = _synthetic()
    tg = synthetic.chain_of_blocks(max(1, round(n_vertices / VERTICES_PER_BLOCK)))
    peak = tg.live_peak(alignment=256)
    plan = Plan(gpu_budget=int(peak * fraction), planner="none")
    best, mg = math.inf, None
    for _ in range(repeat):
        started = time.perf_counter()
        mg = build(tg, plan)
        best = min(best, time.perf_counter() - started)
        mg = mg if _ == repeat - 1 else None
    summary = mg.summary()
    row = {
        "taskgraph_vertices": len(tg.vertices),
        "budget_fraction": fraction,
        "gpu_budget": plan.gpu_budget,
        "unplanned_peak": peak,
        "seconds": round(best, 3),
        "seconds_schedule": round(mg.stats["seconds_schedule"], 3),
        "seconds_simulate": round(mg.stats["seconds_simulate"], 3),
        "seconds_reduce": round(mg.stats["seconds_reduce"], 3),
        "memgraph_vertices": summary["vertices"],
        "vertices_by_kind": summary["vertices_by_kind"],
        "data_edges": summary["data_edges"],
        "memory_edges": summary["memory_edges"],
        "edges_removed_by_reduction": summary["edges_removed_by_reduction"],
        "bytes_offloaded": summary["bytes_offloaded"],
        "arena_bytes": mg.arena_bytes,
        "cpu_bytes": mg.cpu_bytes,
    }
    log.info("%7d vertices: %.2fs (%d MemGraph vertices, %d memory edges)", row["taskgraph_vertices"],
             row["seconds"], row["memgraph_vertices"], row["memory_edges"])
    return row


def growth_exponent(rows: list[dict]) -> float | None:
    """Least-squares slope of log(seconds) against log(vertices)."""
    pts = [(math.log(r["taskgraph_vertices"]), math.log(r["seconds"])) for r in rows if r["seconds"] > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return round(sum((x - mx) * (y - my) for x, y in pts) / sxx, 3) if sxx else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,3000,10000,30000,100000", help="TaskGraph vertex counts")
    parser.add_argument("--fraction", type=float, default=0.25, help="GPU budget as a fraction of the peak")
    parser.add_argument("--repeat", type=int, default=1, help="builds per size (best time kept)")
    parser.add_argument("--unconstrained-sizes", default="1000,10000",
                        help="sizes also built with no memory limit (no offloads; memory edges reported)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = [measure(n, args.fraction, args.repeat) for n in sizes]
    unconstrained = [measure(int(n), 1.0e3, 1) for n in args.unconstrained_sizes.split(",") if n]
    result = {
        "benchmark": "memgraph.build on chain_of_blocks",
        "command": "python -m turnip.bench.build_time " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "rows": rows,
        "growth_exponent": growth_exponent(rows),
        "unconstrained_rows": unconstrained,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log.info("growth exponent %.2f; wrote %s", result["growth_exponent"] or float("nan"), out)
    return result


if __name__ == "__main__":
    main()
