"""One compiled MemGraph run under several engine settings, alternating, beside eager in the same process.

    python -m turnip.bench.engine_variants --model gpt350m --budgets 0.5,0.25 --transfer-ahead 0,1,4 \\
        [--orderings nondeterministic,deterministic] [--completions events,callback] [--copy-streams 2,1] [--rounds 6] \\
        [--planner-option time_limit=8]
    python -m turnip.bench.engine_variants --tiny          # CPU, a small GPT: checks the command, no timings

A MemGraph fixes what runs and where; the engine still chooses how: the ordering (the ordering
ablation), how many copies each copy stream reports to the loop at enqueue (``engine.run``'s
``transfer_ahead``) and how the loop learns that work finished (``completion``: polled CUDA events or
stream callbacks, engine/completions.py). Each budget (a fraction of eager's peak measured here, as the suite's) is compiled
once; then every round runs each setting once, the settings' order rotated per round, so drift and
warm-up fall on all of them alike. Per setting: median, min and max step time, the losses (each run is
one more training step of the same weights), and the timing simulator's prediction of that setting
from the same op costs. Writes ``engine_variants_<model>.json`` under bench/results (or --out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from .. import engine, memgraph
from ..engine.timing_sim import simulate
from ..planners.costs import default_costs
from .models.sizes import make_workload
from .options import planner_options
from .peers.common import sync, trainable
from .peers.isolated import resolve
from .results import result_path, run_metadata

log = logging.getLogger(__name__)


def settings(orderings: list[str], transfer_ahead: list[int | None],
             completions: list[str | None] = (None,), copy_streams: list[int | None] = (None,)) -> list[dict]:
    """Every (ordering, transfer_ahead, completion, copy streams) combination; None is the engine's default."""
    return [{"ordering": o, "transfer_ahead": k, "completion": c, "copy_streams": n}
            for o, k, c, n in itertools.product(orderings, transfer_ahead, completions, copy_streams)]


def streams_of(setting: dict) -> dict | None:
    """engine.run's streams= for a setting: its copy streams per direction, or None (the default)."""
    n = setting.get("copy_streams")
    return None if n is None else {"h2d": n, "d2h": n}


def label(setting: dict) -> str:
    completion, copy_streams = setting.get("completion"), setting.get("copy_streams")
    return f"{setting['ordering']}, transfer_ahead={setting['transfer_ahead']}" + (
        f", {completion}" if completion else "") + (f", {copy_streams} copy streams" if copy_streams else "")


