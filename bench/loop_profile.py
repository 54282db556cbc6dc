"""Where the engine's loop spends the host's time: cProfile over a few steps of one compiled step.

    python -m turnip.bench.loop_profile --model gpt1.3b --devices 2 --budget 0.25 --eager-peak 39829110784
    python -m turnip.bench.loop_profile --tiny --device cpu --devices 2 --budget 0.5      # CPU, seconds

Compiles the workload (``devices=N``; a fractional budget is of ``--eager-peak`` where given, else of
the unplanned peak), runs ``--warmup`` steps, then ``--steps`` steps under cProfile. Writes the loop's
own facts per step (launches, seconds busy, busy per launch: ``engine.loop.LoopTime``) beside the
functions that took the most time of their own and in all, to
bench/results/loop_profile_<model>_x<N>.json. The point: on two H200s the loop spent 45 us per launch
in one process and 85 in another on the same gpt1.3b step at 25%, launching copies between the
devices 2-3 ms after their writers ran (bench/results/2026-11-29_h200x2_rows-ablation-allocator.md),
and a trace shows when, not where. cProfile slows the loop itself; the facts of the profiled steps
are given beside those of the same number of steps unprofiled.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import pstats
import statistics
import time
from pathlib import Path

import torch

from .. import engine
from .host_probe import host_probe
from .one_memgraph import add_arguments, compile_from
from .peers.common import is_cuda
from .results import result_path, run_metadata

log = logging.getLogger(__name__)


def loop_rows(mg, batch, steps: int, device: str) -> list[dict]:
    """Each step's wall time and the loop's own facts."""
    rows = []
    for _ in range(steps):
        started = time.perf_counter()
        loss = engine.run(mg, batch)["loss"]
        if is_cuda(device):
            torch.cuda.synchronize()
        loop = mg.runtime.last_loop_time
        rows.append({"step_s": time.perf_counter() - started, "launches": loop.launches, "busy_s": loop.busy_s,
                     "waiting_s": loop.waiting_s, "busy_us_per_launch": loop.busy_per_launch_s * 1e6,
                     "step": mg.runtime.step, "loss": float(loss)})
    return rows


def top_functions(stats: pstats.Stats, key: str, count: int) -> list[dict]:
    """The ``count`` functions with the most ``key`` time ("tottime": their own; "cumtime": in all)."""
    rows = []
    for (path, line, name), (_, calls, own, total, _) in stats.stats.items():
        rows.append({"function": f"{Path(path).name}:{line}({name})", "calls": calls, "own_s": own, "total_s": total})
    rows.sort(key=lambda r: -(r["own_s"] if key == "tottime" else r["total_s"]))
    return rows[:count]


def profile(args: argparse.Namespace) -> dict:
    compiled = compile_from(args)
    mg, batch = compiled.mg, compiled.batch
    loop_rows(mg, batch, args.warmup, args.device)
    host_before = host_probe()
    plain = loop_rows(mg, batch, args.steps, args.device)
    profiler = cProfile.Profile()
    profiler.enable()
    profiled = loop_rows(mg, batch, args.steps, args.device)
    profiler.disable()
    stats = pstats.Stats(profiler)
    host_after = host_probe()
    mg.release(keep=False)

    def median(rows, key):
        return statistics.median(r[key] for r in rows)

    return {"model": compiled.workload.name, "devices": args.devices, "budget": args.budget,
            "budget_bytes": mg.plan.gpu_budget,
            "vertices": len(mg.vertices), "segments": len(mg.segments),
            "unprofiled": plain, "profiled": profiled, "host_before": host_before, "host_after": host_after,
            "busy_us_per_launch": median(plain, "busy_us_per_launch"),
            "profiled_busy_us_per_launch": median(profiled, "busy_us_per_launch"),
            "step_ms": median(plain, "step_s") * 1e3,
            "own_time": top_functions(stats, "tottime", args.top), "total_time": top_functions(stats, "cumtime", args.top)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnip.bench.loop_profile", description=__doc__.split("\n\n")[0])
    add_arguments(parser, budget=0.5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=30, help="functions listed by each measure")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    doc = profile(args)
    name = f"loop_profile_{doc['model']}_x{args.devices}.json"
    out = Path(args.out) if args.out else result_path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "loop_profile", **run_metadata(), **doc}, indent=1))
    log.info("loop: %.1f us per launch (%.1f profiled), %d launches, step %.1f ms; wrote %s",
             doc["busy_us_per_launch"], doc["profiled_busy_us_per_launch"], doc["unprofiled"][-1]["launches"],
             doc["step_ms"], out)
    for row in doc["own_time"][:15]:
        log.info("  %8.2f ms own  %8.2f ms in all  %7d calls  %s", row["own_s"] * 1e3, row["total_s"] * 1e3,
                 row["calls"], row["function"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
