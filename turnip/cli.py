"""The turnip command: python -m turnip {demo,info,plot,bench} ...

    python -m turnip demo [--budget 0.5] [--steps 6]     # a small GPT, turnip beside eager PyTorch
    python -m turnip info step.mg                        # report, plan mix, memory per phase
    python -m turnip plot step.mg --out step.png         # arena memory over the serial order (matplotlib)
    python -m turnip bench suite --tiny                  # python -m turnip.bench ...

A .mg file is what MemGraph.save writes; reading one runs no code (see memgraph.load).
"""

from __future__ import annotations

import argparse
import runpy
import sys
import textwrap
from pathlib import Path

from . import demo
from .ir.budget import budget_fields, format_bytes
from .ir.memgraph import MemGraph, load
from .memgraph.occupancy import PHASES, arena_timeline, memory_by_phase, phase_of_vertices
from .memgraph.report import compile_report, plan_mix, predicted_step

FORWARDED = {"demo": "python -m turnip.demo", "bench": "python -m turnip.bench"}
SPARK = " ▁▂▃▄▅▆▇█"
WIDTH = 72


class CliError(Exception):
    """A problem the user can fix (a missing file, a missing optional dependency): printed, exit 2."""


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m turnip", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", metavar="{demo,info,plot,bench}", required=True)
    sub.add_parser("demo", help="compile a small GPT under a budget and train it beside eager PyTorch "
                   "(options: python -m turnip demo --help)", add_help=False)
    info = sub.add_parser("info", help="what a saved MemGraph does: report, plan mix, memory per phase",
                          description="Print a saved MemGraph's compile report, summary, plan mix and "
                          "memory in use per phase, with the arena's fill over the serial order as text.")
    info.add_argument("file", type=Path, help="a .mg file written by MemGraph.save")
    plot = sub.add_parser("plot", help="PNG of the arena memory over the serial order (needs matplotlib)",
                          description="Draw the arena bytes in use over the MemGraph's serial order, with "
                          "the arena size, the budget and the forward / backward / optimizer phases.")
    plot.add_argument("file", type=Path, help="a .mg file written by MemGraph.save")
    plot.add_argument("--out", type=Path, help="PNG to write (default: FILE with .png)")
    sub.add_parser("bench", help="the benchmarks (options: python -m turnip bench --help)", add_help=False)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:  # their own parsers read the rest, --help included
        return forward(argv[0], argv[1:])
    args = parser().parse_args(argv)
    try:
        if args.command == "info":
            print(info_text(read(args.file), args.file))
            return 0
        out = plot_arena(read(args.file), args.out or args.file.with_suffix(".png"))
        print(out)
        return 0
    except CliError as err:
        print(f"python -m turnip {args.command}: error: {err}", file=sys.stderr)
        return 2


