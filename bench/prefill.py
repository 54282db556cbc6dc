"""Long-sequence prefill (first-token inference) of a Llama-2-7B-shaped model under a GPU budget:
turnip's forward-only step (compile(..., backward=False)) beside eager PyTorch, Hugging Face
accelerate's CPU offload (infer_auto_device_map with max_memory at the budget, dispatch_model) and
DeepSpeed ZeRO-Inference (ZeRO-3 with offload_param to pinned CPU memory, bench/peers/zero_inference.py).

    python -m turnip.bench.prefill --seqs 8192,16384,32768 --budgets 16GiB,8GiB   # the GPU machine
    python -m turnip.bench.prefill --tiny                                         # CPU, 2 layers (CI)

The model is Hugging Face's LlamaForCausalLM with Llama-2-7B's sizes (hidden 4096, MLP 11008, 32
layers, 32 heads, vocab 32000) and random bf16 weights (nothing is downloaded); the step keeps the
last position's logits, as prefill does. Per sequence length eager runs once on the whole GPU (its
measured peak says whether it fits a budget); turnip is compiled per (length, budget). Each row
records the median step, measured peak, compile time, pinned host memory, bytes moved each way,
turnip's floor max(compute, weight bytes in / H2D bandwidth) from its cost model, and the largest
difference of its logits from eager's (from turnip's where eager did not run). Writes
prefill[-tiny][_TAG].json under bench/results, again after every row, so a command stopped at its
limit keeps what it measured; with --time-limit a cell that would start too late is a "timeout" row.

accelerate and ZeRO-Inference are not run on the CPU ("skipped"). Neither has a byte budget:
accelerate caps only where weights go, and ZeRO-Inference has no knob at all, so each reports its
measured peak and a cell whose peak exceeds the budget is "over budget" (its time is kept).
ZeRO-Inference runs once per sequence length (its configuration does not depend on the budget), in
a process of its own (peers/spawned.py) that builds the same model and tokens from the same seeds:
DeepSpeed's process group, pinned partitions and hooks must not outlive its cells. `python -m
turnip.bench plots` draws time against sequence length from the JSON (bench/plots.py, plot_prefill).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import engine, memgraph
from ..engine.timing_sim import time_floor, transfer_bytes
from ..ir.budget import BudgetError, budget_size, check_budget, format_bytes, parse_budget
from ..planners.costs import CostModel
from .memory_audit import frame_of, live_at_peak, recorded
from .models.llama import LLAMA2_7B
from .options import planner_options
from .peers import zero_inference
from .peers.common import OK, TIMEOUT, release_memory, sync, unavailable
from .peers.spawned import call_spawned
from .profile_step import kernel_profile
from .results import result_path, run_metadata

log = logging.getLogger(__name__)

TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
SYSTEMS = ("eager", "turnip", "accelerate", "zero_inference")
OVER_BUDGET = "over budget"
MIN_CELL_S = 10.0  # with --time-limit: a cell is not started with less than this left


@dataclass
class PrefillConfig:
    seqs: list[int] = field(default_factory=lambda: [8192, 16384, 32768])
    budgets: list[str] = field(default_factory=lambda: ["16GiB", "8GiB"])
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    steps: int = 3
    warmup: int = 1
    tiny: bool = False
    device: str = "cuda"
    out: Path | None = None
    planner_options: dict = field(default_factory=dict)
    time_limit: float | None = None  # seconds for the whole command; None: no limit
    tag: str = ""  # suffix of the JSON's name: split runs of one command keep apart files
    audit: bool = False  # turnip rows: what is live beside the arena at the peaks of the first two runs and of a later one
    profile: bool = False  # eager and turnip rows: one more step under torch.profiler, GPU time per ATen op


def llama(tiny: bool, device: str = "cpu") -> torch.nn.Module:
    """Random-weight LlamaForCausalLM of the 7B shape (bf16) or the tiny one (fp32, for the CPU), its
    weights in CPU memory. The random values are drawn on ``device`` (a CUDA generator draws the 6.7
    B values in seconds; the CPU one took 227 s on the GPU machine) from one seed, so every process
    that builds the model for the same device gets the same weights."""
    import transformers  # optional: the bench extra

    shape = TINY if tiny else LLAMA2_7B
    cfg = transformers.LlamaConfig(**shape, use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
    dtype = torch.float32 if tiny else torch.bfloat16
    started = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(dtype)  # no memory yet: 7B fp32 would be 27 GB
    model = model.to_empty(device="cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif torch.device(device).type == "cpu":
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.copy_(torch.empty(p.shape, dtype=p.dtype, device=device).normal_(0.0, 0.02, generator=gen))
        model.model.rotary_emb.__init__(cfg)  # its inv_freq buffer was left empty on the meta device
    log.info("llama (%s): %.2f B parameters built in %.1fs", "tiny" if tiny else "7B shape",
             sum(p.numel() for p in model.parameters()) / 1e9, time.perf_counter() - started)
    return model.eval()


def prefill_ids(seq: int, vocab: int) -> torch.Tensor:
    """One sequence of ``seq`` random tokens, the same for every system (and process) of a length."""
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))


def prefill_fn(model: torch.nn.Module):
    """fn(model, ids) -> the last position's logits; only that position's logits are computed where
    this transformers version can be told so (logits_to_keep)."""
    params = inspect.signature(model.forward).parameters
    keep = "logits_to_keep" if "logits_to_keep" in params else "num_logits_to_keep" if "num_logits_to_keep" in params else None

    def prefill(m, ids):
        kwargs = {keep: 1} if keep else {}
        return m(input_ids=ids, use_cache=False, **kwargs).logits[:, -1]

    return prefill


def _timed(run, steps: int, warmup: int, device: str) -> tuple[list[float], torch.Tensor]:
    times, out = [], None
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        out = run()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, out


def _peak(device: str) -> int | None:
    return int(torch.cuda.max_memory_allocated()) if device.startswith("cuda") else None


def judge_budget(row: dict, budget: str) -> None:
    """A peer without a byte budget ran a cell: "over budget" where its measured peak exceeds the cell's
    budget (its time stays in the row, with ``fits_budget`` and ``budget_bytes``)."""
    limit = budget_size(budget)  # None for a fraction: no size a peer's measured peak can be held to
    row["budget_bytes"] = limit
    if row.get("status") != OK or limit is None or row.get("peak_allocated") is None:
        return
    row["fits_budget"] = row["peak_allocated"] <= limit
    if not row["fits_budget"]:
        row.update(status=OVER_BUDGET, error=f"measured peak {format_bytes(row['peak_allocated'])} exceeds the "
                                             f"budget {budget} ({format_bytes(limit)})")


def compare(row: dict, out: torch.Tensor, reference: tuple[str, torch.Tensor] | None) -> None:
    """``max_abs_diff_vs_<system>``: the largest difference of the row's logits from the reference's
    (eager's, or turnip's where eager did not run)."""
    if reference is not None:
        system, want = reference
        row[f"max_abs_diff_vs_{system}"] = float((out.float().cpu() - want).abs().max())


def run_eager(model, ids: torch.Tensor, cfg: PrefillConfig) -> tuple[dict, torch.Tensor | None]:
    row = {"system": "eager", "seq": ids.shape[1], "budget": None}
    fn = prefill_fn(model)
    try:
        release_memory(cfg.device)
        model.to(cfg.device)
        on_device = ids.to(cfg.device)
        with torch.no_grad():
            times, out = _timed(lambda: fn(model, on_device), cfg.steps, cfg.warmup, cfg.device)
        row.update(status="ok", step_s=statistics.median(times), steps_s=times, peak_allocated=_peak(cfg.device))
        if cfg.profile and cfg.device.startswith("cuda"):
            with torch.no_grad():
                row["kernels"] = kernel_profile(lambda: fn(model, on_device))
        return row, out.float().cpu()
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", error=str(exc)[:300])
        return row, None
    finally:
        model.to("cpu")
        release_memory(cfg.device)


def run_turnip(model, ids: torch.Tensor, budget: str, cfg: PrefillConfig,
               reference: tuple[str, torch.Tensor] | None) -> tuple[dict, torch.Tensor | None]:
    row = {"system": "turnip", "seq": ids.shape[1], "budget": budget}
    fn = prefill_fn(model)
    mg, logits = None, None
    try:
        release_memory(cfg.device)
        started = time.perf_counter()
        # the budget's text as given: compile reads it as ir/budget.py says ("0.6" a fraction, "16GiB" a size)
        mg = memgraph.compile(model, fn, ids, backward=False, budget=budget, device=cfg.device,
                              verbose=False, **cfg.planner_options)
        row["compile_s"] = time.perf_counter() - started
        release_memory(cfg.device)
        audit = cfg.audit and cfg.device.startswith("cuda")
        if audit:  # the first run (plain launches) and the second (segments captured), before timing
            row["first_runs_beside_arena"] = beside_arena(mg, ids, runs=2)
        times, out = _timed(lambda: engine.run(mg, ids)["output"], cfg.steps, cfg.warmup, cfg.device)
        moved_in, moved_out = transfer_bytes(mg)
        costs = CostModel(device=mg.device)
        floor = time_floor(mg, costs)
        row.update(status="ok", step_s=statistics.median(times), steps_s=times, peak_allocated=_peak(cfg.device),
                   arena_bytes=mg.arena_bytes, pinned_bytes=mg.cpu_bytes, bytes_h2d=moved_in, bytes_d2h=moved_out,
                   floor_s=max(floor["compute"], floor["h2d"]), floor_compute_s=floor["compute"],
                   floor_h2d_s=floor["h2d"], predicted_s=mg.stats.get("predicted_step_s") or mg.plan.predicted_time)
        logits = out.float().cpu()
        compare(row, logits, reference)
        if audit:
            row["beside_arena_at_peak"] = beside_arena(mg, ids)
        if cfg.profile and cfg.device.startswith("cuda"):
            row["kernels"] = kernel_profile(lambda: engine.run(mg, ids))
    except memgraph.InfeasibleBudget as exc:
        row.update(status="infeasible", error=str(exc)[:400])
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", error=str(exc)[:300])
    finally:
        if mg is not None:
            mg.release(keep=False)
        release_memory(cfg.device)
    return row, logits


def beside_arena(mg, ids: torch.Tensor, runs: int = 1) -> dict:
    """``runs`` steps recorded by the caching allocator: their peak and the blocks live then other
    than the arena, largest first, with the frame that allocated each (bench/memory_audit.py's
    replay). The row's peak_allocated counts these steps too."""
    def run() -> None:
        for _ in range(runs):
            engine.run(mg, ids)

    before, snapshot = recorded(run)
    peak, at_peak = live_at_peak(snapshot, before)
    blocks = sorted(({"bytes": e["size"], "where": frame_of(e)} for e in at_peak), key=lambda b: -b["bytes"])
    return {"allocated_before": before, "arena_bytes": mg.arena_bytes, "gpu_budget": mg.plan.gpu_budget,
            "peak": peak, "blocks": blocks[:12]}


