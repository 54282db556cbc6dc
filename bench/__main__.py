"""turnip's benchmarks, one command each (see bench/README.md for what every column means).

    python -m turnip.bench suite --models gpt1.3b --systems all --budgets 0.6,0.45,0.25 --site torchtune=/tmp/site_tt
    python -m turnip.bench suite --tiny                 # the whole suite on the CPU in < 1 min (CI)
    python -m turnip.bench ablation [--tiny] [--device cuda]
    python -m turnip.bench plots [--results DIR]        # redraw PNGs from saved JSON
    python -m turnip.bench table [--results DIR] [--full]   # the newest run per model as one markdown table
                                                          # (the README's); --full, or naming DIR: then each
                                                          # model's full tables, split runs merged
    python -m turnip.bench soak [--tiny] [--budgets 0.5,0.25] [--steps 1000]   # memory and step time over many
                                                          # steps; fails on growth (its own options: soak -h)
    python -m turnip.bench suite --devices 2 --systems ddp,fsdp2   # the same as multi_gpu (below), suite's flags
    python -m turnip.bench multi_gpu --devices 2 [--budgets 1.0,0.5,0.25] [--peers ddp,fsdp2]   # every GPU of the
                                                          # host in one MemGraph (its own options: multi_gpu -h)

Results go to bench/results/ (or $TURNIP_RESULTS, or --out).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from ..ir.budget import BudgetError
from .ablation import main as ablation_main
from .multi_gpu import main as multi_gpu_main
from .options import planner_options
from .results import load_suite_rows, result_path
from .soak import main as soak_main
from .suite import (
    DEFAULT_SYSTEMS,
    ISOLATE,
    SHORTHANDS,
    TINY_SYSTEMS,
    SuiteConfig,
    annotate,
    expand_systems,
    format_same_memory,
    format_table,
    parse_budgets,
    run_suite,
)
from .table import format_newest


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _out(args) -> Path:
    return Path(args.out) if args.out else result_path("x").parent


def _sites(items: list[str] | None) -> dict[str, list[str]]:
    """--site SYSTEM=PATH[:PATH...], repeatable: sys.path entries first in that system's process."""
    sites: dict[str, list[str]] = {}
    for item in items or []:
        system, sep, paths = item.partition("=")
        if not sep or not system or not paths:
            raise SystemExit(f"--site takes SYSTEM=PATH, got {item!r}")
        sites.setdefault(system.strip(), []).extend(p for p in paths.split(":") if p)
    return sites


def suite(args) -> int:
    if args.devices > 1:  # every GPU of the host in one MemGraph, beside the peers users run on as many
        argv = ["--devices", str(args.devices), "--model", _names(args.models or "gpt1.3b")[0],
                "--planner", args.planner] + ["--tiny"] * args.tiny + ["--no-plots"] * args.no_plots
        for flag, value in (("--budgets", args.budgets), ("--steps", args.steps), ("--warmup", args.warmup),
                            ("--device", args.device), ("--peers", args.systems), ("--peer-limit", args.peer_limit),
                            ("--out", args.out and str(Path(args.out) / f"multi_gpu_x{args.devices}.json"))):
            if value is not None:
                argv += [flag, str(value)]
        multi_gpu_main(argv)
        return 0
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    try:
        systems = expand_systems(_names(args.systems) if args.systems
                                 else list(TINY_SYSTEMS if args.tiny else DEFAULT_SYSTEMS))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    try:
        budgets = parse_budgets(args.budgets or ("1.0,0.5" if args.tiny else "1.0,0.6,0.5,0.25,0.1"))
    except BudgetError as exc:
        raise SystemExit(str(exc)) from None
    cfg = SuiteConfig(
        models=_names(args.models or "gpt350m"),
        budgets=budgets,
        steps=args.steps if args.steps is not None else (2 if args.tiny else 5),
        systems=systems, tiny=args.tiny, device=device, out=_out(args), time_limit=args.time_limit,
        system_limit=args.system_limit, peer_limit=args.peer_limit,
        warmup=args.warmup if args.warmup is not None else (1 if args.tiny else 2), planner=args.planner,
        planner_options=planner_options(args.planner_option),
        tag=args.tag, batch=args.batch, plots=not args.no_plots,
        isolate=args.isolate or ("none" if args.tiny else "all"), sites=_sites(args.site),
        compile_again=args.compile_again)
    logging.getLogger(__name__).info("suite: %s", cfg)
    rows = run_suite(cfg)
    print(format_table(rows))
    view = format_same_memory(rows)
    if view:
        print("\n" + view)
    print(f"\nresults in {cfg.out}")
    return 0


def ablation(args) -> int:
    argv = ["--out", str(_out(args))]
    if args.tiny:
        argv.append("--tiny")
    if args.device:
        argv += ["--device", args.device]
    if args.models:
        argv += ["--model", _names(args.models)[0]]
    if args.budgets:
        argv += ["--budget", str(_floats(args.budgets)[0])]
    if args.steps is not None:
        argv += ["--repeat", str(args.steps)]
    return ablation_main(argv)


