"""How long memgraph.compile takes for a small Hugging Face GPT-2 on the CPU backend.

    python -m turnip.bench.compile_time [--budget 0.5] [--planners auto,greedy] [--time-limit S] [--runs 5]

A 30M-parameter GPT-2 (GPT2Config(n_embd=384, n_layer=6, n_head=6, n_positions=256), batch
4 x 128, AdamW), compiled with each planner at the budget (a fraction of the unplanned peak),
twice: first into an empty plan cache (planning), then again (the plan read back from the cache).
Per planner: wall seconds of both compiles, the planner that won and why, the greedy planner's and
the solver's seconds, the ILP's time limit (scaled to the problem unless --time-limit), and the
predicted step times of the plan and of the greedy plan (the planner's model, analytic H100-class
costs). Each planner's compiles run --runs times, each time in a fresh interpreter (a user's first
compile is cold), and the median is the figure; every run's seconds are kept. The target: the
default planner compiles in at most TARGET_S seconds (median) with a plan no slower than greedy's.
Writes bench/results/compile_time.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from .. import memgraph
from ..planners.driver import outcome
from ..planners.solver import join_abandoned
from .results import result_path, run_metadata

log = logging.getLogger(__name__)

TARGET_S = 2.0  # issue 32 (issue 14 asked 5 s): the 30M GPT-2 compiles in at most 2 s on a 2-core CPU


def gpt2_30m():
    import transformers  # optional: the bench extra

    cfg = transformers.GPT2Config(n_embd=384, n_layer=6, n_head=6, n_positions=256)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    batch = torch.randint(0, cfg.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    return model, batch


def timed_compile(model, batch, budget: float, planner: str, cache: str, options: dict):
    join_abandoned()  # an ILP left running by the previous compile would share the CPU with this one
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    mg = memgraph.compile(model, lambda m, b: m(input_ids=b, labels=b).loss, batch, optimizer=opt,
                          budget=budget, device="cpu", planner=planner, verbose=False, cache=cache, **options)
    return mg, time.perf_counter() - started


def measure(planner: str, budget: float, options: dict) -> dict:
    """One planner's row: both compiles (into an empty plan cache, then from it) in this process."""
    model, batch = gpt2_30m()
    with tempfile.TemporaryDirectory(prefix="turnip-plans-") as cache:
        mg, seconds = timed_compile(model, batch, budget, planner, cache, options)
        again, cached_seconds = timed_compile(model, batch, budget, planner, cache, options)
    stats = mg.plan.stats
    greedy_s = stats.get("greedy_time")
    return {
        "planner_requested": planner, "compile_s": seconds, "cached_compile_s": cached_seconds,
        "phase_seconds": mg.stats.get("compile_phase_seconds"),
        "unplanned_peak": mg.stats.get("unplanned_peak"), "budget_bytes": mg.plan.gpu_budget,
        "plan_cache": [mg.stats.get("plan_cache"), again.stats.get("plan_cache")],
        "planner": mg.plan.planner, "outcome": outcome(stats), "status": stats.get("status"),
        "greedy_s": stats.get("greedy_seconds"), "solve_s": stats.get("solve_seconds"),
        "time_limit": stats.get("time_limit"), "time_limit_source": stats.get("time_limit_source"),
        "predicted_step_s": mg.plan.predicted_time, "greedy_predicted_step_s": greedy_s,
        "no_worse_than_greedy": greedy_s is None or mg.plan.predicted_time <= greedy_s,
        "same_plan_when_cached": (again.plan.order, again.plan.recompute, again.plan.offload, again.plan.home)
        == (mg.plan.order, mg.plan.recompute, mg.plan.offload, mg.plan.home),
        "parameters": sum(p.numel() for p in model.parameters())}


def measured_in_a_new_process(planner: str, args) -> dict:
    """measure() in a fresh interpreter: a user's first compile pays the one-time costs of the
    process (PyTorch's fake-tensor dispatch cache fills on the first trace), so each run starts cold."""
    command = [sys.executable, "-m", "turnip.bench.compile_time", "--one", planner, "--budget", str(args.budget)]
    if args.time_limit is not None:
        command += ["--time-limit", str(args.time_limit)]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {planner} compile failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--planners", default="auto,greedy")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="the ILP's time limit in seconds (default: scaled to the problem)")
    parser.add_argument("--runs", type=int, default=5,
                        help="fresh processes per planner; the median is the figure (default 5)")
    parser.add_argument("--one", metavar="PLANNER", help=argparse.SUPPRESS)  # a run: prints its row as JSON
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    options = {} if args.time_limit is None else {"time_limit": args.time_limit}
    if args.one:
        print(json.dumps(measure(args.one, args.budget, options), default=str))
        return 0
    rows = []
    for planner in args.planners.split(","):
        runs = [measured_in_a_new_process(planner, args) for _ in range(args.runs)]
        seconds = sorted(run["compile_s"] for run in runs)
        row = dict(runs[0], compile_s=statistics.median(seconds), compile_s_runs=[run["compile_s"] for run in runs],
                   cached_compile_s=statistics.median(run["cached_compile_s"] for run in runs),
                   same_plan_every_run=all(run["predicted_step_s"] == runs[0]["predicted_step_s"] for run in runs))
        rows.append(row)
        greedy_s = row["greedy_predicted_step_s"]
        print(f"{planner:8s} compile {row['compile_s']:5.1f} s (median of {len(runs)}, {seconds[0]:.1f}-{seconds[-1]:.1f}), "
              f"again {row['cached_compile_s']:4.1f} s (cached plan)  planner {row['planner']}  "
              f"predicted {row['predicted_step_s'] * 1e3:.1f} ms "
              f"(greedy {greedy_s * 1e3 if greedy_s else float('nan'):.1f} ms)  {row['outcome']}")
    default = next((r for r in rows if r["planner_requested"] == "auto"), None)
    result = {"benchmark": "compile_time", "command": "python -m turnip.bench.compile_time", **run_metadata(),
              "model": "hf gpt2 30M", "budget": args.budget, "time_limit": args.time_limit, "runs": args.runs,
              "parameters": rows[0]["parameters"] if rows else None, "target_s": TARGET_S,
              "meets_target": None if default is None else
              default["compile_s"] <= TARGET_S and default["no_worse_than_greedy"], "rows": rows}
    path = result_path("compile_time.json")
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