def run_accelerate(model, ids: torch.Tensor, budget: str, cfg: PrefillConfig,
                   reference: tuple[str, torch.Tensor] | None) -> dict:
    """Hugging Face accelerate's big-model inference, the way users offload: the layers that do not
    fit ``max_memory`` on the GPU stay on the CPU and are copied in for each forward
    (infer_auto_device_map + dispatch_model), on a copy of the model (dispatching moves its weights)."""
    row = {"system": "accelerate", "seq": ids.shape[1], "budget": budget}
    if not cfg.device.startswith("cuda"):
        row.update(status="skipped", error="accelerate's offload runs on CUDA devices")
        return row
    try:
        import accelerate  # optional: present on the GPU machine
        from accelerate.hooks import remove_hook_from_module
    except ImportError as exc:
        row.update(status="not installed", error=str(exc))
        return row
    copy_of = None
    try:
        release_memory(cfg.device)
        copy_of = copy.deepcopy(model)
        device_map = accelerate.infer_auto_device_map(
            copy_of, max_memory={0: parse_budget(budget, None), "cpu": "1000GiB"},
            no_split_module_classes=list(getattr(copy_of, "_no_split_modules", None) or []))
        dispatched = accelerate.dispatch_model(copy_of, device_map=device_map, main_device=0)
        row["layers_on_cpu"] = sum(1 for where in device_map.values() if where in ("cpu", "disk"))
        fn, on_device = prefill_fn(dispatched), ids.to(cfg.device)
        with torch.no_grad():
            times, out = _timed(lambda: fn(dispatched, on_device), cfg.steps, cfg.warmup, cfg.device)
        row.update(status="ok", step_s=statistics.median(times), steps_s=times, peak_allocated=_peak(cfg.device),
                   accelerate=accelerate.__version__)
        compare(row, out, reference)
        judge_budget(row, budget)
        remove_hook_from_module(dispatched, recurse=True)
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", error=str(exc)[:300])
    except Exception as exc:  # noqa: BLE001 - a peer that fails is a row, not the end of the benchmark
        row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:400])
    finally:
        del copy_of
        release_memory(cfg.device)
    return row