def forward(command: str, argv: list[str]) -> int:
    if command == "demo":
        return demo.main(argv)
    saved = sys.argv
    sys.argv = [FORWARDED[command], *argv]
    try:  # exactly `python -m turnip.bench ...`: it exits with its own status (SystemExit passes through)
        runpy.run_module("turnip.bench", run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved
    return 0


def read(path: Path) -> MemGraph:
    if not path.is_file():
        raise CliError(f"no such file: {path}")
    try:
        return load(path)
    except (ValueError, OSError) as err:
        raise CliError(str(err)) from err


# -- info -------------------------------------------------------------------------------------

def info_text(mg: MemGraph, path: Path) -> str:
    timeline = arena_timeline(mg)
    mix = plan_mix(mg)
    budget = budget_fields(mg.plan.gpu_budget, mg.stats.get("unplanned_peak"))
    lines = [f"{path}: {mg!r}", "", textwrap.fill(compile_report(mg), WIDTH + 28), "", "summary"]
    summary = mg.summary()
    summary["predicted_time"] = predicted_step(mg)  # the planner's figure means nothing off the measured device
    summary.update({k: v for k, v in budget.items() if k not in summary})
    for key, value in summary.items():
        lines.append(f"  {key:<28} {_show(key, value)}")
    lines += ["", "plan mix (tensors of the step)",
              f"  kept on the GPU              {mix.kept:>6}  {format_bytes(mix.bytes_kept)}",
              f"  offloaded to CPU memory      {mix.offloaded:>6}  {format_bytes(mix.bytes_offloaded)}",
              f"  recomputed                   {mix.recomputed:>6}  {format_bytes(mix.bytes_recomputed)}",
              f"  weights/states homed on CPU  {mix.homed_on_cpu:>6}  {format_bytes(mix.bytes_homed_on_cpu)}",
              f"  moved per step (both ways)           {format_bytes(mix.bytes_moved)}",
              "", "trainable parameters, by where they are updated",
              f"  homed on the GPU             {mix.parameters_kept:>6}  {format_bytes(mix.bytes_parameters_kept)}",
              f"  streamed, updated on the GPU {mix.parameters_streamed:>6}  "
              + format_bytes(mix.bytes_parameters_streamed),
              f"  updated by the host's cores  {mix.parameters_host_stepped:>6}  "
              + format_bytes(mix.bytes_parameters_host_stepped),
              f"  frozen weights half-width    {mix.half_width_weights:>6}  {format_bytes(mix.bytes_half_width)}",
              "", "memory per phase (arena bytes in use)",
              f"  {'phase':<10} {'vertices':>8}  {'peak in use':>12}  {'offloaded':>11}  {'reloaded':>11}"]
    for row in memory_by_phase(mg, timeline):
        lines.append(f"  {row.phase:<10} {row.vertices:>8}  {format_bytes(row.peak_bytes):>12}  "
                     f"{format_bytes(row.bytes_offloaded):>11}  {format_bytes(row.bytes_reloaded):>11}")
    peak = max(timeline, default=0)
    lines += ["", (f"arena in use over the serial order (peak {format_bytes(peak)} of an arena of "
                   f"{format_bytes(mg.arena_bytes)}; each column the most of {_per_column(len(timeline))} vertices)"),
              f"  |{sparkline(timeline, mg.arena_bytes)}|", f"  {phase_ruler(mg)}"]
    return "\n".join(lines)


def _show(key: str, value) -> str:
    if isinstance(value, float) and key.endswith("fraction"):
        return f"{value:.1%}"
    if isinstance(value, int) and not isinstance(value, bool) and key.endswith(("bytes", "peak", "offloaded",
                                                                               "reloaded")):
        return f"{value} ({format_bytes(value)})"
    return str(value)


def _per_column(n: int) -> int:
    return max(1, -(-n // WIDTH))


def sparkline(timeline: list[int], top: int) -> str:
    """The timeline in at most WIDTH characters, each the most bytes in use over its slice."""
    step = _per_column(len(timeline))
    top = max(top, max(timeline, default=0), 1)
    cols = [max(timeline[k:k + step]) for k in range(0, len(timeline), step)]
    return "".join(SPARK[min(len(SPARK) - 1, -(-c * (len(SPARK) - 1) // top))] for c in cols)


def phase_ruler(mg: MemGraph) -> str:
    """Under the sparkline: f, b, o for the phase each column starts in."""
    phases = phase_of_vertices(mg)
    step = _per_column(len(phases))
    letters = {p: p[0] for p in PHASES}
    return " " + "".join(letters.get(phases[k], "?") for k in range(0, len(phases), step))


# -- plot -------------------------------------------------------------------------------------

def plot_arena(mg: MemGraph, out: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise CliError("plot needs matplotlib, an optional dependency: pip install matplotlib "
                       "(or pip install 'turnip[bench]')") from err
    timeline = arena_timeline(mg)
    phases = phase_of_vertices(mg)
    scale, unit = (2**30, "GiB") if mg.arena_bytes >= 2**30 else (2**20, "MiB")
    fig, ax = plt.subplots(figsize=(10, 4))
    xs = range(len(timeline))
    ax.fill_between(xs, [b / scale for b in timeline], step="post", alpha=0.35, label="in use")
    ax.step(xs, [b / scale for b in timeline], where="post", linewidth=0.8)
    ax.axhline(mg.arena_bytes / scale, color="black", linestyle="--", linewidth=0.8, label="arena")
    budget = mg.plan.gpu_budget
    if budget and budget < 4 * max(mg.arena_bytes, 1):
        ax.axhline(budget / scale, color="red", linestyle=":", linewidth=1.0, label="budget")
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
    start, labelled = 0, set()
    for k in range(1, len(phases) + 1):
        if k == len(phases) or phases[k] != phases[start]:
            phase = phases[start]
            ax.axvspan(start, k, color=colors.get(phase, "grey"), alpha=0.12, linewidth=0,
                       label=None if phase in labelled else phase)
            labelled.add(phase)
            start = k
    ax.set_xlabel("vertex in serial order")
    ax.set_ylabel(f"arena in use ({unit})")
    ax.set_title(f"{mg.device}, planner {mg.plan.planner}: {len(timeline)} vertices, arena "
                 f"{format_bytes(mg.arena_bytes)}")
    ax.set_xlim(0, max(1, len(timeline)))
    ax.set_ylim(0, max(mg.arena_bytes, budget or 0, max(timeline, default=0), 1) / scale * 1.15)
    ax.legend(loc="upper left", fontsize=8, ncols=6)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
