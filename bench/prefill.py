"""Long-sequence prefill (first-token inference) of a Llama-2-7B-shaped model under a GPU budget:
turnip's forward-only step (compile(..., backward=False)) beside eager PyTorch and Hugging Face
accelerate's CPU offload (infer_auto_device_map with max_memory at the budget, dispatch_model).

    python -m turnip.bench.prefill --seqs 8192,16384,32768 --budgets 16GiB,8GiB   # the GPU machine
    python -m turnip.bench.prefill --tiny                                         # CPU, 2 layers (CI)

The model is Hugging Face's LlamaForCausalLM with Llama-2-7B's sizes (hidden 4096, MLP 11008, 32
layers, 32 heads, vocab 32000) and random bf16 weights (nothing is downloaded); the step keeps the
last position's logits, as prefill does. Per sequence length eager runs once on the whole GPU (its
measured peak says whether it fits a budget); turnip is compiled per (length, budget). Each row
records the median step, measured peak, compile time, pinned host memory, bytes moved each way,
turnip's floor max(compute, weight bytes in / H2D bandwidth) from its cost model, and the largest
difference of its logits from eager's. Writes prefill[-tiny].json under bench/results.

accelerate's row is not run on the CPU ("skipped"); it caps only where weights go, so its measured
peak can exceed the budget (the row says how much). `python -m turnip.bench plots` draws time
against sequence length from the JSON (bench/plots.py, plot_prefill). Not here yet: DeepSpeed
ZeRO-Inference.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from turnip.bench.models.llama import LLAMA2_7B
from turnip.bench.options import planner_options
from turnip.bench.peers.common import release_memory, sync
from turnip.bench.results import result_path, run_metadata
from turnip.engine.timing_sim import step_floor, transfer_bytes
from turnip.ir.budget import parse_budget
from turnip.planners.costs import CostModel

from turnip import engine, memgraph

log = logging.getLogger(__name__)

TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


@dataclass
class PrefillConfig:
    seqs: list[int] = field(default_factory=lambda: [8192, 16384, 32768])
    budgets: list[str] = field(default_factory=lambda: ["16GiB", "8GiB"])
    systems: list[str] = field(default_factory=lambda: ["eager", "turnip", "accelerate"])
    steps: int = 3
    warmup: int = 1
    tiny: bool = False
    device: str = "cuda"
    out: Path | None = None
    planner_options: dict = field(default_factory=dict)


def llama(tiny: bool) -> torch.nn.Module:
    """Random-weight LlamaForCausalLM of the 7B shape (bf16) or the tiny one (fp32, for the CPU)."""
    import transformers  # optional: the bench extra

    shape = TINY if tiny else LLAMA2_7B
    cfg = transformers.LlamaConfig(**shape, use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
    dtype = torch.float32 if tiny else torch.bfloat16
    started = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(dtype)  # no memory yet: 7B fp32 would be 27 GB
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        model.model.rotary_emb.__init__(cfg)  # its inv_freq buffer was left empty on the meta device
    log.info("llama (%s): %.2f B parameters built in %.1fs", "tiny" if tiny else "7B shape",
             sum(p.numel() for p in model.parameters()) / 1e9, time.perf_counter() - started)
    return model.eval()


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
        return row, out.float().cpu()
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", error=str(exc)[:300])
        return row, None
    finally:
        model.to("cpu")
        release_memory(cfg.device)


def run_turnip(model, ids: torch.Tensor, budget: str, cfg: PrefillConfig, want: torch.Tensor | None) -> dict:
    row = {"system": "turnip", "seq": ids.shape[1], "budget": budget}
    fn = prefill_fn(model)
    mg = None
    try:
        release_memory(cfg.device)
        started = time.perf_counter()
        mg = memgraph.compile(model, fn, ids, backward=False, budget=_budget(budget), device=cfg.device,
                              verbose=False, **cfg.planner_options)
        row["compile_s"] = time.perf_counter() - started
        release_memory(cfg.device)
        times, out = _timed(lambda: engine.run(mg, ids)["output"], cfg.steps, cfg.warmup, cfg.device)
        moved_in, moved_out = transfer_bytes(mg)
        costs = CostModel(device=mg.device)
        floor = step_floor(mg, costs)
        row.update(status="ok", step_s=statistics.median(times), steps_s=times, peak_allocated=_peak(cfg.device),
                   arena_bytes=mg.arena_bytes, pinned_bytes=mg.cpu_bytes, bytes_h2d=moved_in, bytes_d2h=moved_out,
                   floor_s=max(floor["compute"], floor["h2d"]), floor_compute_s=floor["compute"],
                   floor_h2d_s=floor["h2d"], predicted_s=mg.stats.get("predicted_step_s") or mg.plan.predicted_time)
        if want is not None:
            row["max_abs_diff_vs_eager"] = float((out.float().cpu() - want).abs().max())
    except memgraph.InfeasibleBudget as exc:
        row.update(status="infeasible", error=str(exc)[:400])
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", error=str(exc)[:300])
    finally:
        if mg is not None:
            mg.release()
        release_memory(cfg.device)
    return row


def run_accelerate(model, ids: torch.Tensor, budget: str, cfg: PrefillConfig, want: torch.Tensor | None) -> dict:
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
        if want is not None:
            row["max_abs_diff_vs_eager"] = float((out.float().cpu() - want).abs().max())
        remove_hook_from_module(dispatched, recurse=True)
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", error=str(exc)[:300])
    except Exception as exc:  # noqa: BLE001 - a peer that fails is a row, not the end of the benchmark
        row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:400])
    finally:
        del copy_of
        release_memory(cfg.device)
    return row


def _budget(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def run_prefill(cfg: PrefillConfig) -> list[dict]:
    model = llama(cfg.tiny)
    vocab = model.config.vocab_size
    rows = []
    for seq in cfg.seqs:
        ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
        want = None
        if "eager" in cfg.systems:
            row, want = run_eager(model, ids, cfg)
            rows.append(row)
            log.info("eager, %d tokens: %s", seq, _short(row))
        for system, run in (("turnip", run_turnip), ("accelerate", run_accelerate)):
            if system not in cfg.systems:
                continue
            for budget in cfg.budgets:
                row = run(model, ids, budget, cfg, want)
                rows.append(row)
                log.info("%s, %d tokens, budget %s: %s", system, seq, budget, _short(row))
    return rows


def _short(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"]
    peak = f", peak {row['peak_allocated'] / 2**30:.2f} GiB" if row.get("peak_allocated") else ""
    return f"{row['step_s'] * 1e3:.1f} ms{peak}"


def format_rows(rows: list[dict]) -> str:
    lines = [(f"{'system':<8} {'tokens':>7} {'budget':>8} {'step ms':>9} {'peak GiB':>9} {'floor ms':>9} "
              f"{'compile s':>9} {'pinned GiB':>10}  status")]

    def num(r, key, scale=1.0, fmt="{:.1f}"):
        return fmt.format(r[key] * scale) if r.get(key) is not None else "-"

    for r in rows:
        lines.append(f"{r['system']:<8} {r['seq']:>7} {r['budget'] or '-':>8} {num(r, 'step_s', 1e3):>9} "
                     f"{num(r, 'peak_allocated', 2**-30, '{:.2f}'):>9} {num(r, 'floor_s', 1e3):>9} "
                     f"{num(r, 'compile_s'):>9} {num(r, 'pinned_bytes', 2**-30, '{:.2f}'):>10}  {r['status']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnip.bench.prefill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default=None, help="comma-separated sequence lengths (default 8192,16384,32768)")
    parser.add_argument("--budgets", default=None, help="comma-separated GPU budgets (sizes such as 16GiB, or "
                        "fractions of the unplanned peak)")
    parser.add_argument("--systems", default="eager,turnip,accelerate")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU: the plumbing in seconds")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    parser.add_argument("--planner-option", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    cfg = PrefillConfig(tiny=args.tiny, steps=args.steps, warmup=args.warmup,
                        systems=[s for s in args.systems.split(",") if s])
    cfg.device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.tiny:
        cfg.seqs, cfg.budgets = [64, 128], ["0.6", "0.4"]
    if args.seqs:
        cfg.seqs = [int(x) for x in args.seqs.split(",") if x]
    if args.budgets:
        cfg.budgets = [x for x in args.budgets.split(",") if x]
    cfg.planner_options = planner_options(args.planner_option)
    rows = run_prefill(cfg)
    name = "prefill-tiny.json" if cfg.tiny else "prefill.json"
    path = Path(args.out) / name if args.out else result_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()}
    path.write_text(json.dumps({"benchmark": "prefill", **run_metadata(), "config": config,
                                "model": "llama tiny" if cfg.tiny else "llama-2-7b shape, random bf16 weights",
                                "rows": rows}, indent=1))
    print(format_rows(rows))
    print(f"rows in {path}", file=sys.stderr)
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
