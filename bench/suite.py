"""The benchmark suite: every system on every model, turnip at every budget, JSON rows + PNG plots.

Per model: eager first (its measured peak defines what a budget fraction means),
then the peers (no budget knob: each runs once and reports the memory it used),
then turnip at each budget, largest first. A budget is a fraction of eager's
measured peak (a float) or a size in bytes (an int: ``--budgets 16GiB,8GiB``,
for workloads whose eager does not fit or whose budgets are fixed sizes, like
the TURNIP paper's 7B LoRA at 16 and 8 GiB). Every row is written to
``suite_<model>[_<tag>].json`` as soon as it exists, so a command killed at its
time limit still leaves everything it measured. Each system runs in a process of
its own (``peers/isolated.py``; ``isolate="none"`` runs them in this one) under its
own time limit, and the command under a total one: a system that would start with
too little time left is a ``timeout`` row, and so are OOMs, infeasible budgets,
errors and crashes rows with a status, never a crash of the suite.

When every row is in, each row gets ``max_loss_diff`` (its largest |loss - eager's
loss| over the steps) and each turnip row its *same-memory* comparison: the
fastest other system whose measured peak fits in the memory turnip was given or
used, and turnip's speed-up over it (``same_memory``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..ir.budget import BudgetError, format_bytes, parse_budget
from .models.llama import Unavailable
from .models.sizes import make_workload
from .peers import CUDA_PEERS, PEERS, TORCH_PEERS
from .peers.common import EAGER_MATH, NOT_INSTALLED, OK, TIMEOUT, PeerResult, Workload, is_cuda
from .peers.isolated import WorkloadSpec, resolve, run_isolated, write_snapshot
from .results import run_metadata
from .trace_waits import explain_gaps, load_units, simulated_beside, summarize

log = logging.getLogger(__name__)

KNOWN_SYSTEMS = (*PEERS, "turnip")
# what a user picks between: eager, checkpointing, turnip and the offloading packages. torch's
# save_on_cpu pair (offload, checkpoint_offload) is left to --systems torch: on gpt1.3b it moves
# 19.6 GB each way at 5.6x eager's step (bench/results/h100/older/suite_gpt1.3b_peers.json) and its
# minute would push turnip's rows out of the one 10-minute call a model gets.
# deepspeed_zero3_infinity is run by name: it is the 7B LoRA's peer (ZeRO-Infinity's CPU tier with eager's
# math), and the gpt1.3b and llama commands with every peer already take 432-524 s of their 530
BY_NAME_ONLY = ("deepspeed_zero3_infinity",)
ALL_SYSTEMS = ("eager", "turnip", "eager_fused", "checkpoint", *(p for p in CUDA_PEERS if p not in BY_NAME_ONLY))
DEFAULT_SYSTEMS = ALL_SYSTEMS
TINY_SYSTEMS = ("eager", "checkpoint", "offload", "checkpoint_offload", "turnip")
SHORTHANDS = {  # --systems all / peers / torch / offloading, alone or mixed with names
    "all": ALL_SYSTEMS,
    "peers": tuple(PEERS),  # everything but turnip (eager included: the reference)
    "torch": TORCH_PEERS,
    "offloading": CUDA_PEERS,  # DeepSpeed, torchao, torchtune
}
ISOLATE = ("all", "peers", "none")  # which systems run in a process of their own
MIN_SYSTEM_S = 10.0  # do not start a system with less than this left of the command's time


@dataclass
class SuiteConfig:
    models: list[str]
    budgets: list[float | int]  # fractions of eager's measured peak (floats) or bytes (ints): parse_budgets
    steps: int = 5
    systems: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    tiny: bool = False
    device: str = "cuda"
    out: Path = Path(".")
    time_limit: float = 540.0  # seconds for the whole command (the device allows 600, install and imports included)
    system_limit: float = 240.0  # seconds for any one system (turnip: compile + steps)
    peer_limit: float = 150.0  # seconds for any one system other than turnip (process start and build included)
    warmup: int = 2
    planner: str = "auto"
    planner_options: dict = field(default_factory=dict)  # memgraph.compile's planner options for turnip (JSON values)
    tag: str = ""
    batch: int | None = None
    plots: bool = True
    isolate: str = "all"  # "all": every system in a process of its own; "peers": all but eager and turnip; "none"
    sites: dict[str, list[str]] = field(default_factory=dict)  # system -> sys.path entries first in its process
    # turnip: after its steps, compile the same step again, op costs now cached, no plan cache (the warm
    # compile of issue 32): compile_again_s and its phases in the row
    compile_again: bool = False


def parse_budgets(text: str) -> list[float | int]:
    """``--budgets``: comma-separated fractions of eager's measured peak (``0.6``, ``60%``), kept as floats,
    and sizes (``16GiB``, ``512MiB``, ``8GB``: ir/budget.py's units), kept as ints of bytes. A bare number
    is a fraction and must lie in (0, 1]; BudgetError (a ValueError) names the item that does not read."""
    budgets: list[float | int] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        number = item.removesuffix("%")
        try:
            fraction = float(number) / (100 if number != item else 1)
        except ValueError:  # not a number: a size with its unit
            budgets.append(parse_budget(item, None, what="--budgets"))
            continue
        if not 0 < fraction <= 1:
            raise BudgetError(f"--budgets item {item!r} is a fraction of eager's measured peak and must lie in "
                              "(0, 1]; a size needs a unit, e.g. 16GiB")
        budgets.append(fraction)
    if not budgets:
        raise BudgetError(f"--budgets {text!r} names no budget")
    return budgets


def budget_label(budget) -> str:
    """A budget as the tables print it: a fraction with two decimals, a size in binary units ("16GiB")."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        return "-"
    return format_bytes(budget, compact=True) if isinstance(budget, int) else f"{budget:.2f}"


def expand_systems(names: list[str]) -> list[str]:
    """Names and shorthands (all, peers, torch, offloading) as systems, each once: eager first (its peak
    defines the budgets, its losses are the reference), turnip second (a command that runs out of time
    cuts peers, which the next run can add, not the system under test), the others in the order given.
    ``module:function`` names an importable peer (run in a process of its own)."""
    out: list[str] = []
    for name in names:
        for system in SHORTHANDS.get(name, (name,)):
            if system not in KNOWN_SYSTEMS and ":" not in system:
                raise ValueError(f"unknown system {system!r} (known: {', '.join(KNOWN_SYSTEMS)}; "
                                 f"shorthands: {', '.join(SHORTHANDS)})")
            if system not in out:
                out.append(system)
    return sorted(out, key=lambda s: (s != "eager", s != "turnip"))


def is_isolated(cfg: SuiteConfig, system: str) -> bool:
    if cfg.isolate not in ISOLATE:
        raise ValueError(f"isolate must be one of {ISOLATE}, got {cfg.isolate!r}")
    return cfg.isolate == "all" or ":" in system or (cfg.isolate == "peers" and system not in ("eager", "turnip"))


class ResultFile:
    """One JSON document per model, rewritten atomically after every row (with the rows' comparisons)."""

    def __init__(self, path: Path, header: dict):
        self.path, self.header, self.rows = path, header, []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.save()

    def save(self) -> None:
        self.header["same_memory"] = annotate(self.rows)
        doc = {**self.header, "rows": self.rows}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, self.path)