def zero_inference_cells(request: dict) -> dict:
    """ZeRO-Inference's side, in a process of its own (call_spawned): the parent's model and tokens built
    again from the same seeds, the model put under ZeRO-Inference once, then every sequence length's
    forward (each ``warmup + steps`` times, the peak reset per length). Plain data back: the setup's facts
    and per length its status, step times, peak and last-position logits (numpy: they pickle compactly)."""
    device, steps, warmup = request["device"], request["steps"], request["warmup"]
    missing = unavailable("zero_inference", device, "deepspeed")
    if missing is not None:
        return {"status": missing.status, "error": missing.error}
    model = llama(request["tiny"], device)
    fn = prefill_fn(model)  # before partitioning: it reads the model's forward signature
    vocab = model.config.vocab_size
    module, facts = zero_inference.prepare(model, device)
    cells: dict[int, dict] = {}
    stopped = None  # after a failed length DeepSpeed's state is unknown: the longer ones are not run
    for seq in request["seqs"]:
        if stopped or time.time() > request["deadline"]:
            cells[seq] = {"status": TIMEOUT if not stopped else "not run", "error": stopped or "not started: the "
                          "command's --time-limit is (nearly) used up"}
            continue
        ids = prefill_ids(seq, vocab).to(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            with torch.no_grad():
                times, out = _timed(lambda ids=ids: fn(module, ids), steps, warmup, device)
            cells[seq] = {"status": OK, "steps_s": times, "peak_allocated": _peak(device),
                          "logits": out.float().cpu().numpy()}
        except torch.OutOfMemoryError as exc:
            cells[seq] = {"status": "oom", "error": str(exc)[:300]}
        except Exception as exc:  # noqa: BLE001 - one length failing is its row
            cells[seq] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:400]}
        if cells[seq]["status"] != OK:
            stopped = f"not run after the {seq}-token forward failed ({cells[seq]['status']})"
        log.info("zero_inference, %d tokens: %s", seq, cells[seq]["status"])
    return {"status": OK, **facts, "cells": cells}


