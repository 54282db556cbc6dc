"""Two sets of planner options on a device: one bench model compiled with each, run alternately.

    python -m turnip.bench.planner_ab --model gpt1.3b --budget 9297220096 --a depth=3 --b depth=5

A planner option that moves the simulated step (read offline from an exported step with
``python -m turnip.bench.replan plan``) is only worth a default once a device agrees, and a step's
time varies more between calls (machines) than most options move it. This compiles the model's
step once with options A and once with options B (each ``--a``/``--b`` a compile planner option,
KEY=VALUE, repeatable), and times the two MemGraphs alternately on one device, each beside its
simulated step and the bytes it moves. Needs a CUDA device. Writes
bench/results/planner_ab_<model>.json; with ``--timelines DIR`` also one more step of each traced
(``planner_ab_<model>_<side>.json``) beside the simulator's timeline of it (``.sim.json``), for
``python -m turnip.bench.trace_waits`` to show where the simulator misses the device.

    python -m turnip.bench.planner_ab --model gpt1.3b --budget 8.6587GiB --a planner=ilp --b planner=greedy \
        --timelines bench/results/h200
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from .. import engine, memgraph
from ..engine.timing_sim import simulate, transfer_bytes
from ..planners.costs import CostModel
from .models.sizes import make_workload
from .options import planner_options
from .peers.common import ab_arguments, run_alternately, trainable
from .results import run_metadata, write_result

log = logging.getLogger(__name__)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m turnip.bench.planner_ab", description=__doc__.split("\n")[0])
    ab_arguments(ap)
    ap.add_argument("--a", action="append", default=[], metavar="KEY=VALUE", help="planner option of side A")
    ap.add_argument("--b", action="append", default=[], metavar="KEY=VALUE", help="planner option of side B")
    ap.add_argument("--timelines", type=Path, default=None, metavar="DIR",
                    help="after the timed rounds, one traced step of each side and its simulated timeline here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if not torch.cuda.is_available():
        raise SystemExit("planner_ab needs a CUDA device")
    sides = {"A": planner_options(args.a), "B": planner_options(args.b)}
    if sides["A"] == sides["B"]:
        raise SystemExit(f"--a and --b give the same options ({sides['A']}): nothing to compare")
    workload = make_workload(args.model)
    batch = workload.batch_on("cuda")
    budget = int(args.budget) if args.budget.isdigit() else args.budget
    costs = CostModel(device="cuda")
    builds, rows = {}, {}
    for name, options in sides.items():
        optimizer = workload.optimizer(trainable(workload.model))
        mg = memgraph.compile(workload.model, workload.loss_fn, batch, optimizer=optimizer, budget=budget,
                              device="cuda", verbose=False, cache=False, **options)
        mg.release(keep=False)  # one arena and one pinned storage at a time
        builds[name] = mg
        moved_in, moved_out = transfer_bytes(mg)
        sim = simulate(mg, costs, backend="cuda")
        if args.timelines is not None:
            args.timelines.mkdir(parents=True, exist_ok=True)
            sim.write_timeline(args.timelines / f"planner_ab_{args.model}_{name}.sim.json", mg,
                               meta={"budget": mg.plan.gpu_budget, "options": options})
        rows[name] = {"options": options, "planner": mg.plan.planner, "simulated_s": sim.step_time,
                      "bytes_h2d": moved_in, "bytes_d2h": moved_out, "compile_s": mg.stats.get("compile_seconds"),
                      "steps_s": []}

    def write(rounds_done: int) -> None:
        write_result(f"planner_ab_{args.model}.json",
                     {**run_metadata(), "benchmark": "planner_ab", "model": args.model, "budget": args.budget,
                      "gpu_budget": builds["A"].plan.gpu_budget, "rounds": args.rounds, "rounds_done": rounds_done,
                      "rows": rows})

    run_alternately(builds, rows, batch, args.rounds, args.steps, args.warmup, after_round=write)
    if args.timelines is not None:
        for name, mg in builds.items():
            engine.run(mg, batch, timeline=args.timelines / f"planner_ab_{args.model}_{name}.json")
            mg.release(keep=False)
    for name, row in rows.items():
        log.info("%s %s: median %.1f ms, simulated %.1f ms, %.2f GiB in, %.2f GiB out", name, row["options"],
                 row["median_s"] * 1e3, row["simulated_s"] * 1e3, row["bytes_h2d"] / 2**30, row["bytes_d2h"] / 2**30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
