"""turnip on every GPU of a host (compile's devices=N) beside eager on one GPU and, where
bench/peers/distributed.py is importable, the peers users run on N GPUs (DDP, FSDP2, ...), each in
its own torchrun.

    python -m turnip.bench multi_gpu --devices 2 --model gpt1.3b --budgets 100%,50%,25%,20%,10%
    python -m turnip.bench multi_gpu --devices 3 --tiny --device cpu      # virtual CPU devices, < 1 min
    python -m turnip.bench multi_gpu --devices 4 --budgets 1.0,0.5,0.25 --peers ddp,fsdp2 --isolate
    python -m turnip.bench multi_gpu --devices 2 --budgets 1.0,0.5 --ranks   # and over 2 ranks (torchrun)
    python -m turnip.bench multi_gpu --devices 4 --budgets 1.0,0.5 --ranks --gpus-per-rank 2   # 2 ranks x 2 GPUs

With ``--isolate`` each turnip budget (the first with the eager rows) runs in a process of its own, as
the peers do, killed after ``--row-limit`` seconds: a crash or a device-side assert costs its row, a
budget starts on GPUs the last one left clean, and one command still writes one JSON file (rewritten after
every row, so a run cut short keeps what it measured). With
``--ranks`` each budget runs again as ``turnip-ranks``: one process per GPU (or per ``--gpus-per-rank``
GPUs) under torchrun, the step's devices split over ranks whose messages go through NCCL (compile's
process_group=; the same step).

Budgets are per device, fractions of single-GPU eager's peak (``AdamW()``, measured first in the same
run), as in the single-GPU suite. Every row records its device count, the median step, the spread,
each device's peak (turnip rows: the most any one device held), the simulator's prediction and the
bytes each step moves between devices and to and from the host. Results: one JSON file under
bench/results/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from .. import engine, memgraph
from ..engine.timing_sim import simulate, transfer_bytes
from ..ir.budget import format_bytes
from ..ir.memgraph import Stream
from ..planners.costs import CostModel
from .host_probe import host_probe
from .models.sizes import make_workload
from .peers import distributed, eager
from .peers.common import ERROR, OK, TIMEOUT, PeerResult, Workload, is_cuda, release_memory, trainable
from .peers.isolated import run_limited
from .peers.turnip_system import timed_turnip_steps
from .results import result_path

log = logging.getLogger(__name__)


def device_memory(device_type: str, count: int) -> list[dict]:
    """Each device's memory after the steps: peaks allocated and reserved, and what is held now."""
    if device_type != "cuda":
        return []
    return [{"peak_allocated": int(torch.cuda.max_memory_allocated(d)),
             "peak_reserved": int(torch.cuda.max_memory_reserved(d)),
             "allocated": int(torch.cuda.memory_allocated(d)), "reserved": int(torch.cuda.memory_reserved(d))}
            for d in range(count)]


def reset_peaks(device_type: str, count: int) -> None:
    if device_type == "cuda":
        for d in range(count):
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)


def d2d_bytes(mg) -> int:
    """Bytes copied between devices per step (the transfer vertices' writes)."""
    return sum(p.nbytes for mv in mg.vertices if mv.stream is Stream.D2D for p in mv.writes.values())


