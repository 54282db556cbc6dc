"""How long the greedy planner takes on exported steps, with its moves checked incrementally (the
default: a move rechecks only the groups it can affect, planners/memory.read_closure) and with
every group checked at every move, the reference it must agree with.

    python -m turnip.bench.greedy_time [--models gpt1.3b,llama] [--budgets 0.5,0.25] [--repeat 2]

Reads ``bench/results/h100/steps/step_<model>.step`` (``python -m turnip.bench.replan export``),
plans at each budget (a fraction of eager's peak, as exported) with the default headroom, and
writes bench/results/greedy_time.json: per model, budget and mode the best wall seconds of
``greedy`` and of ranking the moves of every strategy, and the plan's objective (equal in both
modes, or the run fails).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..ir.step_file import load_step
from ..memgraph.compiler import planning_budget
from ..planners import greedy as greedy_module
from ..planners.driver import make_problem
from .replan import offline_costs
from .results import result_path, run_metadata

STEPS = Path(__file__).resolve().parent / "results" / "h100" / "steps"


def every_group(problem, changed) -> set[int]:
    return set(range(len(problem.groups)))


def time_modes(problem, repeat: int) -> dict:
    out = {}
    incremental = greedy_module.read_closure
    for mode, closure in (("every group", every_group), ("incremental", incremental)):
        greedy_module.read_closure = closure
        try:
            planned, ranked = [], []
            for _ in range(repeat):
                started = time.perf_counter()
                dec, ev, _ = greedy_module.greedy(problem)
                planned.append(time.perf_counter() - started)
                started = time.perf_counter()
                for strategy in greedy_module.STRATEGIES:
                    greedy_module.rank_moves(problem, strategy)
                ranked.append(time.perf_counter() - started)
        finally:
            greedy_module.read_closure = incremental
        out[mode] = {"greedy_s": min(planned), "rank_moves_s": min(ranked), "objective": ev.objective,
                     "decisions": [dec.groups, dec.cpu]}
    if out["every group"]["decisions"] != out["incremental"]["decisions"]:
        raise RuntimeError("the incremental checks changed the greedy plan")
    for mode in out.values():
        del mode["decisions"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnip.bench.greedy_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt1.3b,llama")
    parser.add_argument("--budgets", default="0.5,0.25")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    rows = []
    for model in [m for m in args.models.split(",") if m]:
        step = STEPS / f"step_{model}.step"
        tg = load_step(step)
        facts = json.loads(step.with_suffix(".json").read_text())
        costs = offline_costs(facts)
        costs.annotate(tg)
        for budget in [float(b) for b in args.budgets.split(",") if b]:
            gpu = planning_budget(tg, int(budget * facts["eager_peak_allocated"]))
            problem = make_problem(tg, gpu, None, costs, alignment=256)
            modes = time_modes(problem, args.repeat)
            rows.append({"model": model, "budget": budget, "groups": len(problem.groups), **modes})
            print(f"{model} {budget:g}: greedy {modes['every group']['greedy_s']:.2f} s -> "
                  f"{modes['incremental']['greedy_s']:.2f} s, ranking moves {modes['every group']['rank_moves_s']:.2f}"
                  f" s -> {modes['incremental']['rank_moves_s']:.2f} s")
    path = result_path("greedy_time.json")
    path.write_text(json.dumps({"benchmark": "greedy_time", **run_metadata(), "rows": rows}, indent=1))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