def run_zero_inference(cfg: PrefillConfig, references: dict[int, tuple[str, torch.Tensor] | None],
                       deadline: float | None) -> list[dict]:
    """DeepSpeed ZeRO-Inference's rows: one forward per sequence length in its own process, one row per
    (length, budget) with the same measurement, over budget where its peak exceeds the cell's."""
    cells = [(seq, budget) for seq in cfg.seqs for budget in cfg.budgets]

    def every_cell(**fields) -> list[dict]:
        return [{"system": "zero_inference", "seq": seq, "budget": budget, **fields} for seq, budget in cells]

    if not cfg.device.startswith("cuda"):
        return every_cell(status="skipped", error="DeepSpeed's ZeRO-Inference offloads to a CUDA device")
    limit_s = deadline - time.monotonic() - 5 if deadline is not None else None
    if limit_s is not None and limit_s < MIN_CELL_S:
        return every_cell(status=TIMEOUT, error="not started: the command's --time-limit is (nearly) used up")
    request = {"tiny": cfg.tiny, "seqs": list(cfg.seqs), "device": cfg.device, "steps": cfg.steps,
               "warmup": cfg.warmup, "deadline": time.time() + (0.9 * limit_s if limit_s else 1e9)}
    release_memory(cfg.device)
    outcome = call_spawned(zero_inference_cells, request, limit_s=limit_s)
    if outcome.status != OK:
        return every_cell(status=outcome.status, error=outcome.error, process_s=outcome.seconds)
    if outcome.value["status"] != OK:
        return every_cell(status=outcome.value["status"], error=outcome.value["error"])
    return zero_inference_rows(cells, outcome.value, references, outcome.seconds)


