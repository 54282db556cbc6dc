"""How long planning takes on deep models: python -m turnip.bench.plan_time

Traces GPT steps (GPTConfig(n_layers=12 and 32, d_model=256, seq=128), AdamW), plans each at
50%, 25% and 10% of its unplanned peak with the ILP (greedy warm start, HiGHS), and writes
bench/results/plan_time.json: wall time of plan() and of the solver, MIP status and gap, the
greedy baseline's and the ILP's predicted step times, and the plan's mix. Costs are the analytic
H100-class model unless --measure (then measured on this machine's CUDA device).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

from .. import planners
from ..gpt import GPT, GPTConfig, example_batch, lm_loss
from ..memgraph import trace
from ..planners.costs import CostModel

log = logging.getLogger("turnip.bench.plan_time")

RESULTS = Path(__file__).resolve().parent / "results"
STAT_KEYS = ("status", "optimal", "gap", "objective_ms", "bound_ms", "solve_seconds", "problem_seconds",
             "greedy_seconds", "ilp_build_seconds", "columns", "binaries", "rows", "windows", "groups",
             "home_items", "fits_model", "fallback", "greedy_time", "improvement_over_greedy", "bytes_kept",
             "bytes_offloaded", "bytes_recomputed", "bytes_weights_streamed", "bytes_states_streamed",
             "compute_seconds", "smallest_budget")


def versions() -> dict:
    import highspy
    import pulp

    out = {"python": platform.python_version(), "torch": torch.__version__, "pulp": pulp.__version__,
           "cpus": os.cpu_count(), "machine": platform.machine(), "processor": platform.processor()}
    try:
        out["highs"] = highspy.Highs().version()
    except Exception:  # noqa: BLE001 - informational only
        out["highs"] = "unknown"
    return out


def run_one(layers: int, fractions: list[float], time_limit: float, measure: bool, d_model: int, seq: int,
            batch: int) -> list[dict]:
    cfg = GPTConfig(n_layers=layers, d_model=d_model, seq=seq, n_heads=max(1, d_model // 64))
    model = GPT(cfg)
    started = time.perf_counter()
    device = "cuda" if measure and torch.cuda.is_available() else "cpu"
    tg = trace(model.to(device), lm_loss, example_batch(cfg, batch=batch, device=device),
               optimizer=torch.optim.AdamW(model.parameters()))
    trace_seconds = time.perf_counter() - started
    costs = CostModel(device=device, measure=measure)
    costs.annotate(tg)
    alignment = 256
    peak = tg.live_peak(alignment=alignment)
    rows = []
    for frac in fractions:
        budget = int(frac * peak)
        started = time.perf_counter()
        try:
            plan = planners.plan(tg, budget, method="ilp", time_limit=time_limit, costs=costs, alignment=alignment)
        except ValueError as err:  # InfeasibleBudget
            rows.append({"layers": layers, "fraction": frac, "budget": budget, "error": str(err)})
            log.info("%2d layers at %3.0f%%: %s", layers, frac * 100, err)
            continue
        seconds = time.perf_counter() - started
        row = {"layers": layers, "fraction": frac, "budget": budget, "unplanned_peak": peak,
               "vertices": len(tg.vertices), "trace_seconds": trace_seconds, "plan_seconds": seconds,
               "planner": plan.planner, "predicted_time": plan.predicted_time,
               "predicted_peak": plan.predicted_peak, "recomputed_vertices": len(plan.recompute),
               "offloaded_values": len(plan.offload), "cpu_homes": len(plan.home)}
        row.update({k: plan.stats.get(k) for k in STAT_KEYS})
        rows.append(row)
        gap = row["gap"]
        log.info("%2d layers at %3.0f%%: plan %.1fs (solver %.1fs, %s, gap %s), predicted %.3f ms vs greedy %s",
                 layers, frac * 100, seconds, row["solve_seconds"] or 0.0, row["status"],
                 f"{gap:.2%}" if gap is not None else "n/a", plan.predicted_time * 1e3,
                 f"{row['greedy_time'] * 1e3:.3f} ms" if row["greedy_time"] else "infeasible")
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 32])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--measure", action="store_true", help="measure op costs on this machine's CUDA device")
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_time.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("turnip.memgraph").setLevel(logging.WARNING)
    logging.getLogger("turnip.planners").setLevel(logging.WARNING)
    rows = []
    for layers in args.layers:
        rows.extend(run_one(layers, args.fractions, args.time_limit, args.measure, args.d_model, args.seq,
                            args.batch))
    result = {"benchmark": "plan_time", "command": "python -m turnip.bench.plan_time", "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "versions": versions(),
        "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    log.info("wrote %s", args.out)
    return result


if __name__ == "__main__":
    main()
