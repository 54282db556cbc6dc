"""A step over several ranks simulated without the GPUs: each rank alone, and every rank together.

    python -m turnip.bench.replan_ranks --step bench/results/h200x2/steps/step_gpt1.3b_x2_s6.step \\
        --ranks 2 --budgets 1.0,0.5 --eager-peak 39829110784 --rank-bandwidth 340.8e9

The step is one exported by ``replan export --devices N`` (a step over N devices with the op times
measured on the GPU machine); it is cut into ``--ranks`` ranks of N / ranks devices each, as
compile cuts it over a process group (trace/ranks.py: the shared message order, each rank's
slice). Each rank is planned greedily at the budget (nothing planned where its step fits), built
and simulated alone (``engine.simulate``, the prediction a rank's compile makes: its peer always
ready) and beside the others (``engine.simulate_ranks``: a message moves once both ranks posted
it). ``--rank-bandwidth``: bytes/s of a message between ranks (NCCL between two H200s of one host
moved 340.8 GB/s each way, bench/results/2026-11-28_h200x2_ranks.md). Writes
``ranks_sim_<model>.json`` beside the step (or under --out).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from .. import engine
from ..ir.plan import Plan
from ..ir.step_file import load_step
from ..memgraph.builder import build
from ..memgraph.compiler import everything_kept
from ..memgraph.segments import find_segments
from ..planners.driver import run_plan
from ..planners.model import step_order
from ..trace.ranks import message_order, rank_slice
from .replan import ALIGNMENT, budget_bytes, offline_costs
from .results import run_metadata

log = logging.getLogger(__name__)


def ranks_rows(step: Path, ranks: int, budgets: list[str], eager_peak: int | None, rank_bandwidth: float) -> list[dict]:
    """One row per budget: each rank's solo and joint simulated step (seconds) and the step's, the
    slowest rank's."""
    tg = load_step(step)
    facts = json.loads(step.with_suffix(".json").read_text())
    if tg.devices % ranks:
        raise ValueError(f"{step} is a step over {tg.devices} devices, which do not divide among {ranks} ranks")
    costs = offline_costs(facts)
    costs.rank_bandwidth = rank_bandwidth
    costs.annotate(tg)
    order = message_order(tg, step_order(tg), ranks)
    parts = [rank_slice(tg, r, ranks, order=order) for r in range(ranks)]
    rows = []
    for text in budgets:
        started = time.perf_counter()
        mgs = []
        for part in parts:
            costs.annotate(part)
            peak = everything_kept(part, ALIGNMENT)[1]
            budget = budget_bytes(text, eager_peak or facts.get("eager_peak_allocated"), peak)
            plan = (Plan(gpu_budget=budget, planner="none") if peak <= budget else
                    run_plan(part, budget, method="greedy", costs=costs))
            mg = build(part, plan, alignment=ALIGNMENT)
            mg.segments = find_segments(mg)
            mgs.append(mg)
        solo = [engine.simulate(mg, costs).step_time for mg in mgs]
        joint = [res.step_time for res in engine.simulate_ranks(mgs, costs)]
        rows.append({"model": facts.get("model"), "budget": text, "ranks": ranks, "devices_per_rank": tg.devices // ranks,
                     "rank_bandwidth": rank_bandwidth, "planner": [mg.plan.planner for mg in mgs],
                     "solo_s": solo, "joint_s": joint, "step_solo_s": max(solo), "step_joint_s": max(joint),
                     "messages_per_rank": [sum(v.op.startswith("turnip::") for v in p.vertices) for p in parts],
                     "seconds": time.perf_counter() - started})
        log.info("%s: alone %s ms, together %s ms", text, [round(s * 1e3, 1) for s in solo],
                 [round(s * 1e3, 1) for s in joint])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnip.bench.replan_ranks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", required=True, help="a step_<model>_x<N>.step file over N devices (its .json beside it)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--budgets", default="1.0,0.5", help="per GPU: fractions of eager's peak, or sizes")
    parser.add_argument("--eager-peak", type=int, default=None, help="bytes fractional budgets are of (default: "
                        "eager's peak allocated, measured at export)")
    parser.add_argument("--rank-bandwidth", type=float, default=340.8e9, help="bytes/s of a message between ranks")
    parser.add_argument("--out", default=None, help="folder for ranks_sim_<model>.json (default: the step's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    step = Path(args.step)
    rows = ranks_rows(step, args.ranks, [b for b in args.budgets.split(",") if b], args.eager_peak, args.rank_bandwidth)
    out = Path(args.out) if args.out else step.parent
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ranks_sim_{rows[0]['model'] if rows else step.stem}.json"
    path.write_text(json.dumps({"benchmark": "replan_ranks", "step": str(step), **run_metadata(), "rows": rows},
                               indent=1))
    for row in rows:
        print(f"{row['budget']}: {row['ranks']} ranks x {row['devices_per_rank']}: alone "
              f"{row['step_solo_s'] * 1e3:.1f} ms, together {row['step_joint_s'] * 1e3:.1f} ms")
    print(f"rows in {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