def zero_inference_rows(cells: list[tuple[int, str]], result: dict,
                        references: dict[int, tuple[str, torch.Tensor] | None], process_s: float) -> list[dict]:
    """The rows of zero_inference_cells' result: per (length, budget) that length's measurement, its
    logits compared with the reference's, judged against the budget."""
    facts = {k: v for k, v in result.items() if k not in ("status", "cells")}
    rows = []
    for seq, budget in cells:
        cell = result["cells"][seq]
        row = {"system": "zero_inference", "seq": seq, "budget": budget, **facts, "process_s": process_s}
        if cell["status"] == OK:
            row.update(status=OK, step_s=statistics.median(cell["steps_s"]), steps_s=cell["steps_s"],
                       peak_allocated=cell["peak_allocated"])
            compare(row, torch.from_numpy(cell["logits"]), references.get(seq))
            judge_budget(row, budget)
        else:
            row.update(status=cell["status"], error=cell["error"])
        rows.append(row)
    return rows


def _not_started(system: str, seq: int, budget: str | None, deadline: float | None) -> dict | None:
    """The row of a cell too late to start under --time-limit, else None."""
    if deadline is None or deadline - time.monotonic() >= MIN_CELL_S:
        return None
    return {"system": system, "seq": seq, "budget": budget, "status": TIMEOUT,
            "error": "not started: the command's --time-limit is (nearly) used up"}