def make_row(model: str, result: PeerResult, budget: float | None) -> dict:
    row = {"model": model, "budget": budget, **result.row()}
    for key in ("trace", "sim_trace"):  # temporary paths; the kept traces are named in the file's header
        row.pop(key, None)
    return row


def idle_by_cause(trace: Path) -> dict:
    """The compute stream's idle ms by what it waited for (bench/trace_waits.py), in the traced step
    and in the simulated one, where those traces exist."""
    out = {}
    for key, path in (("trace_idle_ms_by_cause", trace), ("sim_idle_ms_by_cause", simulated_beside(trace))):
        if path.exists():
            out[key] = summarize(explain_gaps(load_units(path)))
    return out


# -- comparisons between rows ---------------------------------------------------------------------

def _ok(row: dict) -> bool:
    return row.get("status") == OK and row.get("step_s_median") is not None


def max_loss_diff(losses: list[float], reference: list[float]) -> float | None:
    """The largest |loss - reference loss| over the steps both ran (warmup included); inf where either
    is not finite; None when they share no step."""
    n = min(len(losses), len(reference))
    if n == 0:
        return None
    diffs = [abs(a - b) for a, b in zip(losses[:n], reference[:n])]
    return max(diffs) if all(math.isfinite(d) for d in diffs) else math.inf