def run_budget(workload, device: str, budget: float, variants: list[dict], rounds: int, options: dict,
               deadline: float, rounds_limit_s: float | None = None) -> dict:
    """Compile ``workload`` at ``budget``, warm up, then up to ``rounds`` rounds of every variant, none
    begun past ``deadline`` (time.monotonic()) nor, given ``rounds_limit_s``, that many seconds after
    the warm-up (a limit on the rounds alone, whatever the compile took)."""
    example = workload.batch_on(device)
    started = time.perf_counter()
    mg = memgraph.compile(workload.model, workload.loss_fn, example, optimizer=workload.optimizer(
        trainable(workload.model)), budget=budget, device=device, verbose=False, **options)
    compile_s = time.perf_counter() - started
    batch = [example] * mg.taskgraph.devices if mg.taskgraph.devices > 1 else example  # options' devices=N
    times = {label(s): [] for s in variants}
    losses = {label(s): [] for s in variants}
    engine.run(mg, batch)  # warm-up: arena, pinned storage, segment capture
    engine.run(mg, batch)
    if rounds_limit_s is not None:
        deadline = min(deadline, time.monotonic() + rounds_limit_s)
    for r in range(rounds):
        if time.monotonic() > deadline:
            log.warning("time limit after %d rounds", r)
            break
        shift = r % len(variants)
        for setting in variants[shift:] + variants[:shift]:
            sync(device)
            t0 = time.perf_counter()
            out = engine.run(mg, batch, ordering=setting["ordering"], transfer_ahead=setting["transfer_ahead"],
                             completion=setting.get("completion"), streams=streams_of(setting))
            sync(device)
            times[label(setting)].append(time.perf_counter() - t0)
            losses[label(setting)].append(float(out["loss"]))
        log.info("round %d: %s", r, ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items() if v))
    costs = default_costs(mg.taskgraph)
    rows = []
    for setting in variants:
        t = sorted(times[label(setting)])
        sim = simulate(mg, costs, ordering=setting["ordering"], transfer_ahead=setting["transfer_ahead"],
                       backend=device, streams=streams_of(setting))
        rows.append({**setting, "step_s": times[label(setting)], "losses": losses[label(setting)],
                     "median_s": statistics.median(t) if t else None, "min_s": t[0] if t else None,
                     "max_s": t[-1] if t else None, "sim_step_s": sim.step_time,
                     "sim_compute_idle_s": sim.compute_idle})
    summary = mg.summary()
    mg.release(keep=False)
    return {"budget": budget, "compile_s": compile_s, "summary": summary, "vertices": summary["vertices"],
            "bytes_reloaded": summary["bytes_reloaded"], "bytes_offloaded": summary["bytes_offloaded"], "stats": {k: v for k, v in mg.stats.items()
                                                                 if isinstance(v, (int, float, str))},
            "settings": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnip.bench.engine_variants",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt350m")
    parser.add_argument("--budgets", default="0.5", help="comma-separated fractions of eager's measured peak")
    parser.add_argument("--transfer-ahead", default="0,2", help="comma-separated copies reported at enqueue")
    parser.add_argument("--orderings", default="nondeterministic")
    parser.add_argument("--completions", default="", help="comma-separated: events, callback (default: the "
                        "engine's default only)")
    parser.add_argument("--copy-streams", default="", help="comma-separated CUDA streams per copy direction "
                        "(default: the engine's, engine/resources.py DEFAULT_STREAMS)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--planner-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--tiny", action="store_true", help="a small model on the CPU (checks the command)")
    parser.add_argument("--time-limit", type=float, default=400.0, help="seconds for all rounds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    variants = settings([o for o in args.orderings.split(",") if o],
                        [int(k) for k in args.transfer_ahead.split(",") if k],
                        [c for c in args.completions.split(",") if c] or [None],
                        [int(n) for n in args.copy_streams.split(",") if n] or [None])
    workload = make_workload(args.model, tiny=args.tiny)
    eager = resolve("eager")(workload, device, 5, warmup=2)
    if eager.status != "ok":
        print(f"eager failed: {eager.error}", file=sys.stderr)
        return 1
    eager_stats = eager.stats()
    deadline = time.monotonic() + args.time_limit
    doc = {"benchmark": "engine_variants", **run_metadata(), "model": workload.name, "device_type": device,
           "eager_step_s": eager_stats.get("step_s_median"), "eager_peak_allocated": eager.peak_allocated,
           "budgets": {}}
    for text in [b for b in args.budgets.split(",") if b]:
        fraction = float(text)
        # without a measured peak (the CPU) the fraction is of the unplanned peak, as compile reads it
        budget_bytes = int(fraction * eager.peak_allocated) if eager.peak_allocated else fraction
        doc["budgets"][text] = run_budget(workload, device, budget_bytes, variants, args.rounds,
                                          planner_options(args.planner_option), deadline)
    out = Path(args.out) if args.out else result_path("x").parent
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine_variants_{workload.name}.json"
    path.write_text(json.dumps(doc, indent=1, default=str))
    eager_ms = doc["eager_step_s"] * 1e3 if doc["eager_step_s"] else None
    print(f"{workload.name} on {device}: eager {eager_ms:.1f} ms" if eager_ms else f"{workload.name} on {device}")
    for text, part in doc["budgets"].items():
        for row in part["settings"]:
            median = row["median_s"] * 1e3 if row["median_s"] else float("nan")
            ratio = f"{median / eager_ms:.2f}x eager" if eager_ms else ""
            print(f"  budget {text:>5} {label(row):<42} median {median:7.1f} ms "
                  f"[{(row['min_s'] or 0) * 1e3:.1f}, {(row['max_s'] or 0) * 1e3:.1f}] {ratio}  "
                  f"simulated {row['sim_step_s'] * 1e3:.1f} ms")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
