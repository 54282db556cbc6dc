"""PNG figures from the benchmark JSON: step time vs memory budget, step time vs measured peak memory (the
Pareto front of every system), one step's timeline per stream, the ablation, prefill time against
sequence length.

    python -m turnip.bench plots [--results DIR]      # redraw every figure from DIR's JSON files

Matplotlib with the Agg backend (no display needed); every function takes plain
rows / trace files and writes one PNG, so figures can be redrawn from saved JSON.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from pathlib import Path

import matplotlib

from .results import load_suite_rows

matplotlib.use("Agg")
import matplotlib.pyplot as plt

log = logging.getLogger(__name__)

COLORS = {"eager": "black", "checkpoint": "tab:blue", "offload": "tab:orange", "checkpoint_offload": "tab:green",
          "deepspeed_zero2": "tab:purple", "deepspeed_zero2_bf16": "mediumpurple", "deepspeed_zero3": "indigo",
          "torchao": "tab:brown", "torchao_offload_grads": "peru", "torchtune": "tab:pink", "turnip": "tab:red"}
MARKERS = {"eager": "s", "checkpoint": "D", "offload": "v", "checkpoint_offload": "^", "deepspeed_zero2": "P",
           "deepspeed_zero2_bf16": "P", "deepspeed_zero3": "X", "torchao": "p", "torchao_offload_grads": "h",
           "torchtune": "*"}
BF16_WEIGHTS = "bf16 weights"  # a row's "math" when it trades precision (peers/common.py)
GIB = 2**30
KIND_COLORS = {"compute": "tab:blue", "copy": "tab:cyan", "reload": "tab:green", "input": "tab:olive",
               "offload": "tab:orange", "output": "tab:gray"}


def _ok(row: dict) -> bool:
    return row.get("status") == "ok" and row.get("step_s_median") is not None


def plot_step_time_vs_budget(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """turnip's step time at each budget (fraction of eager's peak) beside every peer's.

    Peers have no budget knob: each is a horizontal line at its step time, with a marker
    at the GPU memory it measured (as a fraction of eager's peak) where that is known.
    """
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    eager = next((r for r in rows if r["system"] == "eager" and _ok(r)), None)
    eager_peak = eager.get("peak_allocated") if eager else None
    turnip = sorted((r for r in rows if r["system"] == "turnip"), key=lambda r: r.get("budget") or 0)
    xs = [r["budget"] for r in turnip if _ok(r)]
    for row in rows:
        if row["system"] == "turnip" or not _ok(row):
            continue
        color = COLORS.get(row["system"], None)
        y = row["step_s_median"] * 1e3
        ax.axhline(y, color=color, lw=1, ls="--", alpha=0.7)
        frac = row["peak_allocated"] / eager_peak if eager_peak and row.get("peak_allocated") else None
        label = f"{row['system']}" + (f" (peak {frac:.2f})" if frac else " (no budget knob)")
        if frac:
            ax.errorbar([frac], [y], yerr=[[y - row["step_s_min"] * 1e3], [row["step_s_max"] * 1e3 - y]],
                        fmt="s", color=color, label=label, capsize=3)
        else:
            ax.plot([], [], ls="--", color=color, label=label)
    if xs:
        ys = [r["step_s_median"] * 1e3 for r in turnip if _ok(r)]
        lo = [y - r["step_s_min"] * 1e3 for y, r in zip(ys, (r for r in turnip if _ok(r)))]
        hi = [r["step_s_max"] * 1e3 - y for y, r in zip(ys, (r for r in turnip if _ok(r)))]
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", color=COLORS["turnip"], lw=2, capsize=3, label="turnip")
        floors = [(r["budget"], r["floor_s"] * 1e3) for r in turnip if _ok(r) and r.get("floor_s")]
        if floors:
            ax.plot(*zip(*floors), ":", color=COLORS["turnip"], alpha=0.6, label="turnip floor")
        sims = [(r["budget"], r["sim_step_s"] * 1e3) for r in turnip if _ok(r) and r.get("sim_step_s")]
        if sims:
            basis = next((r.get("sim_basis") for r in turnip if r.get("sim_basis")), "")
            label = "turnip simulated" + (" (analytic H100 costs)" if "analytic" in basis else "")
            ax.plot(*zip(*sims), "x", color=COLORS["turnip"], alpha=0.6, label=label)
    failed = [r for r in turnip if not _ok(r)]
    for r in failed:  # infeasible / OOM / timeout budgets: marked on the axis with their status
        ax.annotate(r.get("status", "?"), (r.get("budget") or 0, 0), xycoords=("data", "axes fraction"),
                    xytext=(0, 4), textcoords="offset points", ha="center", fontsize=7, color="tab:red", rotation=90)
    ax.set_xlabel("GPU memory budget (fraction of eager's measured peak)" if eager_peak
                  else "GPU memory budget (fraction of the unplanned peak)")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, 1.1 * max([1.0, *xs]))
    ax.set_title(title or "step time vs memory budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the failed budgets sit low
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (memory, time) points that no other point beats in both, by increasing memory."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def plot_pareto(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Step time against measured peak GPU memory for every system of a model: a user's choice.

    Each peer is one point (hollow where it trades precision: bf16 weights); turnip's budgets are points
    joined by a line; the dotted staircase is the Pareto front of all of them (the fastest step at each
    memory). Systems without a point (OOM, error, timeout, not installed, no measured peak) are listed
    under the plot.
    """
    fig, ax = plt.subplots(figsize=(10, 5.6))
    points, missing = [], []
    for row in rows:
        system = row.get("system", "?")
        if system == "turnip":
            continue
        if not _ok(row) or not row.get("peak_allocated"):
            missing.append(f"{system} ({row.get('status') if not _ok(row) else 'no measured peak'})")
            continue
        x, y = row["peak_allocated"] / GIB, row["step_s_median"] * 1e3
        color = COLORS.get(system, "tab:gray")
        bf16 = row.get("math") == BF16_WEIGHTS
        ax.scatter([x], [y], marker=MARKERS.get(system, "o"), s=70, edgecolors=color, linewidths=1.5,
                   facecolors="none" if bf16 else color, label=system + (" (bf16 weights)" if bf16 else ""), zorder=3)
        # peers at about the same point (checkpoint and torchtune often) get their names stacked, not overprinted
        near = sum(1 for px, py in points if abs(px - x) < 0.6 and abs(py - y) < 25)
        ax.annotate(system, (x, y), xytext=(5, 4 + 9 * near), textcoords="offset points", fontsize=7, color=color)
        points.append((x, y))
    turnip = sorted((r for r in rows if r.get("system") == "turnip"), key=lambda r: r.get("budget") or 0)
    line = sorted((r["peak_allocated"] / GIB, r["step_s_median"] * 1e3, r.get("budget")) for r in turnip
                  if _ok(r) and r.get("peak_allocated"))
    missing += [f"turnip at {r.get('budget')} ({r.get('status') if not _ok(r) else 'no measured peak'})"
                for r in turnip if not (_ok(r) and r.get("peak_allocated"))]
    if line:
        ax.plot([p[0] for p in line], [p[1] for p in line], "o-", color=COLORS["turnip"], lw=2, zorder=4,
                label="turnip (one point per budget)")
        for x, y, budget in line:
            ax.annotate(f"{budget:g}", (x, y), xytext=(-4, -11), textcoords="offset points", fontsize=7,
                        color=COLORS["turnip"], ha="right")
        points += [(x, y) for x, y, _ in line]
    front = pareto_front(points)
    if len(front) > 1:
        ax.plot([p[0] for p in front], [p[1] for p in front], drawstyle="steps-post", ls=":", color="gray",
                alpha=0.8, zorder=2, label="Pareto front")
    if not points:
        ax.text(0.5, 0.5, "no system with a measured peak (a CPU run?)", transform=ax.transAxes, ha="center")
    ax.set_xlabel("measured peak GPU memory (GiB, torch.cuda.max_memory_allocated)")
    ax.set_ylabel("step time (ms, median of the timed steps)")
    ax.set_xlim(left=0, right=1.08 * max([x for x, _ in points], default=1.0))
    ax.set_ylim(bottom=0, top=1.1 * max([y for _, y in points], default=1.0))
    ax.set_title(title or "step time vs peak memory")
    ax.grid(alpha=0.3)
    if points:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if missing:
        fig.text(0.01, 0.01, "not drawn: " + ", ".join(missing), fontsize=7, wrap=True, va="bottom")
    fig.tight_layout(rect=(0, 0.06 if missing else 0, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def read_trace(path: str | Path) -> tuple[list[str], list[tuple[str, float, float, str]]]:
    """(lanes in display order, slices as (lane, start_ms, duration_ms, kind)) from a Chrome trace."""
    doc = json.loads(Path(path).read_text())
    names, order = {}, {}
    slices = []
    for e in doc["traceEvents"]:
        key = (e.get("pid"), e.get("tid"))
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[key] = e["args"]["name"] + (f" @{e['pid']}" if e.get("pid") else "")
        elif e["ph"] == "M" and e["name"] == "thread_sort_index":
            order[key] = e["args"]["sort_index"]
        elif e["ph"] == "X":
            slices.append((key, e["ts"] / 1e3, e["dur"] / 1e3, e.get("cat", "")))
    lanes = sorted(names, key=lambda k: order.get(k, 0))
    return [names[k] for k in lanes], [(names.get(k, str(k)), s, d, c) for k, s, d, c in slices]


def _has_times(slices) -> bool:
    """False for traces whose backend reported no timestamps (the CUDA backend's launch-ahead completions
    carry 0.0, which lands before the step's origin): drawing those would show nothing true."""
    if not slices or any(s < 0 for _, s, _, _ in slices):
        return False
    return sum(1 for _, _, d, _ in slices if d > 0) >= len(slices) // 2


def plot_timeline(traces: dict[str, str | Path], path: str | Path, title: str = "") -> Path | None:
    """One panel per trace (e.g. {"measured": engine trace, "simulated": sim trace}), a row per stream."""
    panels = []
    for label, trace in traces.items():
        if trace is None or not Path(trace).exists():
            continue
        lanes, slices = read_trace(trace)
        if not _has_times(slices):
            log.info("%s trace %s has no timestamps; not drawn", label, trace)
            continue
        panels.append((label, lanes, slices))
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.2 + 0.45 * sum(len(p[1]) for p in panels) + len(panels)),
                             squeeze=False)
    for ax, (label, lanes, slices) in zip(axes[:, 0], panels):
        row = {name: i for i, name in enumerate(lanes)}
        bars = defaultdict(list)
        for lane, start, dur, kind in slices:
            bars[(lane, kind)].append((start, max(dur, 1e-6)))
        seen = set()
        for (lane, kind), spans in bars.items():
            ax.broken_barh(spans, (row.get(lane, 0) - 0.4, 0.8), color=KIND_COLORS.get(kind, "tab:purple"),
                           label=kind if kind not in seen else None)
            seen.add(kind)
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels(lanes, fontsize=8)
        ax.invert_yaxis()
        end = max(s + d for _, s, d, _ in slices)
        ax.set_xlim(0, end * 1.01)
        ax.set_xlabel("ms from the start of the step")
        ax.set_title(f"{title} ({label})" if title else label, fontsize=9)
        ax.legend(fontsize=7, loc="upper right", ncol=len(seen))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_ablation(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Simulated step time of both orderings vs noise level: median and 10-90% band, per graph,
    normalised by the nondeterministic step without noise."""
    graphs = sorted({r["graph"] for r in rows})
    fig, axes = plt.subplots(1, len(graphs), figsize=(4.2 * len(graphs), 3.6), squeeze=False)
    for ax, graph in zip(axes[0], graphs):
        mine = [r for r in rows if r["graph"] == graph]
        base = [r["step_time"] for r in mine if r["ordering"] == "nondeterministic" and r["jitter"] == 0]
        norm = base[0] if base else 1.0
        for ordering, color in (("nondeterministic", "tab:red"), ("deterministic", "tab:blue")):
            by_jitter = defaultdict(list)
            for r in mine:
                if r["ordering"] == ordering:
                    by_jitter[r["jitter"]].append(r["step_time"] / norm)
            js = sorted(by_jitter)
            med = [_quantile(by_jitter[j], 0.5) for j in js]
            ax.plot(js, med, "o-", color=color, label=ordering)
            ax.fill_between(js, [_quantile(by_jitter[j], 0.1) for j in js], [_quantile(by_jitter[j], 0.9) for j in js],
                            color=color, alpha=0.2)
        ax.set_title(graph, fontsize=9)
        ax.set_xlabel("duration noise (lognormal sigma)")
        ax.set_ylabel("step time / nondeterministic at no noise")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return math.nan
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def plot_prefill(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Prefill time against sequence length (log-log), one line per (system, budget), as the TURNIP
    paper's prefill figures: a failed cell (OOM, infeasible budget, error) is an x at the bottom."""
    fig, ax = plt.subplots(figsize=(8, 5))
    lines: dict[tuple, list] = defaultdict(list)
    for row in rows:
        lines[(row["system"], row.get("budget"))].append(row)
    styles = {"eager": ("black", "s"), "turnip": ("tab:red", "o"), "accelerate": ("tab:blue", "^"),
              "zero_inference": ("tab:green", "D")}
    dashes = ["-", "--", ":", "-."]
    budgets = sorted({str(r.get("budget")) for r in rows if r.get("budget") is not None})
    failed = []
    for (system, budget), cells in sorted(lines.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        if system == "skipped":
            continue
        color, marker = styles.get(system, ("tab:gray", "o"))
        ok = sorted((r["seq"], r["step_s"]) for r in cells if r.get("status") == "ok")
        style = "-" if budget is None else dashes[budgets.index(str(budget)) % len(dashes)]
        label = system if budget is None else f"{system} @ {budget}"
        if ok:
            ax.plot([x for x, _ in ok], [y for _, y in ok], marker=marker, ls=style, color=color, label=label)
        failed += [(r["seq"], f"{label}: {r.get('status')}", color) for r in cells
                   if r.get("status") not in ("ok", "skipped")]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    for seq, _text, color in failed:
        ax.scatter([seq], [0.0], marker="x", color=color, transform=ax.get_xaxis_transform(), clip_on=False, zorder=5)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("prefill time (s, median)")
    ax.set_title(title or "prefill")
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    if failed:
        fig.text(0.01, 0.01, "x: " + "; ".join(f"{t} at {s}" for s, t, _ in failed), fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.06 if failed else 0, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def merged_prefill_rows(docs: list[dict]) -> list[dict]:
    """The rows of split prefill runs of one model, each (system, budget, length) once: the first run's
    (eager runs in each as the reference, and one eager line is what the figure wants)."""
    seen, rows = set(), []
    for doc in docs:
        for row in doc.get("rows", []):
            key = (row.get("system"), str(row.get("budget")), row.get("seq"))
            if key not in seen:
                seen.add(key)
                rows.append(row)
    return rows


def redraw(folder: str | Path) -> list[Path]:
    """Every figure that the JSON in ``folder`` supports."""
    folder = Path(folder)
    out = []
    for model, rows in load_suite_rows(folder).items():
        out.append(plot_step_time_vs_budget(rows, folder / f"{model}_step_time.png", title=model))
        out.append(plot_pareto(rows, folder / f"{model}_pareto.png", title=model))
    for trace in sorted(folder.glob("trace_*.json")):
        if trace.name.endswith(".sim.json"):
            continue
        sim = trace.with_name(trace.name.removesuffix(".json") + ".sim.json")
        png = plot_timeline({"measured": trace, "simulated": sim}, trace.with_suffix(".png"),
                            title=trace.stem.removeprefix("trace_"))
        if png:
            out.append(png)
    by_model: dict[str, list[dict]] = defaultdict(list)  # split runs (--tag) of one model: one figure
    for file in sorted(folder.glob("prefill*.json")):
        doc = json.loads(file.read_text())
        by_model[doc.get("model", file.stem)].append(doc)
    for k, (model, docs) in enumerate(sorted(by_model.items())):
        name = "prefill.png" if len(by_model) == 1 else f"prefill_{k}.png"
        out.append(plot_prefill(merged_prefill_rows(docs), folder / name, title=model))
    for file in sorted(folder.glob("ablation*.json")):
        doc = json.loads(file.read_text())
        if doc.get("sim_rows"):
            out.append(plot_ablation(doc["sim_rows"], file.with_suffix(".png"), title=file.stem))
    return out
