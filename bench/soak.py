"""A soak: one compiled MemGraph run for many steps, watching memory and step time for growth.

    python -m turnip.bench soak                                    # CUDA: gpt350m at 0.5 and 0.25, 1,000 steps each
    python -m turnip.bench soak --tiny --steps 50                  # CPU: a tiny GPT, 200 steps unless --steps
    python -m turnip.bench soak --budgets 0.5,0.25 --planner-option time_limit=8 --time-limit 560 --out "$OUT"

Per budget the bench model's step (bench/models/sizes.py, the suite's workload: the same batch every step,
so no data loading shows) is compiled once and run ``--steps`` times. Every step records its wall time
(the device synchronized before and after), the process's resident host memory (psutil where installed,
else /proc/self/statm), the pinned host bytes turnip holds (the runtime's registered CPU storage plus
torch's pinned host allocator: engine/cuda.py), and torch.cuda.memory_allocated / memory_reserved (0 on
the CPU). A budget is a fraction of eager's measured peak on CUDA (as the suite's; eager runs once first),
of the traced step's unplanned peak on the CPU or with --no-eager, or a size (16GiB).

The summary of each budget compares the end with step 10 (allocation, CUDA graph capture and the
allocator's first growth are over by then): host RSS, pinned bytes and GPU allocated / reserved at
step 10 and at the last step and their relative growth, and the median step time over steps 10 to
10 + 10% of the run against the median over its last 10% (the drift). The command fails (exit code 1,
each broken bound named) where a memory grew by more than --memory-bound (default 1%, issue 30's bound)
or the step time drifted by more than --drift-bound either way (default 10%), and where a budget did
not complete its steps (infeasible, an error, --time-limit). Writes soak_<model>[_<tag>].json under
bench/results (or --out), rewritten every 100 steps and after each budget, so a command stopped at the
device's limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .. import engine, memgraph
from ..ir.budget import BudgetError, format_bytes
from ..memgraph.progress import stderr_is_terminal
from .models.llama import Unavailable
from .models.sizes import make_workload
from .options import planner_options
from .peers import eager
from .peers.common import INFEASIBLE, OK, describe, is_cuda, is_oom, release_memory, sync, trainable
from .peers.turnip_system import budget_argument
from .results import result_path, run_metadata
from .suite import budget_label, parse_budgets

try:  # optional: /proc/self/statm gives the same number on Linux
    import psutil
except ImportError:  # pragma: no cover - depends on the environment
    psutil = None

log = logging.getLogger(__name__)

BASE_STEP = 10  # 1-based: the step every growth is measured from
WINDOW = 0.10  # the share of the run each step-time median is taken over
MIN_STEPS = 20  # fewer leave no room for two windows after step 10
SAVE_EVERY = 100  # steps between rewrites of the JSON
# the per-step series, in the JSON's order; those MEMORY names are checked against --memory-bound
SERIES = ("step_s", "loss", "host_rss_bytes", "pinned_bytes", "pinned_storage_bytes", "pinned_allocator_bytes",
          "gpu_allocated_bytes", "gpu_reserved_bytes")
MEMORY = {"host_rss_bytes": "host RSS", "pinned_bytes": "pinned host bytes",
          "gpu_allocated_bytes": "GPU allocated", "gpu_reserved_bytes": "GPU reserved"}


@dataclass(frozen=True)
class Bounds:
    memory: float = 0.01  # relative growth of each MEMORY series from step BASE_STEP to the last step
    drift: float = 0.10  # |median step of the last WINDOW / median of steps BASE_STEP.. - 1|


# -- readings -------------------------------------------------------------------------------------

def rss_source() -> str:
    return "psutil" if psutil is not None else "/proc/self/statm"


def host_rss() -> int:
    """Bytes of this process resident in host memory."""
    if psutil is not None:
        return int(psutil.Process().memory_info().rss)
    with open("/proc/self/statm") as statm:  # size resident shared ... in pages
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pinned_held(mg, device) -> tuple[int, int]:
    """(bytes of the runtime's CPU storage that are page-locked, bytes torch's pinned host allocator holds).
    The storage is registered with cudaHostRegister (engine/cuda.py's pinned_bytes) and is asked whether it
    is pinned, not assumed to be; the allocator (torch.cuda.host_memory_stats) holds the outputs' pinned
    copies (CudaRuntime.host_out) and anything else this process pinned through torch, cached blocks
    included. Both 0 on the CPU backend, whose storage is ordinary host memory."""
    if not is_cuda(device):
        return 0, 0
    storage = mg.runtime.storage if mg.runtime is not None else None
    registered = 0
    if storage is not None and storage.numel() and storage.is_pinned():
        registered = storage.numel() * storage.element_size()
    stats = getattr(torch.cuda, "host_memory_stats", None)  # torch 2.7 and later
    allocator = int(stats().get("allocated_bytes.current", 0)) if stats is not None else 0
    return registered, allocator


def readings(mg, device) -> dict:
    """One step's memory readings, as SERIES names them (step_s and loss apart)."""
    storage, allocator = pinned_held(mg, device)
    cuda = is_cuda(device)
    return {"host_rss_bytes": host_rss(), "pinned_bytes": storage + allocator, "pinned_storage_bytes": storage,
            "pinned_allocator_bytes": allocator,
            "gpu_allocated_bytes": int(torch.cuda.memory_allocated(device)) if cuda else 0,
            "gpu_reserved_bytes": int(torch.cuda.memory_reserved(device)) if cuda else 0}


# -- the checks -----------------------------------------------------------------------------------

def growth(base: float, end: float) -> float:
    """(end - base) / base; from a base of 0, 0 when still 0, else infinite."""
    if base > 0:
        return (end - base) / base
    return 0.0 if end <= base else math.inf


def windows(n: int) -> tuple[range, range]:
    """Step indices (0-based) of the first window (steps BASE_STEP .. BASE_STEP + 10% - 1, 1-based) and of
    the last 10%."""
    w = max(1, round(n * WINDOW))
    return range(BASE_STEP - 1, BASE_STEP - 1 + w), range(n - w, n)


def _steps(r: range) -> list[int]:
    return [r.start + 1, r.stop]  # 1-based, inclusive


def summarize(series: dict[str, list], bounds: Bounds = Bounds()) -> dict:
    """Growth and drift of one run's per-step series (SERIES names) against ``bounds``: per memory series
    its value at step BASE_STEP and at the end, its maximum and relative growth; the step-time medians of
    the two windows and their drift; every check with its value, bound and verdict, and ``failures`` (one
    sentence each; empty when every check passes). Needs MIN_STEPS steps at least."""
    n = len(series["step_s"])
    if n < MIN_STEPS:
        return {"steps": n, "ok": False, "checks": [],
                "failures": [f"{n} steps: a soak needs {MIN_STEPS} at least (step {BASE_STEP} and two windows)"]}
    first, last = windows(n)
    out: dict = {"steps": n, "base_step": BASE_STEP}
    checks, failures = [], []
    for key, name in MEMORY.items():
        values = series[key]
        base, end = values[BASE_STEP - 1], values[-1]
        g = growth(base, end)
        out[key.removesuffix("_bytes")] = {"at_base_step": base, "at_end": end, "max": max(values), "growth": g}
        ok = g <= bounds.memory
        checks.append({"check": f"{name} growth", "value": g, "bound": bounds.memory, "ok": ok})
        if not ok:
            failures.append(f"{name} grew {_pct(g)} from step {BASE_STEP} ({format_bytes(base)}) to step {n} "
                            f"({format_bytes(end)}), more than the {_pct(bounds.memory, sign=False)} bound "
                            "(--memory-bound)")
    times = series["step_s"]
    early, late = statistics.median(times[i] for i in first), statistics.median(times[i] for i in last)
    drift = late / early - 1 if early > 0 else math.inf
    out["step_s"] = {"first_window_steps": _steps(first), "last_window_steps": _steps(last),
                     "first_window_median": early, "last_window_median": late, "drift": drift,
                     "median": statistics.median(times), "first_step": times[0]}
    ok = abs(drift) <= bounds.drift
    checks.append({"check": "step time drift", "value": drift, "bound": bounds.drift, "ok": ok})
    if not ok:
        failures.append(f"step time drifted {_pct(drift)}: median {early * 1e3:.1f} ms over steps "
                        f"{first.start + 1}-{first.stop}, {late * 1e3:.1f} ms over steps {last.start + 1}-{last.stop}, "
                        f"beyond the {_pct(bounds.drift, sign=False)} bound either way (--drift-bound)")
    losses = series.get("loss") or []
    if losses and not all(math.isfinite(x) for x in losses):
        failures.append(f"non-finite loss from step {next(i for i, x in enumerate(losses) if not math.isfinite(x)) + 1}")
        checks.append({"check": "finite losses", "value": None, "bound": None, "ok": False})
    out.update(checks=checks, failures=failures, ok=not failures)
    return out


def _pct(x: float, sign: bool = True) -> str:
    if not math.isfinite(x):
        return "from nothing" if x > 0 else str(x)
    return f"{x * 100:+.2f}%" if sign else f"{x * 100:g}%"


# -- running -------------------------------------------------------------------------------------

@dataclass
class SoakConfig:
    model: str = "gpt350m"
    budgets: tuple = (0.5, 0.25)  # fractions (floats) or sizes in bytes (ints): suite.parse_budgets
    steps: int = 1000
    device: str = "cuda"
    tiny: bool = False
    batch: int | None = None
    planner: str = "auto"
    planner_options: dict | None = None
    eager_basis: bool = True  # a fraction is of eager's measured peak (CUDA); else of the unplanned peak
    bounds: Bounds = Bounds()
    time_limit: float | None = None  # seconds for the whole command: steps stop when it runs out
    out: Path | None = None
    tag: str = ""


class ResultDoc:
    """The soak's JSON, rewritten atomically whenever asked."""

    def __init__(self, path: Path, header: dict):
        self.path, self.doc = path, {**header, "runs": []}

    def save(self) -> Path:
        runs = self.doc["runs"]
        self.doc["failures"] = [f"{budget_label(r['budget'])}: {f}" for r in runs for f in r.get("failures", [])]
        self.doc["ok"] = bool(runs) and not self.doc["failures"]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        os.replace(tmp, self.path)
        return self.path


def eager_peak(workload, device) -> int | None:
    """Eager's measured peak (torch.cuda.max_memory_allocated over two steps), what a fraction is of."""
    result = eager.run(workload, device, steps=1, warmup=1)
    if result.status != OK:
        log.warning("eager: %s (%s): budgets are fractions of the unplanned peak", result.status, result.error)
        return None
    log.info("eager: peak %s, step %.1f ms", format_bytes(result.peak_allocated), result.step_s[0] * 1e3)
    return result.peak_allocated


def soak_budget(cfg: SoakConfig, workload, budget, peak: int | None, run: dict, save, deadline: float | None) -> None:
    """Compile ``workload`` at ``budget`` and run cfg.steps steps, filling ``run`` (its series, facts and
    status); ``save()`` every SAVE_EVERY steps."""
    device = cfg.device
    arg, basis = budget_argument(budget, peak)
    run.update(budget_bytes=arg if isinstance(arg, int) else None, budget_basis=basis)
    batch = workload.batch_on(device)
    t0 = time.perf_counter()
    try:
        mg = memgraph.compile(workload.model, workload.loss_fn, batch, optimizer=workload.optimizer(
            trainable(workload.model)), budget=arg, device=device, planner=cfg.planner, **(cfg.planner_options or {}))
    except memgraph.InfeasibleBudget as exc:
        run.update(status=INFEASIBLE, error=str(exc)[:600], compile_s=time.perf_counter() - t0)
        return
    run["compile_s"] = time.perf_counter() - t0
    summary = mg.summary()
    run.update(plan_cache=mg.stats.get("plan_cache"), planner=summary["planner"], arena_bytes=mg.arena_bytes,
               cpu_bytes=mg.cpu_bytes, unplanned_peak=mg.stats.get("unplanned_peak"),
               gpu_budget=int(mg.plan.gpu_budget), vertices=summary["vertices"],
               loss_blocks=mg.stats.get("loss_blocks", 1), predicted_step_s=summary["predicted_time"])
    log.info("%s @ %s: compiled in %.1f s, arena %s, CPU storage %s", workload.name, budget_label(budget),
             run["compile_s"], format_bytes(mg.arena_bytes), format_bytes(mg.cpu_bytes))
    release_memory(device)  # what compile measured on the device is not the step's
    series = run["series"]
    bar = tqdm(total=cfg.steps, desc=f"soak {budget_label(budget)}", unit="step", file=sys.stderr,
               disable=not stderr_is_terminal(), dynamic_ncols=True, leave=True)
    every = max(1, cfg.steps // 10)  # log lines when no bar shows
    try:
        with logging_redirect_tqdm() if not bar.disable else nullcontext():
            for i in range(cfg.steps):
                if deadline is not None and time.monotonic() > deadline:
                    run["truncated"] = f"--time-limit reached after {i} of {cfg.steps} steps"
                    log.warning("%s @ %s: %s", workload.name, budget_label(budget), run["truncated"])
                    break
                sync(device)
                t = time.perf_counter()
                loss = engine.run(mg, batch)["loss"]
                sync(device)
                series["step_s"].append(time.perf_counter() - t)
                series["loss"].append(float(loss.detach().float().item()))
                for key, value in readings(mg, device).items():
                    series[key].append(value)
                bar.update(1)
                if bar.disable and ((i + 1) % every == 0 or i == 0):
                    log.info("%s @ %s: step %d/%d %.1f ms, loss %.4f, RSS %s, pinned %s, GPU reserved %s",
                             workload.name, budget_label(budget), i + 1, cfg.steps, series["step_s"][-1] * 1e3,
                             series["loss"][-1], format_bytes(series["host_rss_bytes"][-1]),
                             format_bytes(series["pinned_bytes"][-1]), format_bytes(series["gpu_reserved_bytes"][-1]))
                elif not bar.disable:
                    bar.set_postfix_str(f"{series['step_s'][-1] * 1e3:.1f} ms, RSS "
                                        f"{format_bytes(series['host_rss_bytes'][-1])}", refresh=False)
                if (i + 1) % SAVE_EVERY == 0:
                    save()
    finally:
        bar.close()
        mg.release(keep=False)  # the next budget must not find this arena and storage still held


def run_soak(cfg: SoakConfig, command: str) -> tuple[dict, Path]:
    """Every budget of ``cfg`` in turn: (the JSON document, where it was written)."""
    deadline = time.monotonic() + cfg.time_limit if cfg.time_limit else None
    label = cfg.model + ("-tiny" if cfg.tiny else "")
    name = f"soak_{label}" + (f"_{cfg.tag}" if cfg.tag else "") + ".json"
    path = Path(cfg.out) / name if cfg.out else result_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {**asdict(cfg), "out": str(path.parent), "rss_source": rss_source(), "base_step": BASE_STEP,
              "window": WINDOW}
    doc = ResultDoc(path, {"benchmark": "soak", "command": command, **run_metadata(), "model": label,
                           "device_type": torch.device(cfg.device).type, "config": config})
    threads = torch.get_num_threads()
    if cfg.tiny and not is_cuda(cfg.device):
        torch.set_num_threads(1)  # as the suite's tiny runs: intra-op threads only add noise to tiny ops
    try:
        try:
            workload = make_workload(cfg.model, tiny=cfg.tiny, batch=cfg.batch)
        except Unavailable as exc:
            doc.doc["runs"].append({"budget": None, "status": "not installed", "failures": [str(exc)]})
            return doc.doc, doc.save()
        doc.doc["workload"] = workload.info
        peak = eager_peak(workload, cfg.device) if cfg.eager_basis and is_cuda(cfg.device) else None
        doc.doc["eager_peak_allocated"] = peak
        for budget in cfg.budgets:
            run = {"budget": budget, "status": OK, "series": {key: [] for key in SERIES}}
            doc.doc["runs"].append(run)
            try:
                soak_budget(cfg, workload, budget, peak, run, doc.save, deadline)
            except Exception as exc:  # recorded as this budget's failure; the next one runs
                run.update(status="oom" if is_oom(exc) else "error", error=describe(exc))
                log.exception("%s @ %s failed", label, budget_label(budget))
            finally:
                release_memory(cfg.device)
            finish(run, cfg.bounds)
            doc.save()
    finally:
        torch.set_num_threads(threads)
    log.info("results in %s", path)
    return doc.doc, path


def finish(run: dict, bounds: Bounds) -> None:
    """The run's summary and failures: its checks where it ran, and why it counts as failed where it did not
    run to the end."""
    failures = []
    if run["status"] != OK:
        failures.append(f"{run['status']}: {run.get('error')}")
    if run.get("truncated"):
        failures.append(f"incomplete: {run['truncated']}")
    if run["series"]["step_s"] and run["status"] == OK:
        run["summary"] = summarize(run["series"], bounds)
        failures += run["summary"]["failures"]
    elif run["status"] == OK:
        failures.append("no step ran")
    run["failures"] = failures


def format_summary(doc: dict) -> str:
    """One line per budget: steps, the step-time medians and drift, memory at step 10 and at the end."""
    head = (f"{'budget':>7} {'steps':>6} {'compile s':>9} {'first ms':>9} {'last ms':>9} {'drift':>8} "
            f"{'RSS @10':>11} {'RSS end':>11} {'growth':>8} {'pinned end':>11} {'growth':>8} "
            f"{'reserved @10':>12} {'reserved end':>12} {'growth':>8}  verdict")
    lines = [f"soak of {doc.get('model')} on {doc.get('device')}", head, "-" * len(head)]
    for run in doc["runs"]:
        s = run.get("summary") or {}
        times = s.get("step_s") or {}
        rss, pinned, reserved = (s.get(k) or {} for k in ("host_rss", "pinned", "gpu_reserved"))
        compile_s = run.get("compile_s")
        lines.append(
            f"{budget_label(run.get('budget')):>7} {len(run.get('series', {}).get('step_s', [])):>6} "
            f"{_cell(compile_s, '{:.1f}'):>9} {_cell(times.get('first_window_median'), '{:.1f}', 1e3):>9} "
            f"{_cell(times.get('last_window_median'), '{:.1f}', 1e3):>9} {_cell(times.get('drift'), '{:+.2%}'):>8} "
            f"{_size(rss.get('at_base_step')):>11} {_size(rss.get('at_end')):>11} {_cell(rss.get('growth'), '{:+.2%}'):>8} "
            f"{_size(pinned.get('at_end')):>11} {_cell(pinned.get('growth'), '{:+.2%}'):>8} "
            f"{_size(reserved.get('at_base_step')):>12} {_size(reserved.get('at_end')):>12} "
            f"{_cell(reserved.get('growth'), '{:+.2%}'):>8}  {'FAIL' if run.get('failures') else 'ok'}")
    return "\n".join(lines)


def _cell(x, fmt: str, scale: float = 1.0) -> str:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return "-"
    return fmt.format(x * scale) if math.isfinite(x) else str(x)


def _size(x) -> str:
    return format_bytes(x) if isinstance(x, int) else "-"


# -- command line -----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m turnip.bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt350m", help="a bench model (bench/models/sizes.py): gpt350m, gpt1.3b, "
                    "lora1.3b, llama, lora7b; with --tiny (the CPU's default) its CPU-sized form")
    ap.add_argument("--tiny", action="store_true", help="the model's CPU-sized form on the CPU (the default without "
                    "CUDA)")
    ap.add_argument("--device", help="cuda (default when available) or cpu")
    ap.add_argument("--budget", action="append", default=[], help="a budget: a fraction (0.5, 50%%) or a size "
                    "(16GiB); repeatable, each a run of its own")
    ap.add_argument("--budgets", help="comma-separated budgets, as --budget (default 0.5,0.25)")
    ap.add_argument("--steps", type=int, help="steps per budget (default 1000 on CUDA, 200 on the CPU)")
    ap.add_argument("--memory-bound", type=float, default=Bounds.memory, help="largest relative growth of host RSS, "
                    "pinned bytes and GPU allocated / reserved from step 10 to the last (default 0.01: 1%%)")
    ap.add_argument("--drift-bound", type=float, default=Bounds.drift, help="largest relative change, either way, of "
                    "the median step over the last 10%% of steps against steps 10 to 10 + 10%% (default 0.10)")
    ap.add_argument("--no-eager", action="store_true", help="fractions of the traced step's unplanned peak, not of "
                    "eager's measured peak (skips eager's two steps on CUDA; the CPU always does)")
    ap.add_argument("--batch", type=int, help="batch size instead of the model's default")
    ap.add_argument("--planner", default="auto", help="memgraph.compile planner: auto, ilp, greedy, none")
    ap.add_argument("--planner-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a planner option for compile, the value read as JSON (e.g. time_limit=8); repeatable")
    ap.add_argument("--time-limit", type=float, help="seconds for the whole command: steps stop when they run out "
                    "(the budget then fails as incomplete, its steps kept)")
    ap.add_argument("--out", help="folder for the JSON (default bench/results or $TURNIP_RESULTS)")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def config_from(args) -> SoakConfig:
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    tiny = args.tiny or not is_cuda(device)
    texts = [*args.budget, *([args.budgets] if args.budgets else [])] or ["0.5,0.25"]
    try:
        budgets = tuple(b for text in texts for b in parse_budgets(text))
    except BudgetError as exc:
        raise SystemExit(str(exc)) from None
    steps = args.steps if args.steps is not None else (1000 if is_cuda(device) else 200)
    if steps < MIN_STEPS:
        raise SystemExit(f"--steps {steps}: a soak needs {MIN_STEPS} steps at least (step {BASE_STEP} and two windows)")
    for name, value in (("--memory-bound", args.memory_bound), ("--drift-bound", args.drift_bound)):
        if not value >= 0:
            raise SystemExit(f"{name} must be a non-negative fraction, not {value}")
    return SoakConfig(model=args.model, budgets=budgets, steps=steps, device=device, tiny=tiny, batch=args.batch,
                      planner=args.planner, planner_options=planner_options(args.planner_option),
                      eager_basis=not args.no_eager and is_cuda(device), bounds=Bounds(args.memory_bound, args.drift_bound),
                      time_limit=args.time_limit, out=Path(args.out) if args.out else None, tag=args.tag)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    cfg = config_from(args)
    doc, path = run_soak(cfg, shlex.join(["python", "-m", "turnip.bench", "soak", *argv]))
    print(format_summary(doc))
    if doc["ok"]:
        print(f"soak passed: every bound held (JSON in {path})")
        return 0
    for failure in doc["failures"]:
        log.error("soak: %s", failure)
    print(f"soak FAILED: {len(doc['failures'])} bound(s) broken or runs incomplete (above; JSON in {path})")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