def run_turnip(workload: Workload, device_type: str, devices: int, budget: float, eager_peak: int | None,
               steps: int, warmup: int, timeline: Path | None = None, planner: str = "auto",
               host_update: str = "off", weight_layout: str = "auto") -> dict:
    """One turnip row: compile for `devices` devices within `budget` (a fraction of eager_peak per
    device, or of the unplanned peak without one), time the steps, read each device's peak.
    host_update: compile's (the updates on the host's cores: the workload's optimizer fused);
    weight_layout: compile's (the row records the layout taken and each layout's simulated step)."""
    result = PeerResult("turnip", extra={"devices": devices, "budget": budget, "planner_requested": planner,
                                         "host_update": host_update, "weight_layout_requested": weight_layout})
    arg = int(budget * eager_peak) if eager_peak else budget
    model = workload.model
    optimizer = workload.optimizer(trainable(model))
    fused = {"fused_optimizer": True} if host_update != "off" else {}
    # one device's batch per device, from host memory: each INPUT vertex copies it into its own device
    batch = [workload.batch_on("cpu") for _ in range(devices)] if devices > 1 else workload.batch_on(device_type)
    started = time.perf_counter()
    try:
        mg = memgraph.compile(model, workload.loss_fn, workload.batch_on(device_type), optimizer=optimizer,
                              budget=arg, device=device_type, devices=devices, planner=planner, verbose=False,
                              host_update=host_update, weight_layout=weight_layout, **fused)
    except memgraph.InfeasibleBudget as exc:
        result.status, result.error = "infeasible", str(exc)[:600]
        return result.row()
    result.extra.update(compile_s=time.perf_counter() - started, budget_bytes=mg.plan.gpu_budget,
                        arena_bytes=mg.arena_bytes, cpu_bytes=mg.cpu_bytes, vertices=len(mg.vertices),
                        segments=len(mg.segments), bytes_d2d=d2d_bytes(mg), planner=mg.plan.planner,
                        unplanned_peak=mg.stats.get("unplanned_peak"), host_updates=len(mg.plan.host_update),
                        weight_layout=mg.stats.get("weight_layout"),
                        weight_layouts_simulated_s=mg.stats.get("weight_layouts_simulated_s"),
                        simulated_candidates_s=mg.stats.get("simulated_candidates"),
                        compile_phase_s=mg.stats.get("compile_phase_seconds"))
    release_memory(device_type)
    reset_peaks(device_type, devices)
    result.extra["host_before"] = host_probe()  # was the host slow, busy or clocked down (bench/host_probe.py)
    timed_turnip_steps(result, mg, batch, steps, device_type, warmup=warmup)
    result.extra["host_after"] = host_probe()
    memory = device_memory(device_type, devices)
    result.extra["memory_per_device"] = memory
    result.extra["peak_reserved_per_device"] = [m["peak_reserved"] for m in memory] or [None] * devices
    result.peak_reserved = max((m["peak_reserved"] for m in memory), default=None)
    result.peak_allocated = max((m["peak_allocated"] for m in memory), default=None)
    result.bytes_h2d, result.bytes_d2h = transfer_bytes(mg)
    if timeline is not None:  # one more step, untimed, with the timeline of every unit on every device
        engine.run(mg, batch, timeline=timeline)
        result.extra["timeline"] = str(timeline)
    mg.release(keep=False)
    try:
        costs = CostModel(device=device_type, devices=mg.taskgraph.devices)
        if any(v.time <= 0 for v in mg.taskgraph.vertices):
            costs.annotate(mg.taskgraph)
        sim = simulate(mg, costs, backend="cuda")
        result.extra.update(sim_step_s=sim.step_time, sim_host_busy_s=sim.host_busy,
                            sim_host_per_launch_us=sim.host_per_vertex * 1e6)
    except Exception as exc:  # noqa: BLE001 - the measured steps stand without a prediction
        log.warning("simulation failed: %r", exc)
    release_memory(device_type)
    return result.row()


def run_eager(workload: Workload, device_type: str, steps: int, warmup: int, fused: bool) -> dict:
    """Eager on one device (its AdamW, or AdamW(fused=True)): the single-GPU reference row."""
    kw = {}
    if fused:
        kw["make_optimizer"] = lambda params: torch.optim.AdamW(params, **{**workload.optimizer.kwargs, "fused": True})
    result = eager.run_with("eager-fused" if fused else "eager", workload, device_type, steps, warmup=warmup, **kw)
    result.extra["devices"] = 1
    release_memory(device_type)
    return result.row()