def run_prefill(cfg: PrefillConfig, save: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """Every cell of ``cfg``; ``save(rows)`` after each row."""
    deadline = time.monotonic() + cfg.time_limit if cfg.time_limit else None
    model = llama(cfg.tiny, cfg.device)
    vocab = model.config.vocab_size
    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        save(rows)
        budget = f", budget {row['budget']}" if row.get("budget") else ""
        log.info("%s, %d tokens%s: %s", row["system"], row["seq"], budget, _short(row))

    references: dict[int, tuple[str, torch.Tensor] | None] = {}
    for seq in cfg.seqs:
        ids = prefill_ids(seq, vocab)
        reference = None  # eager's logits; turnip's first where eager did not run
        if "eager" in cfg.systems:
            late = _not_started("eager", seq, None, deadline)
            row, out = (late, None) if late else run_eager(model, ids, cfg)
            add(row)
            reference = ("eager", out) if out is not None else None
        if "turnip" in cfg.systems:
            for budget in cfg.budgets:
                late = _not_started("turnip", seq, budget, deadline)
                row, out = (late, None) if late else run_turnip(model, ids, budget, cfg, reference)
                add(row)
                if reference is None and out is not None:
                    reference = ("turnip", out)
        if "accelerate" in cfg.systems:
            for budget in cfg.budgets:
                add(_not_started("accelerate", seq, budget, deadline) or run_accelerate(model, ids, budget, cfg,
                                                                                        reference))
        references[seq] = reference
    if "zero_inference" in cfg.systems:
        del model  # the peer's process builds its own
        for row in run_zero_inference(cfg, references, deadline):
            add(row)
    return rows


def _short(row: dict) -> str:
    if row.get("step_s") is None:
        return row["status"]
    peak = f", peak {row['peak_allocated'] / 2**30:.2f} GiB" if row.get("peak_allocated") else ""
    status = "" if row["status"] == OK else f" ({row['status']})"
    return f"{row['step_s'] * 1e3:.1f} ms{peak}{status}"


def format_rows(rows: list[dict]) -> str:
    lines = [(f"{'system':<14} {'tokens':>7} {'budget':>8} {'step ms':>9} {'peak GiB':>9} {'floor ms':>9} "
              f"{'compile s':>9} {'pinned GiB':>10}  status")]

    def num(r, key, scale=1.0, fmt="{:.1f}"):
        return fmt.format(r[key] * scale) if r.get(key) is not None else "-"

    for r in rows:
        lines.append(f"{r['system']:<14} {r['seq']:>7} {r['budget'] or '-':>8} {num(r, 'step_s', 1e3):>9} "
                     f"{num(r, 'peak_allocated', 2**-30, '{:.2f}'):>9} {num(r, 'floor_s', 1e3):>9} "
                     f"{num(r, 'compile_s'):>9} {num(r, 'pinned_bytes', 2**-30, '{:.2f}'):>10}  {r['status']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnip.bench.prefill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default=None, help="comma-separated sequence lengths (default 8192,16384,32768)")
    parser.add_argument("--budgets", default=None, help="comma-separated GPU budgets (sizes such as 16GiB, or "
                        "fractions of the unplanned peak)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU: the plumbing in seconds")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    parser.add_argument("--tag", default="", help="suffix of the JSON's name (prefill_TAG.json): split runs")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds for the whole command: a cell "
                        "that would start with less than 10 s left is a timeout row (default: no limit)")
    parser.add_argument("--planner-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--audit", action="store_true", help="turnip rows also list the CUDA blocks live beside "
                        "the arena at the peak of the first two runs and of one more step after timing "
                        "(recorded by the caching allocator)")
    parser.add_argument("--profile", action="store_true", help="eager and turnip rows also run one step under "
                        "torch.profiler: GPU milliseconds and calls per ATen op, kernels, GPU busy time (CUDA only)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    cfg = PrefillConfig(tiny=args.tiny, steps=args.steps, warmup=args.warmup, time_limit=args.time_limit,
                        tag=args.tag, systems=[s for s in args.systems.split(",") if s], audit=args.audit,
                        profile=args.profile)
    unknown = [s for s in cfg.systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown} (known: {', '.join(SYSTEMS)})")
    cfg.device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.tiny:
        cfg.seqs, cfg.budgets = [64, 128], ["0.6", "0.4"]
    if args.seqs:
        cfg.seqs = [int(x) for x in args.seqs.split(",") if x]
    if args.budgets:
        cfg.budgets = [x.strip() for x in args.budgets.split(",") if x.strip()]
    for budget in cfg.budgets:
        try:
            check_budget(budget, what="--budgets")
        except BudgetError as exc:
            parser.error(str(exc))
    cfg.planner_options = planner_options(args.planner_option)
    name = ("prefill-tiny" if cfg.tiny else "prefill") + (f"_{cfg.tag}" if cfg.tag else "") + ".json"
    path = Path(args.out) / name if args.out else result_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()}
    header = {"benchmark": "prefill", **run_metadata(), "config": config,
              "model": "llama tiny" if cfg.tiny else "llama-2-7b shape, random bf16 weights"}

    def save(rows: list[dict]) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({**header, "rows": rows}, indent=1))
        os.replace(tmp, path)

    rows = run_prefill(cfg, save)
    save(rows)
    print(format_rows(rows))
    print(f"rows in {path}", file=sys.stderr)
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