def same_memory(rows: list[dict]) -> list[dict]:
    """For every turnip row, the fastest other system (status ok) whose measured peak fits in
    cap = max(turnip's budget in bytes, turnip's measured peak): what it would have run in the same
    memory. Also the fastest with eager's math (``eager_math_*``). ``speedup`` = that system's step
    time / turnip's (> 1: turnip is faster); None where turnip did not run or nothing fits."""
    out = []
    for t in rows:
        if t.get("system") != "turnip":
            continue
        sizes = [x for x in (t.get("budget_bytes"), t.get("peak_allocated")) if isinstance(x, (int, float))]
        cap = max(sizes) if sizes else None
        fits = [r for r in rows if r.get("model") == t.get("model") and r.get("system") != "turnip" and _ok(r)
                and isinstance(r.get("peak_allocated"), (int, float)) and cap is not None
                and r["peak_allocated"] <= cap]
        entry = {"model": t.get("model"), "budget": t.get("budget"), "status": t.get("status"), "cap_bytes": cap,
                 "turnip_step_s": t.get("step_s_median") if _ok(t) else None, "turnip_peak": t.get("peak_allocated")}
        for prefix, pool in (("", fits), ("eager_math_", [r for r in fits if r.get("math") == EAGER_MATH])):
            best = min(pool, key=lambda r: r["step_s_median"], default=None)
            entry[prefix + "peer"] = best["system"] if best else None
            entry[prefix + "peer_step_s"] = best["step_s_median"] if best else None
            entry[prefix + "peer_peak"] = best["peak_allocated"] if best else None
            if not prefix:
                entry["peer_math"] = best.get("math") if best else None
            entry[prefix + "speedup"] = (best["step_s_median"] / entry["turnip_step_s"]
                                         if best and entry["turnip_step_s"] else None)
        out.append(entry)
    return out


def annotate(rows: list[dict]) -> list[dict]:
    """Add each row's comparison with eager (``peak_fraction_of_eager``, ``max_loss_diff``) and each turnip
    row's same-memory fields (``same_memory_*``); returns the same-memory view."""
    eager = {r.get("model"): r for r in rows if r.get("system") == "eager"}
    # merged runs (results.load_suite_rows) carry a source: a row is compared with its own run's eager,
    # and where a later run's eager replaced that one, the comparison made in its own run stands
    eager_of_run = {(r.get("model"), r.get("source")): r for r in rows if r.get("system") == "eager"}
    for row in rows:
        ref = eager_of_run.get((row.get("model"), row.get("source")))
        if ref is None and row.get("source") is None:
            ref = eager.get(row.get("model"))
        if ref is None or row is ref:
            continue
        if ref.get("peak_allocated") and row.get("peak_allocated"):
            row["peak_fraction_of_eager"] = row["peak_allocated"] / ref["peak_allocated"]
        if ref.get("losses") and row.get("losses"):
            row["max_loss_diff"] = max_loss_diff(row["losses"], ref["losses"])
    view = same_memory(rows)
    turnip_rows = [r for r in rows if r.get("system") == "turnip"]
    for row, entry in zip(turnip_rows, view):
        row.update({f"same_memory_{k}": v for k, v in entry.items()
                    if k not in ("model", "budget", "status", "turnip_step_s", "turnip_peak")})
    return view


# -- running ------------------------------------------------------------------------------------------

class Runner:
    """Runs one system of one model, in this process or in one of its own, under the command's deadline."""

    def __init__(self, cfg: SuiteConfig, workload: Workload, spec: WorkloadSpec, deadline: float):
        self.cfg, self.workload, self.spec, self.deadline = cfg, workload, spec, deadline
        # tiny CPU runs: one intra-op thread (run_suite's reason), in a child process too
        self.threads = torch.get_num_threads() if cfg.tiny and torch.device(cfg.device).type == "cpu" else None

    def limit(self, system: str) -> float | None:
        """Seconds ``system`` may take, or None when too little of the command's time is left to start it."""
        left = self.deadline - time.monotonic()
        if left < MIN_SYSTEM_S:
            return None
        cap = self.cfg.system_limit if system == "turnip" else min(self.cfg.peer_limit, self.cfg.system_limit)
        return min(cap, left - 5)

    def run(self, system: str, **options) -> PeerResult:
        cfg = self.cfg
        limit_s = self.limit(system)
        if limit_s is None:
            left = max(0.0, self.deadline - time.monotonic())
            return PeerResult(system.rpartition(":")[2], status=TIMEOUT,
                              error=f"not started: {left:.0f}s left of the command's {cfg.time_limit:.0f}s")
        # the offloading peers only report "skipped" without CUDA: no process needed for that
        needs_process = is_isolated(cfg, system) and not (system in CUDA_PEERS and not is_cuda(cfg.device))
        if needs_process:
            return run_isolated(system, self.spec, cfg.device, cfg.steps, limit_s, warmup=cfg.warmup,
                                options=options, sites=cfg.sites, threads=self.threads)
        return resolve(system)(self.workload, cfg.device, cfg.steps, warmup=cfg.warmup, limit_s=limit_s,
                               deadline=time.monotonic() + 0.8 * limit_s, **options)