def plots(args) -> int:
    from .plots import redraw

    folder = Path(args.results) if args.results else _out(args)
    for png in redraw(folder):
        print(png)
    return 0


def table(args) -> int:
    """The newest suite run of each model under the folder, at any depth, as one markdown table (bench/table.py);
    then, with --full or a folder named by --results, every model's full table and same-memory view from the
    folder's own suite_*.json, split runs of a model merged."""
    folder = Path(args.results) if args.results else _out(args)
    print(format_newest(folder))
    if not (args.full or args.results):
        return 0
    print()
    for model, rows in sorted(load_suite_rows(folder).items()):
        annotate(rows)  # merged rows: compare them again
        print(format_table(rows))
        view = format_same_memory(rows)
        print(("\n" + view if view else "") + "\n")
    return 0


def soak(args) -> int:
    """The soak named after other options: the shared ones it takes passed on (bench/soak.py)."""
    argv = ["--out", str(_out(args)), "--planner", args.planner] + ["--tag", args.tag] * bool(args.tag)
    argv += ["--tiny"] * args.tiny + ["--verbose"] * args.verbose
    for flag, value in (("--model", args.models and _names(args.models)[0]), ("--budgets", args.budgets),
                        ("--steps", args.steps), ("--device", args.device), ("--batch", args.batch)):
        if value is not None:
            argv += [flag, str(value)]
    for item in args.planner_option:
        argv += ["--planner-option", item]
    return soak_main(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["soak"]:  # the soak has options of its own (python -m turnip.bench soak -h)
        return soak_main(argv[1:])
    if argv[:1] == ["multi_gpu"]:  # so has the bench on several devices (python -m turnip.bench multi_gpu -h)
        multi_gpu_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m turnip.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["suite", "ablation", "plots", "table", "soak"])
    parser.add_argument("--models", help="comma-separated: gpt350m, gpt1.3b, lora1.3b, llama, lora7b, mixtral")
    parser.add_argument("--budgets", help="comma-separated turnip budgets: fractions of eager's measured peak GPU "
                        "memory (0.6) or sizes (16GiB, 8GiB), mixed as you like")
    parser.add_argument("--steps", type=int, help="timed steps per system (after --warmup); ablation: repeats")
    parser.add_argument("--warmup", type=int, help="untimed steps first (allocation, autotuning, CUDA graph "
                        "capture); default 2, --tiny 1")
    parser.add_argument("--systems", help=f"comma-separated systems ({', '.join(DEFAULT_SYSTEMS)}) and shorthands "
                        f"({', '.join(SHORTHANDS)}); default all, --tiny {','.join(TINY_SYSTEMS)}")
    parser.add_argument("--isolate", choices=ISOLATE, help="systems that run in a process of their own: all "
                        "(default), peers (all but eager and turnip), none (default with --tiny)")
    parser.add_argument("--site", action="append", metavar="SYSTEM=PATH",
                        help="sys.path entries first in that system's process, e.g. torchtune=/tmp/site_tt "
                        "(repeatable; also $TURNIP_PEER_SITE_<system>)")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized models, CPU device: the suite in < 1 min")
    parser.add_argument("--device", help="cuda (default when available) or cpu")
    parser.add_argument("--devices", type=int, default=1, help="suite: turnip on this many devices in one MemGraph "
                        "beside the torchrun peers (bench/multi_gpu.py; --systems names the peers: ddp, fsdp2, ...)")
    parser.add_argument("--out", help="folder for JSON/PNG (default bench/results or $TURNIP_RESULTS)")
    parser.add_argument("--results", help="plots, table: folder to read (default --out)")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name (split runs of one model)")
    parser.add_argument("--batch", type=int, help="batch size instead of the model's default")
    parser.add_argument("--planner", default="auto", help="memgraph.compile planner: auto, ilp, greedy, none")
    parser.add_argument("--planner-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a planner option for turnip's compile, the value read as JSON when it parses "
                             "(e.g. reload_room=true, time_limit=30); repeatable")
    parser.add_argument("--time-limit", type=float, default=540.0, help="seconds for the whole command")
    parser.add_argument("--system-limit", type=float, default=240.0, help="seconds for any one system")
    parser.add_argument("--peer-limit", type=float, default=150.0,
                        help="seconds for any one system other than turnip (its process start included)")
    parser.add_argument("--full", action="store_true", help="table: each model's full tables too (the default "
                        "when --results names the folder)")
    parser.add_argument("--compile-again", action="store_true",
                        help="suite: after turnip's steps, compile the same step again (op costs cached, no plan "
                             "cache) and record that compile's time and phases (compile_again_s)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    return {"suite": suite, "ablation": ablation, "plots": plots, "table": table,
            "soak": soak}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