def run_peers(model: str, devices: int, systems: list[str], steps: int, limit_s: float, tiny: bool) -> list[dict]:
    """The N-GPU peers, each in its own torchrun (bench/peers/distributed.py)."""

    rows = []
    for system in systems:
        log.info("peer %s on %d devices", system, devices)
        rows.append(distributed.run_distributed(system, model, devices, steps=steps, limit_s=limit_s, tiny=tiny))
    return rows


TAIL_LINES = 40


def run_budget_isolated(args, budget: float, eager_peak: int | None, eager: bool) -> dict:
    """The JSON document (rows, eager_peak, info) of one budget run by ``python -m turnip.bench multi_gpu``
    in a process of its own (measuring eager first where ``eager``, else given ``eager_peak``); where
    it wrote none, one row saying why."""
    with tempfile.TemporaryDirectory(prefix="turnip-multi-gpu-") as folder:
        out = Path(folder) / "rows.json"
        cmd = [sys.executable, "-m", "turnip.bench", "multi_gpu", "--devices", str(args.devices), "--model", args.model,
               "--device", args.device, "--budgets", f"{budget:g}", "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--planner", args.planner, "--host-update", args.host_update, "--no-plots",
               "--weight-layout", args.weight_layout, "--out", str(out)]
        cmd += ["--tiny"] * args.tiny + ["--one-device-too"] * args.one_device_too
        if not eager:
            cmd += ["--eager-peak", str(eager_peak)] if eager_peak is not None else ["--no-eager"]
        ran = run_limited(cmd, dict(os.environ, PYTHONUNBUFFERED="1"), args.row_limit,
                          lambda line: log.info("[%g] %s", budget, line), TAIL_LINES)
        if out.exists() and not ran.killed:
            return json.loads(out.read_text())
    status = TIMEOUT if ran.killed else ERROR
    error = (f"killed after {args.row_limit:.0f}s without a result" if ran.killed
             else f"exited with {ran.returncode} without a result")
    row = PeerResult("turnip", status=status, error=error,
                     extra={"devices": args.devices, "budget": budget, "log_tail": "\n".join(ran.tail)[-6000:]}).row()
    return {"rows": [row], "eager_peak": eager_peak}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m turnip.bench multi_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--model", default="gpt1.3b")
    parser.add_argument("--tiny", action="store_true", help="the model's tiny configuration (CPU, CI)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budgets", default="1.0,0.5,0.25,0.2,0.1", help="fractions of one-GPU eager's peak")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peers", default="", help="comma-separated systems of bench/peers/distributed.py")
    parser.add_argument("--peer-limit", type=float, default=240.0, help="seconds each peer may run")
    parser.add_argument("--eager-peak", type=int, default=None, help="one-GPU eager's peak bytes, measured by an "
                        "earlier run: the eager rows are skipped")
    parser.add_argument("--no-eager", action="store_true", help="no eager rows: without --eager-peak, budgets are "
                        "fractions of turnip's unplanned peak")
    parser.add_argument("--planner", default="auto", help="memgraph.compile's planner: auto, ilp, greedy, none")
    parser.add_argument("--host-update", default="off", choices=("off", "auto", "all"),
                        help="memgraph.compile's host_update (experimental): optimizer updates on the host's cores")
    parser.add_argument("--weight-layout", default="auto", choices=("auto", "replicas", "casts"),
                        help="memgraph.compile's weight_layout: replicas of every weight on every device, or the "
                             "weights' autocast casts made on their owners and sent; auto: the simulator picks")
    parser.add_argument("--one-device-too", action="store_true", help="turnip on one device at each budget too")
    parser.add_argument("--ranks", action="store_true", help="turnip over --devices ranks too at each budget (one "
                        "process per GPU under torchrun, compile's process_group=), beside the one-process rows")
    parser.add_argument("--gpus-per-rank", type=int, default=1, help="--ranks: GPUs each rank drives (--devices / "
                        "this ranks; 2 on 4 GPUs stands in for two hosts of two)")
    parser.add_argument("--timelines", action="store_true", help="a Perfetto timeline of one step per turnip row "
                        "(--ranks: one per rank)")
    parser.add_argument("--no-plots", action="store_true", help="no Pareto plot beside the JSON")
    parser.add_argument("--isolate", action="store_true", help="each turnip budget (the first with the eager rows) "
                        "in a process of its own")
    parser.add_argument("--row-limit", type=float, default=300.0, help="--isolate: seconds each budget's process may run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.isolate and args.timelines:
        parser.error("--timelines records in this process: run it without --isolate")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    rows, eager_peak = [], args.eager_peak
    budgets = [float(b.rstrip("%")) / (100 if b.endswith("%") else 1) for b in args.budgets.split(",") if b]
    out = Path(args.out) if args.out else result_path(f"multi_gpu_{args.model}_x{args.devices}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    name, info = args.model + ("-tiny" if args.tiny else ""), None

    def save() -> None:
        # after every row: a call cut short by its time limit keeps the rows it measured
        out.write_text(json.dumps({"model": name, "devices": args.devices, "device": args.device,
                                   "eager_peak": eager_peak, "info": info, "rows": rows}, indent=1, default=str))

    if args.isolate:  # this process never builds the model nor touches a GPU: each budget's own process does
        for budget in budgets:
            eager = eager_peak is None and not args.no_eager and not any(r["system"] == "eager" for r in rows)
            doc = run_budget_isolated(args, budget, eager_peak, eager)
            rows += doc["rows"]
            eager_peak = doc.get("eager_peak", eager_peak)
            name, info = doc.get("model", name), doc.get("info", info)
            save()
        budgets = []
    else:
        workload = make_workload(args.model, tiny=args.tiny)
        name, info = workload.name, workload.info
    if not args.isolate and eager_peak is None and not args.no_eager:
        rows.append(run_eager(workload, args.device, args.steps, args.warmup, fused=False))
        if is_cuda(args.device):
            rows.append(run_eager(workload, args.device, args.steps, args.warmup, fused=True))
        eager_peak = rows[0].get("peak_reserved") if rows[0]["status"] == OK else None
        save()
    for budget in budgets:
        for devices in ([1] if args.one_device_too else []) + [args.devices]:
            timeline = out.with_name(f"{out.stem}_d{devices}_{budget:g}.timeline.json") if args.timelines else None
            row = run_turnip(workload, args.device, devices, budget, eager_peak, args.steps, args.warmup, timeline,
                             args.planner, args.host_update, args.weight_layout)
            rows.append(row)
            log.info("turnip x%d @ %.0f%%: %s ms, peak %s per device", devices, budget * 100,
                     f"{row['step_s_median'] * 1e3:.1f}" if row.get("step_s_median") else row.get("error"),
                     format_bytes(row["peak_reserved"]) if row.get("peak_reserved") else "-")
            save()
    if args.ranks:
        for budget in budgets or [float(b) for b in sorted({r["budget"] for r in rows if r.get("budget")})]:
            rows.append(distributed.run_distributed(
                "turnip-ranks", args.model, args.devices, steps=args.steps, warmup=args.warmup, tiny=args.tiny,
                device=args.device, limit_s=args.peer_limit, planner=args.planner, gpus_per_rank=args.gpus_per_rank,
                budget=int(budget * eager_peak) if eager_peak else budget,
                timeline=out.with_name(f"{out.stem}_ranks_{budget:g}.timeline.json") if args.timelines else None)
                | {"budget": budget})
            save()
    for system in args.peers.split(",") if args.peers else []:
        rows += run_peers(args.model, args.devices, [system], args.steps, args.peer_limit, args.tiny)
        save()
    save()
    log.info("wrote %s", out)
    if not args.no_plots:
        from .plots import plot_pareto  # matplotlib is optional

        png = plot_pareto(rows, out.with_suffix(".png"),
                          title=f"{name} on {args.devices} devices: step time vs peak memory per device")
        log.info("drew %s", png)
    return rows