def run_model(cfg: SuiteConfig, name: str, deadline: float) -> list[dict]:
    label = name + ("-tiny" if cfg.tiny else "")
    stem = label + (f"_{cfg.tag}" if cfg.tag else "")  # split runs of one model keep apart files
    path = cfg.out / f"suite_{stem}.json"
    systems = expand_systems(cfg.systems)
    header = {"benchmark": "suite", **run_metadata(), "model": label, "device_type": torch.device(cfg.device).type,
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}}
    file = ResultFile(path, header)
    t0 = time.monotonic()
    try:
        workload = make_workload(name, tiny=cfg.tiny, batch=cfg.batch)
    except Unavailable as exc:
        file.add({"model": label, "system": "*", "budget": None, "status": NOT_INSTALLED, "error": str(exc)})
        return file.rows
    header["workload"] = workload.info
    log.info("%s: %s parameters (%s trainable), workload built in %.1fs", label,
             f"{workload.info['parameters']:,}", f"{workload.info['trainable_parameters']:,}", time.monotonic() - t0)
    scratch = Path(tempfile.mkdtemp(prefix="turnip-suite-"))
    try:
        spec = WorkloadSpec(name, tiny=cfg.tiny, batch=cfg.batch)
        if any(is_isolated(cfg, s) for s in systems):
            t0 = time.monotonic()
            try:  # children copy the weights in instead of initializing them again (peers/isolated.py)
                spec.snapshot = str(write_snapshot(workload, scratch / "snapshot.safetensors"))
                log.info("%s: weights snapshot written in %.1fs", label, time.monotonic() - t0)
            except (OSError, RuntimeError, ValueError) as exc:
                log.warning("%s: no weights snapshot (%r): each process builds the workload", label, exc)
        runner = Runner(cfg, workload, spec, deadline)
        run_systems(cfg, runner, systems, label, file, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    file.save()
    if cfg.plots:
        draw(cfg.out, stem, file.rows, header.get("trace_budget"))
    return file.rows


def run_systems(cfg: SuiteConfig, runner: Runner, systems: list[str], label: str, file: ResultFile,
                scratch: Path) -> None:
    eager = None
    for system in [s for s in systems if s != "turnip"]:
        log.info("%s: running %s", label, system)
        result = runner.run(system)
        if system == "eager":
            eager = result
        file.add(make_row(label, result, None))
    if "turnip" not in systems:
        return
    eager_ok = eager is not None and eager.status == OK
    eager_peak = eager.peak_allocated if eager_ok else None
    # the fastest eager step: the compute-time estimate of turnip's floor least inflated by noise
    eager_step = eager.stats()["step_s_min"] if eager_ok else None
    file.header["eager_peak_allocated"] = eager_peak
    best = None  # smallest budget that ran: its traces are kept
    for budget in sorted(cfg.budgets, reverse=True):
        log.info("%s: running turnip at budget %s", label, budget)
        trace = scratch / f"{budget}.json"
        result = runner.run("turnip", budget=budget, eager_peak=eager_peak, eager_step_s=eager_step,
                            trace_path=str(trace), planner=cfg.planner, planner_options=cfg.planner_options,
                            compile_again=cfg.compile_again)
        file.add({**make_row(label, result, budget), **idle_by_cause(trace)})
        if result.status == OK and (trace.exists() or trace.with_name(f"{budget}.sim.json").exists()):
            best = trace
    if best is not None:
        stem = file.path.stem.removeprefix("suite_")
        for suffix in (".json", ".sim.json"):
            src = best.with_name(best.name.removesuffix(".json") + suffix)
            if src.exists():
                shutil.copy(src, cfg.out / f"trace_{stem}{suffix}")
        file.header["trace_budget"] = float(best.name.removesuffix(".json"))


def draw(out: Path, label: str, rows: list[dict], trace_budget) -> None:
    try:
        from . import plots
    except ImportError as exc:  # matplotlib is an optional dependency (the "bench" extra)
        log.warning("no plots: %s (pip install matplotlib, then python -m turnip.bench plots)", exc)
        return
    try:
        plots.plot_step_time_vs_budget(rows, out / f"{label}_step_time.png", title=label)
        plots.plot_pareto(rows, out / f"{label}_pareto.png", title=label)
        trace = out / f"trace_{label}.json"
        sim = out / f"trace_{label}.sim.json"
        if trace.exists() or sim.exists():
            title = f"{label}, turnip at budget {trace_budget}"
            png = plots.plot_timeline({"measured (engine trace)": trace, "simulated": sim},
                                      out / f"{label}_timeline.png", title=title)
            if png is None:
                log.info("%s: no trace with timestamps to draw", label)
    except Exception:
        log.exception("%s: plotting failed", label)


def run_suite(cfg: SuiteConfig) -> list[dict]:
    cfg.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + cfg.time_limit
    # tiny tensors gain nothing from intra-op threads, and on a small shared CPU (CI: 2 cores) OpenMP's
    # spinning threads slow every system 10-100x whenever another process is busy
    threads = torch.get_num_threads()
    if cfg.tiny and torch.device(cfg.device).type == "cpu":
        torch.set_num_threads(1)
    rows = []
    try:
        for name in cfg.models:
            rows.extend(run_model(cfg, name, deadline))
    finally:
        torch.set_num_threads(threads)
    return rows


def _num(x, scale=1.0, fmt="{:.1f}") -> str:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return "-"
    return fmt.format(x * scale) if math.isfinite(x) else str(x)


def format_table(rows: list[dict]) -> str:
    """The final table the CLI prints: one line per (model, system, budget)."""
    num = _num
    head = f"{'model':<16} {'system':<24} {'budget':>6} {'step ms':>9} {'spread':>7} {'peak GiB':>9} " \
           f"{'in MiB':>9} {'out MiB':>9} {'compile s':>9} {'floor ms':>9} {'sim ms':>8} {'math':>5} " \
           f"{'loss diff':>9}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        math_label = {"eager": "eager", "bf16 weights": "bf16"}.get(r.get("math"), "-")
        lines.append(
            f"{r.get('model', ''):<16} {r.get('system', ''):<24} {budget_label(r.get('budget')):>6} "
            f"{num(r.get('step_s_median'), 1e3):>9} {num(r.get('step_s_spread'), 100, '{:.0f}%'):>7} "
            f"{num(r.get('peak_allocated'), 2**-30, '{:.2f}'):>9} {num(r.get('bytes_h2d'), 2**-20):>9} "
            f"{num(r.get('bytes_d2h'), 2**-20):>9} {num(r.get('compile_s')):>9} {num(r.get('floor_s'), 1e3):>9} "
            f"{num(r.get('sim_step_s'), 1e3):>8} {math_label:>5} {num(r.get('max_loss_diff'), fmt='{:.3g}'):>9}  "
            f"{r.get('status', '')}")
    return "\n".join(lines)


def format_same_memory(rows: list[dict]) -> str:
    """The same-memory view: per turnip budget, the fastest system that fits in its memory, and the speed-up."""
    view = same_memory(rows)
    if not view:
        return ""
    num = _num
    head = f"{'model':<16} {'budget':>6} {'cap GiB':>8} {'turnip ms':>9}  {'fastest that fits':<24} {'ms':>8} " \
           f"{'GiB':>6} {'math':>5} {'speed-up':>8}  {'fastest with eager math':<24} {'speed-up':>8}"
    title = "same memory: turnip beside the fastest system whose measured peak fits in max(budget, turnip's peak)"
    lines = [title, head, "-" * len(head)]
    for e in view:
        math_label = {"eager": "eager", "bf16 weights": "bf16"}.get(e.get("peer_math"), "-")
        turnip_ms = num(e["turnip_step_s"], 1e3) if e["turnip_step_s"] else e.get("status") or "-"
        lines.append(
            f"{e.get('model') or '':<16} {budget_label(e.get('budget')):>6} {num(e['cap_bytes'], 2**-30, '{:.2f}'):>8} "
            f"{turnip_ms:>9}  {e['peer'] or 'none fits':<24} {num(e['peer_step_s'], 1e3):>8} "
            f"{num(e['peer_peak'], 2**-30, '{:.2f}'):>6} {math_label:>5} {num(e['speedup'], fmt='{:.2f}x'):>8}  "
            f"{e['eager_math_peer'] or '-':<24} {num(e['eager_math_speedup'], fmt='{:.2f}x'):>8}")
    return "\n".join(lines)
