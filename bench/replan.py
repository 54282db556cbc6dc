"""Planner research without the GPU: export a model's traced step once on the GPU machine, then plan
and simulate it anywhere.

    # on the GPU machine (a minute per model): the step with its measured op costs, and eager's peak
    python -m turnip.bench.replan export --models gpt350m,gpt1.3b,llama --split 4 --out bench/results/h100/steps
    # anywhere, any number of times: every candidate compile would build, planned and simulated
    python -m turnip.bench.replan plan --step bench/results/h100/steps/step_gpt350m.step --budgets 0.6,0.5 \\
        [--planner-option reload_room=true]

``export`` writes ``step_<model>.step`` (ir/step_file.py: the TaskGraph with each vertex's time and
workspace as the GPU measured them, no weights) and ``step_<model>.json`` (the device, the measured
link bandwidths, eager's measured peak and step). ``plan`` builds what ``memgraph.compile`` builds on
CUDA with planner "auto" (every plan of planners.driver.plan_candidates, both walks of the builder)
and prints, per candidate, the planner's own prediction, the timing simulator's step time (the
figure compile picks by; within 1-9% of the H100's measured steps in bench/results/h100), bytes
moved each way and values recomputed; it writes the rows to ``replan_<model>.json``. The
prediction is the simulator's, not a measurement: a plan it favours is worth a GPU run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

from ..engine.timing_sim import idle_by_wait, simulate, transfer_bytes
from ..ir.budget import format_bytes, parse_budget
from ..ir.costs import HostLinks
from ..ir.errors import InfeasibleBudget
from ..ir.plan import Plan
from ..ir.step_file import load_step, save_step
from ..memgraph.builder import build_walks
from ..memgraph.compiler import (
    Built,
    built_on_every_device,
    built_walks,
    compact_walks,
    everything_kept,
    favourite_refused,
    plan_step,
)
from ..memgraph.keep_transfers import keep_transfers
from ..memgraph.progress import Phases
from ..memgraph.remake_offloaded import recompute_evicted
from ..planners.costs import CostModel, DeviceSpec, default_costs
from ..planners.measure import device_name
from ..trace.tracer import trace_step
from .models.sizes import make_workload
from .options import planner_options
from .peers.common import Workload
from .peers.isolated import resolve
from .results import result_path, run_metadata

log = logging.getLogger(__name__)

ALIGNMENT = 256  # compile's arena alignment on CUDA


def export(workload: Workload, device: str, out: Path, eager: bool = True, loss_blocks: int | None = None,
           analytic_cuda: bool = False, devices: int = 1, casts_travel: bool = False) -> Path:
    """Trace ``workload`` for ``device`` (its loss head in ``loss_blocks`` row blocks when given,
    trace/split_loss.py), measure its op costs there, write the step and its facts. analytic_cuda:
    no GPU at hand: trace on ``device`` (the CPU) and price the ops with the analytic H100-class
    model as a CUDA step (a stand-in for planner experiments, not the GPU's measured costs).
    devices: N > 1 traces the step over N devices of ``device``'s kind (compile's ``devices=N``),
    each on the workload's batch; the device-to-device bandwidth is measured when N GPUs exist.
    casts_travel: the layout compile plans beside replicas below the unplanned peak (each trained
    weight's autocast cast made once, on its owner, and sent; trace/data_parallel.py), "_casts" in
    the file's name."""
    started = time.perf_counter()
    model = workload.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    tg = trace_step(model, workload.loss_fn, workload.batch_on(device), optimizer=workload.optimizer(trainable),
                    device=device, loss_blocks=loss_blocks, devices=devices).finished(casts_travel=casts_travel)
    if analytic_cuda:
        tg.device = "cuda"  # priced and planned as a CUDA step: launches cost host time, links are PCIe
        costs = CostModel(device="cuda", measure=False)
    else:
        costs = default_costs(tg)
    costs.annotate(tg)
    stem = f"step_{workload.name}" + (f"_split{loss_blocks}" if loss_blocks else "") + \
        (f"_x{devices}" if devices > 1 else "") + ("_casts" if casts_travel else "")
    save_step(tg, out / f"{stem}.step")
    priced = "analytic H100-class" if analytic_cuda else "measured" if costs.measure else "analytic"
    facts = {**run_metadata(), "model": workload.name, "loss_blocks": loss_blocks or 1, "costs": priced,
             "device": tg.device if analytic_cuda else device, "device_name": device_name(device),
             "h2d_bandwidth": costs.h2d_bandwidth, "d2h_bandwidth": costs.d2h_bandwidth,
             "duplex_bandwidth": costs.duplex_bandwidth, "d2d_bandwidth": costs.d2d_bandwidth, "devices": devices,
             "host_per_vertex": costs.host_per_vertex_on(tg.device), "vertices": len(tg.vertices),
             "host_links": dataclasses.asdict(costs.host_links), "host_update_rate": costs.host_update_rate,
             "export_seconds": None}
    if eager:  # the suite's budgets are fractions of eager's measured peak: keep it beside the step
        result = resolve("eager")(workload, device, 3, warmup=1)
        facts.update(eager_status=result.status, eager_peak_allocated=result.peak_allocated,
                     eager_step_s=result.stats().get("step_s_median") if result.status == "ok" else None)
    facts["export_seconds"] = time.perf_counter() - started
    (out / f"{stem}.json").write_text(json.dumps(facts, indent=1))
    log.info("%s: %d vertices exported to %s in %.1fs", workload.name, len(tg.vertices), out / f"{stem}.step",
             facts["export_seconds"])
    return out / f"{stem}.step"


def offline_costs(facts: dict) -> CostModel:
    """A cost model that measures nothing: the op times are in the step, the link and host rates
    are the exporting machine's (facts["host_links"], {"h2d":, "d2h":, "both":} bytes/s, where
    given: what the host moves over every device's link together; facts["host_update_rate"], where
    given: parameters per second its cores update beside the copies)."""
    spec = DeviceSpec(name=facts.get("device_name", "exported"), h2d=facts["h2d_bandwidth"],
                      duplex=facts.get("duplex_bandwidth"), d2d=facts.get("d2d_bandwidth", DeviceSpec.d2d),
                      d2h=facts["d2h_bandwidth"], host_per_vertex=facts["host_per_vertex"],
                      host_links=HostLinks(**facts.get("host_links", {})),
                      host_update_rate=facts.get("host_update_rate", DeviceSpec.host_update_rate))
    return CostModel(device="cuda", spec=spec, measure=False)


def replan(step: Path, budgets: list[str], options: dict, host_update: str = "off",
           eager_peak: int | None = None, host_links: HostLinks | None = None) -> list[dict]:
    """One row per candidate MemGraph per budget (see the module docstring). eager_peak: the bytes
    fractional budgets are of (default: eager's peak allocated, as exported)."""
    tg = load_step(step)
    facts = json.loads(step.with_suffix(".json").read_text())
    if facts.get("eager_peak_allocated") is None and (facts.get("loss_blocks", 1) > 1 or facts.get("devices", 1) > 1):
        # a split or multi-device export: eager's facts (one GPU's) are the plain export's
        sibling = step.with_name(f"step_{facts['model']}.json")
        if sibling.exists():
            unsplit = json.loads(sibling.read_text())
            facts.update({k: unsplit.get(k) for k in ("eager_peak_allocated", "eager_step_s")})
    if host_links is not None:
        facts["host_links"] = dataclasses.asdict(host_links)
    costs = offline_costs(facts)
    costs.annotate(tg)  # only vertices without a time (none in an exported step) are estimated
    peak = everything_kept(tg, ALIGNMENT)[1]
    eager_peak = eager_peak or facts.get("eager_peak_allocated")
    rows = []
    for text in budgets:
        rows += _rows_at(tg, facts, costs, text, budget_bytes(text, eager_peak, peak), peak, eager_peak, options,
                         host_update)
        best = min((r for r in rows if r["budget"] == text), key=lambda r: r["simulated_s"], default=None)
        if best is not None:
            best["picked"] = True  # what compile would take
    return rows


def _rows_at(tg, facts: dict, costs, text: str, budget: int, peak: int, eager_peak: int | None, options: dict,
             host_update: str) -> list[dict]:
    """replan's rows at one budget: each candidate compile would plan and build, simulated; on
    several devices planned again for less where no candidate fits every device, as compile does
    (built_on_every_device)."""
    plan_s = [0.0]  # seconds spent planning this budget (every plan made again included)

    def planned(scale: float) -> list[Plan]:
        """compile's plans on CUDA with planner "auto" (plan_step)."""
        started = time.perf_counter()
        plans = plan_step(tg, budget, None, "auto", torch.device("cuda"), costs, ALIGNMENT,
                          Phases([], enabled=False), options, host_update, scale)
        plan_s[0] += time.perf_counter() - started
        return plans

    def simulated(plans: list[Plan]) -> tuple[list[dict], InfeasibleBudget | None]:
        """A row per walk of each plan that builds (compile's built_walks), and of each plan amended
        as compile tries on its pick; as compile's build_candidates the refusal of a plan predicted
        faster than those; the builder's refusal where none builds."""

        def row(k: int, plan: Plan, walk: str, mg) -> dict:
            sim = simulate(mg, costs, backend="cuda")
            moved_in, moved_out = transfer_bytes(mg)
            return {
                "model": facts.get("model"), "loss_blocks": facts.get("loss_blocks", 1), "budget": text,
                "budget_bytes": budget, "unplanned_peak": peak, "eager_peak_allocated": eager_peak,
                "eager_step_s": facts.get("eager_step_s"), "candidate": f"{plan.planner}#{k}/{walk}",
                "variant": plan.stats.get("variant"),
                "planner_predicted_s": plan.predicted_time, "simulated_s": sim.step_time,
                "sim_compute_idle_s": sim.compute_idle, "sim_idle_by_wait_s": idle_by_wait(mg, sim),
                "bytes_h2d": moved_in, "bytes_d2h": moved_out,
                "recomputed": sum(1 for v in mg.taskgraph.vertices if v.recompute_of >= 0),
                "arena_bytes": mg.arena_bytes, "cpu_bytes": mg.cpu_bytes,
                "vertices": mg.summary()["vertices"], "plan_seconds": plan_s[0], "options": options}

        if plans[0].planner == "none":  # as compile's keep_everything, the apart walk beside the others
            built = [Built(0, plans[0], walk, mg) for walk, mg in
                     build_walks(tg, plans[0], alignment=ALIGNMENT, walks=("ahead", "apart", "compact")).items()]
            refused = []
        else:
            built, refused = built_walks(tg, plans, ALIGNMENT, costs, "cuda", compact_walks(budget, peak), stand=True)
        for plan, exc in refused:
            log.warning("%s does not build: %s", plan.planner, exc)
        found = [row(b.index, b.plan, b.walk, b.mg) for b in built]
        for b in built:
            if b.walk != "ahead" or b.plan.planner == "none":
                continue
            amended = recompute_evicted(tg, b.plan, b.mg, costs)  # as compile tries on its pick
            if amended is not None:
                mg = build_walks(tg, amended, alignment=ALIGNMENT, walks=("ahead",))["ahead"]
                found.append(row(b.index, b.plan, "ahead+recomputed evictions", mg))
            kept = keep_transfers(tg, b.plan)  # as compile tries on its pick too, in its walk
            if kept is not None:
                try:
                    found += [row(b.index, b.plan, f"{walk}+copies kept", mg)
                              for walk, mg in build_walks(tg, kept, alignment=ALIGNMENT).items()]
                except InfeasibleBudget as exc:
                    log.warning("%s#%d with its copies between devices kept does not build: %s", b.plan.planner,
                                b.index, exc)
        if not found and refused:
            raise min((exc for _, exc in refused), key=lambda exc: exc.minimum or 0)
        return found, favourite_refused(refused, [b.plan for b in built])

    try:
        if budget >= peak:  # nothing to plan: what compile's keep_everything chooses between
            return simulated([Plan(gpu_budget=budget, planner="none")])[0]
        return built_on_every_device(planned(1.0), simulated, planned, budget, tg.devices,
                                     faster=lambda rows, more: rows + more)
    except InfeasibleBudget as exc:
        log.warning("budget %s: no plan builds (%s)", text, exc)
        return []


def budget_bytes(text: str, eager_peak: int | None, peak: int) -> int:
    """A fraction of eager's measured peak (as the suite's budgets), or a size ("7.5GiB")."""
    try:
        fraction = float(text)
    except ValueError:
        return parse_budget(text, peak)
    return int(fraction * eager_peak) if eager_peak else parse_budget(fraction, peak)


def variant_regret(tables: list[list[dict]]) -> list[dict]:
    """For every subset of the planning problems (a plan's "variant": its headroom, max_chain) met
    in the tables (each the rows of one step at one budget), how much slower the fastest simulated
    candidate of the subset is than the fastest of all: the worst and the mean over the tables,
    fewest problems first, then best worst case."""
    best = []  # per table: variant -> fastest simulated seconds of its candidates
    for rows in tables:
        fastest: dict[str, float] = {}
        for row in rows:
            key = json.dumps(row.get("variant") or {}, sort_keys=True)
            fastest[key] = min(fastest.get(key, math.inf), row["simulated_s"])
        if fastest:
            best.append(fastest)
    variants = sorted({key for fastest in best for key in fastest})
    out = []
    for count in range(1, len(variants) + 1):
        for subset in itertools.combinations(variants, count):
            slower = [min(fastest.get(v, math.inf) for v in subset) / min(fastest.values()) - 1 for fastest in best]
            out.append({"variants": [json.loads(v) for v in subset], "worst": max(slower),
                        "mean": sum(slower) / len(slower), "tables": len(slower)})
    return sorted(out, key=lambda r: (len(r["variants"]), r["worst"]))


def format_rows(rows: list[dict]) -> str:
    eager = next((r["eager_step_s"] for r in rows if r.get("eager_step_s")), None)
    lines = [(f"{'budget':>8} {'candidate':<18} {'planner ms':>10} {'sim ms':>8} {'vs eager':>8} {'in':>10} "
              f"{'out':>10} {'recomputed':>10}  picked")]
    for r in rows:
        ratio = f"{r['simulated_s'] / eager:.2f}x" if eager else "-"
        planned = f"{r['planner_predicted_s'] * 1e3:.1f}" if r["planner_predicted_s"] else "-"
        lines.append(f"{r['budget']:>8} {r['candidate']:<18} {planned:>10} {r['simulated_s'] * 1e3:>8.1f} {ratio:>8} "
                     f"{format_bytes(r['bytes_h2d'], compact=True):>10} {format_bytes(r['bytes_d2h'], compact=True):>10} "
                     f"{r['recomputed']:>10}  {'*' if r.get('picked') else ''}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnip.bench.replan", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="trace and measure on this machine's GPU; write step files")
    ex.add_argument("--models", default="gpt350m", help="comma-separated bench models")
    ex.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ex.add_argument("--out", default=None, help="folder (default bench/results/steps)")
    ex.add_argument("--no-eager", action="store_true", help="skip measuring eager's peak (budgets then are "
                    "fractions of the unplanned peak)")
    ex.add_argument("--analytic-cuda", action="store_true", help="no GPU: trace on --device and price the step with "
                    "the analytic H100-class model as a CUDA step (planner experiments only)")
    ex.add_argument("--devices", default="1", help="comma-separated device counts: each exported as a step over that "
                    "many devices (compile's devices=N), e.g. 1,2,4")
    ex.add_argument("--casts-travel", action="store_true", help="the steps over several devices in the layout "
                    "compile plans beside replicas below the unplanned peak: weights' casts made on their owner and sent")
    ex.add_argument("--split", default="", help="comma-separated row-block counts: also export the step with its "
                    "loss head split (trace/split_loss.py), e.g. 4,8")
    pl = sub.add_parser("plan", help="plan and simulate an exported step at some budgets")
    pl.add_argument("--step", required=True, help="a step_<model>.step file (its .json beside it)")
    pl.add_argument("--budgets", default="0.6,0.5", help="fractions of eager's measured peak, or sizes")
    pl.add_argument("--planner-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a planner option (value read as JSON), e.g. time_limit=10; repeatable")
    pl.add_argument("--out", default=None, help="folder for replan_<model>.json (default: the step's)")
    pl.add_argument("--eager-peak", type=int, default=None, help="bytes fractional budgets are of (default: "
                    "eager's peak allocated, measured at export)")
    pl.add_argument("--host-update", default="off", choices=("auto", "off", "all"),
                    help="optimizer updates on the host's cores, as memgraph.compile's host_update")
    pl.add_argument("--host-links", default=None, metavar="H2D,D2H,BOTH",
                    help="bytes/s the host moves over every device's link together, each way and both at once "
                         "('none' for no cap), e.g. 164e9,128e9,190e9 (four H100s of one host)")
    rg = sub.add_parser("regret", help="which planning problems' candidates win: the fastest simulated candidate of "
                        "each subset of problems against the fastest of all, over replan files")
    rg.add_argument("files", nargs="+", help="replan JSON files (each one step's rows at one or more budgets)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if args.command == "export":
        out = Path(args.out) if args.out else result_path("x").parent / "steps"
        out.mkdir(parents=True, exist_ok=True)
        for name in [m for m in args.models.split(",") if m]:
            workload = make_workload(name)
            eager = not (args.no_eager or args.analytic_cuda)  # a CPU eager step measures no GPU peak
            for k, count in enumerate(int(x) for x in args.devices.split(",") if x):
                export(workload, args.device, out, eager=eager and k == 0, analytic_cuda=args.analytic_cuda,
                       devices=count, casts_travel=args.casts_travel and count > 1)
            for k in [int(x) for x in args.split.split(",") if x]:
                export(workload, args.device, out, eager=False, loss_blocks=k, analytic_cuda=args.analytic_cuda)
        return 0
    if args.command == "regret":
        tables = []
        for name in args.files:
            blob = json.loads(Path(name).read_text())
            rows = blob["rows"] if isinstance(blob, dict) else blob
            for budget in dict.fromkeys(row["budget"] for row in rows):
                tables.append([row for row in rows if row["budget"] == budget])
        for result in variant_regret(tables):
            print(f"worst {result['worst']:+7.1%}  mean {result['mean']:+7.2%}  over {result['tables']}: "
                  f"{' + '.join(json.dumps(v) for v in result['variants'])}")
        return 0
    options = planner_options(args.planner_option)
    step = Path(args.step)
    host_links = None
    if args.host_links:
        h2d, d2h, both = (None if x.strip() == "none" else float(x) for x in args.host_links.split(","))
        host_links = HostLinks(h2d=h2d, d2h=d2h, both=both)
    rows = replan(step, [b for b in args.budgets.split(",") if b], options, args.host_update, args.eager_peak,
                  host_links)
    out = Path(args.out) if args.out else step.parent
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"replan_{rows[0]['model'] if rows else step.stem}.json"
    path.write_text(json.dumps({"benchmark": "replan", "step": str(step), **run_metadata(), "rows": rows}, indent=1))
    print(format_rows(rows))
    for row in rows:
        if row.get("picked"):
            waits = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in list(row["sim_idle_by_wait_s"].items())[:4])
            print(f"{row['budget']} {row['candidate']}: GPU idle {row['sim_compute_idle_s'] * 1e3:.1f} ms, "
                  f"waiting on: {waits}")
    print(f"rows in {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
