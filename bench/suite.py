"""The benchmark suite: every system on every model, turnip at every budget, JSON rows + PNG plots.

Per model: eager first (its measured peak defines what a budget fraction means),
then the peers (no budget knob: each runs once and reports the memory it used),
then turnip at each budget, largest first. Every row is written to
``suite_<model>[_<tag>].json`` as soon as it exists, so a command killed at its
time limit still leaves everything it measured. Each system runs under its own
time limit and the command under a total one; OOMs, infeasible budgets, errors
and timeouts are rows with a status, never a crash.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from turnip.bench.models.llama import Unavailable
from turnip.bench.models.sizes import make_workload
from turnip.bench.peers import PEERS, turnip_system
from turnip.bench.peers.common import NOT_INSTALLED, SKIPPED, PeerResult
from turnip.bench.results import run_metadata

log = logging.getLogger(__name__)

DEFAULT_SYSTEMS = ("eager", "checkpoint", "offload", "checkpoint_offload", "deepspeed", "torchao", "torchtune",
                   "turnip")
TINY_SYSTEMS = ("eager", "checkpoint", "offload", "checkpoint_offload", "turnip")
MIN_SYSTEM_S = 10.0  # do not start a system with less than this left of the command's time


@dataclass
class SuiteConfig:
    models: list[str]
    budgets: list[float]
    steps: int = 5
    systems: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    tiny: bool = False
    device: str = "cuda"
    out: Path = Path(".")
    time_limit: float = 540.0  # seconds for the whole command (the device allows 600, install and imports included)
    system_limit: float = 240.0  # seconds for any one system (compile + steps)
    warmup: int = 1
    planner: str = "auto"
    tag: str = ""
    batch: int | None = None
    plots: bool = True


class ResultFile:
    """One JSON document per model, rewritten atomically after every row."""

    def __init__(self, path: Path, header: dict):
        self.path, self.header, self.rows = path, header, []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.save()

    def save(self) -> None:
        doc = {**self.header, "rows": self.rows}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, self.path)


def make_row(model: str, result: PeerResult, budget: float | None, eager: PeerResult | None) -> dict:
    row = {"model": model, "budget": budget, **result.row()}
    for key in ("trace", "sim_trace"):  # temporary paths; the kept traces are named in the file's header
        row.pop(key, None)
    if eager is not None and eager.peak_allocated and result.peak_allocated:
        row["peak_fraction_of_eager"] = result.peak_allocated / eager.peak_allocated
    if eager is not None and eager.losses and result.losses and result.system != "eager":
        n = min(len(eager.losses), len(result.losses))
        row["loss_max_abs_diff_vs_eager"] = max(abs(a - b) for a, b in zip(eager.losses[:n], result.losses[:n]))
    return row


def run_model(cfg: SuiteConfig, name: str, deadline: float) -> list[dict]:
    label = name + ("-tiny" if cfg.tiny else "")
    stem = label + (f"_{cfg.tag}" if cfg.tag else "")  # split runs of one model keep apart files
    path = cfg.out / f"suite_{stem}.json"
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

    def limits() -> tuple[float | None, float] | None:
        left = deadline - time.monotonic()
        if left < MIN_SYSTEM_S:
            return None
        return min(cfg.system_limit, left - 5), time.monotonic() + min(cfg.system_limit, left - 5) * 0.8

    def skipped(system: str, budget=None) -> dict:
        res = PeerResult(system, status=SKIPPED, error="the command's time limit was reached")
        return make_row(label, res, budget, None)

    common = {"warmup": cfg.warmup}
    eager = None
    for system in [s for s in cfg.systems if s != "turnip"]:
        if system not in PEERS:
            raise ValueError(f"unknown system {system!r} (known: {', '.join([*PEERS, 'turnip'])})")
        lim = limits()
        if lim is None:
            file.add(skipped(system))
            continue
        log.info("%s: running %s", label, system)
        result = PEERS[system](workload, cfg.device, cfg.steps, limit_s=lim[0], deadline=lim[1], **common)
        if system == "eager":
            eager = result
        file.add(make_row(label, result, None, eager))
    if "turnip" in cfg.systems:
        eager_ok = eager is not None and eager.status == "ok"
        eager_peak = eager.peak_allocated if eager_ok else None
        # the fastest eager step: the compute-time estimate of turnip's floor least inflated by noise
        eager_step = eager.stats()["step_s_min"] if eager_ok else None
        header["eager_peak_allocated"] = eager_peak
        traces = Path(tempfile.mkdtemp(prefix="turnip-traces-"))
        best = None  # smallest budget that ran: its traces are kept
        for budget in sorted(cfg.budgets, reverse=True):
            lim = limits()
            if lim is None:
                file.add(skipped("turnip", budget))
                continue
            log.info("%s: running turnip at budget %s", label, budget)
            trace = traces / f"{budget}.json"
            result = turnip_system.run(workload, cfg.device, cfg.steps, budget, eager_peak=eager_peak,
                                       eager_step_s=eager_step, limit_s=lim[0], deadline=lim[1], trace_path=trace,
                                       planner=cfg.planner, **common)
            file.add(make_row(label, result, budget, eager))
            if result.status == "ok" and (trace.exists() or trace.with_name(f"{budget}.sim.json").exists()):
                best = trace
        if best is not None:
            for suffix in (".json", ".sim.json"):
                src = best.with_name(best.name.removesuffix(".json") + suffix)
                if src.exists():
                    shutil.copy(src, cfg.out / f"trace_{stem}{suffix}")
            header["trace_budget"] = float(best.name.removesuffix(".json"))
        shutil.rmtree(traces, ignore_errors=True)
    file.save()
    if cfg.plots:
        draw(cfg.out, stem, file.rows, header.get("trace_budget"))
    return file.rows


def draw(out: Path, label: str, rows: list[dict], trace_budget) -> None:
    try:
        from turnip.bench import plots
    except ImportError as exc:  # matplotlib is an optional dependency (the "bench" extra)
        log.warning("no plots: %s (pip install matplotlib, then python -m turnip.bench plots)", exc)
        return
    try:
        plots.plot_step_time_vs_budget(rows, out / f"{label}_step_time.png", title=label)
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


def format_table(rows: list[dict]) -> str:
    """The final table the CLI prints: one line per (model, system, budget)."""

    def num(x, scale=1.0, fmt="{:.1f}"):
        return fmt.format(x * scale) if isinstance(x, (int, float)) else "-"

    head = f"{'model':<16} {'system':<19} {'budget':>6} {'step ms':>9} {'spread':>7} {'peak GiB':>9} " \
           f"{'in MiB':>9} {'out MiB':>9} {'compile s':>9} {'floor ms':>9} {'sim ms':>8}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.get('model', ''):<16} {r.get('system', ''):<19} {num(r.get('budget'), fmt='{:.2f}'):>6} "
            f"{num(r.get('step_s_median'), 1e3):>9} {num(r.get('step_s_spread'), 100, '{:.0f}%'):>7} "
            f"{num(r.get('peak_allocated'), 2**-30, '{:.2f}'):>9} {num(r.get('bytes_h2d'), 2**-20):>9} "
            f"{num(r.get('bytes_d2h'), 2**-20):>9} {num(r.get('compile_s')):>9} {num(r.get('floor_s'), 1e3):>9} "
            f"{num(r.get('sim_step_s'), 1e3):>8}  {r.get('status', '')}")
    return "\n".join(lines)
