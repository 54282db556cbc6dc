"""Reload reservations on a device: one plan built with and without them, run alternately.

    python -m turnip.bench.prefetch_ab --model gpt1.3b --budget 9297220096 [--rounds 3] [--steps 4]

The allocate-ahead walk of the builder reserves a reload's bytes when its reader enters the
allocation horizon (memgraph/horizons.py), so the reload may start once those bytes are free
instead of when the step before its reader frees some. This compiles a bench model's step once
(compile's budget: bytes, a size such as 8.66GiB, or a fraction of the unplanned peak), rebuilds the
allocate-ahead walk of its plan both ways (memgraph.build.rebuild_ahead), and times the two
MemGraphs alternately on one device, each beside its simulated step. Needs a CUDA device. Writes
bench/results/prefetch_ab_<model>.json.
"""

from __future__ import annotations

import argparse
import logging

import torch

from .. import memgraph
from ..engine.timing_sim import simulate, transfer_bytes
from ..ir.optimizer import CompiledOptimizer
from ..memgraph.builder import rebuild_ahead
from ..planners.costs import CostModel
from .models.sizes import make_workload
from .peers.common import ab_arguments, run_alternately, trainable
from .results import run_metadata, write_result

log = logging.getLogger(__name__)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m turnip.bench.prefetch_ab", description=__doc__.split("\n")[0])
    ab_arguments(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if not torch.cuda.is_available():
        raise SystemExit("prefetch_ab needs a CUDA device")
    workload = make_workload(args.model)
    batch = workload.batch_on("cuda")
    optimizer = workload.optimizer(trainable(workload.model))
    budget = int(args.budget) if args.budget.isdigit() else args.budget
    compiled = memgraph.compile(workload.model, workload.loss_fn, batch, optimizer=optimizer, budget=budget,
                                device="cuda", verbose=False)
    costs = CostModel(device="cuda")
    builds = {}
    for name, prefetch in (("reservations", True), ("no reservations", False)):
        mg = rebuild_ahead(compiled, prefetch)
        mg.optimizer = CompiledOptimizer(mg, optimizer)
        builds[name] = mg
    compiled.release(keep=False)
    rows = {name: {"simulated_s": simulate(mg, costs, backend="cuda").step_time,
                   "bytes_h2d": transfer_bytes(mg)[0], "bytes_d2h": transfer_bytes(mg)[1],
                   "reload_reservations": mg.stats.get("reload_reservations", 0), "steps_s": []}
            for name, mg in builds.items()}
    def write(rounds_done: int) -> None:
        write_result(f"prefetch_ab_{args.model}.json",
                     {**run_metadata(), "benchmark": "prefetch_ab", "model": args.model, "budget": args.budget,
                      "gpu_budget": compiled.plan.gpu_budget, "planner": compiled.plan.planner,
                      "rounds": args.rounds, "rounds_done": rounds_done, "rows": rows})

    run_alternately(builds, rows, batch, args.rounds, args.steps, args.warmup, after_round=write)
    for name, row in rows.items():
        log.info("%-16s median %.1f ms, simulated %.1f ms, %d reload reservations", name, row["median_s"] * 1e3,
                 row["simulated_s"] * 1e3, row["reload_reservations"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
