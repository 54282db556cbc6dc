"""Where a turnip step's time goes: GPU time per op and phase from one traced step, beside eager.

    python -m turnip.bench.profile_step [--model gpt350m] [--budget none|0.5] [--steps 3]

Compiles the model (budget "none" = everything kept, no transfers), times a few
steps, runs one more step with device timing events, and sums each vertex's GPU
time by op and by phase; also times the same steps in eager PyTorch. Writes
bench/results/profile_<model>.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from .. import engine, memgraph
from ..ir.memgraph import Kind
from .models.sizes import make_workload
from .results import result_path, run_metadata

log = logging.getLogger(__name__)


def timed(fn, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def breakdown(mg, trace_file: Path) -> dict:
    events = [e for e in json.loads(trace_file.read_text())["traceEvents"] if e.get("ph") == "X"]
    by_op, by_phase, by_kind = collections.Counter(), collections.Counter(), collections.Counter()
    busy = collections.Counter()
    for e in events:
        vid = e["args"]["vertex"]
        mv = mg.vertices[vid]
        dur = e["dur"] / 1e3  # ms
        by_kind[mv.kind.value] += dur
        busy[mv.stream.value] += dur
        if mv.kind is Kind.COMPUTE:
            tv = mg.taskgraph.vertices[mv.task_vertex]
            by_op[tv.op] += dur
            by_phase[tv.phase] += dur
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
    return {"span_ms": span, "busy_ms_by_stream": dict(busy), "ms_by_kind": dict(by_kind),
            "ms_by_phase": dict(by_phase), "top_ops_ms": dict(by_op.most_common(25))}


def kernel_profile(step, count: int = 30) -> dict:
    """Kernel time of one step from torch.profiler (CUPTI), independent of how the host launched it:
    GPU milliseconds and calls per ATen op (self time; the ``count`` costliest; kernels replayed in a
    CUDA graph have no op) and per kernel name, their sum, the number of kernels, and the step's wall
    time under the profiler. Sum of kernels well below wall = the GPU waited on the host."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows = [(e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.key.startswith("aten::")]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])[:count]
    by_kernel: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_kernel[e.name[:120]][0] += e.time_range.elapsed_us() / 1e3
        by_kernel[e.name[:120]][1] += 1
    top_kernels = dict(sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:count])
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return {"wall_ms": wall * 1e3, "kernel_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3,
            "gpu_busy_ms": busy / 1e3, "kernels": len(kernels), "ops_ms": {op: ms for op, ms, _ in rows},
            "ops_calls": {op: calls for op, _, calls in rows}, "top_kernels_ms_calls": top_kernels}


def top_workspace(mg, count: int = 10) -> list[dict]:
    """The ops that need the most memory beside the arena while they run (the unplanned peak adds the largest)."""
    heavy = sorted((v for v in mg.taskgraph.vertices if v.workspace), key=lambda v: -v.workspace)[:count]
    return [{"op": v.op, "module": v.module, "phase": v.phase, "workspace": v.workspace} for v in heavy]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt350m", help="gpt350m, gpt1.3b, lora1.3b or llama")
    parser.add_argument("--budget", default="none", help="'none' (keep everything) or a fraction of the peak")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("profile_step needs a CUDA device")
    workload = make_workload(args.model)
    batch = workload.batch_on("cuda")
    optimizer = workload.optimizer([p for p in workload.model.parameters() if p.requires_grad])
    budget = None if args.budget == "none" else float(args.budget)
    mg = memgraph.compile(workload.model, workload.loss_fn, batch, optimizer=optimizer, budget=budget,
                          device="cuda")
    engine.run(mg, batch)  # first step: allocation, RNG and view set-up
    engine.run(mg, batch)  # second: segments captured as CUDA graphs
    turnip_s = timed(lambda: engine.run(mg, batch), args.steps)
    trace_file = result_path(f"profile_{args.model}_trace.json")
    engine.run(mg, batch, timeline=trace_file)
    turnip_kernels = kernel_profile(lambda: engine.run(mg, batch))
    result = {"benchmark": "profile_step", **run_metadata(), "model": args.model, "budget": args.budget,
              "turnip_step_ms": [t * 1e3 for t in turnip_s], "summary": mg.summary(),
              "unplanned_peak": mg.stats.get("unplanned_peak"), "arena_bytes": mg.arena_bytes,
              "top_workspace": top_workspace(mg), "breakdown": breakdown(mg, trace_file),
              "turnip_kernels": turnip_kernels}
    mg.release(keep=False)
    trace_file.unlink()
    model = workload.fresh_model("cuda")
    eager_opt = workload.optimizer([p for p in model.parameters() if p.requires_grad])

    def eager_step():
        eager_opt.zero_grad()
        workload.loss_fn(model, batch).backward()
        eager_opt.step()

    eager_step()
    result["eager_step_ms"] = [t * 1e3 for t in timed(eager_step, args.steps)]
    result["eager_kernels"] = kernel_profile(eager_step)
    log.info("turnip %.1f ms, eager %.1f ms; breakdown %s", statistics.median(result["turnip_step_ms"]),
             statistics.median(result["eager_step_ms"]), json.dumps(result["breakdown"], indent=1))
    for name in ("turnip_kernels", "eager_kernels"):
        k = result[name]
        log.info("%s: wall %.1f ms, kernels %.1f ms (%d), GPU busy %.1f ms", name, k["wall_ms"], k["kernel_ms"],
                 k["kernels"], k["gpu_busy_ms"])
    path = result_path(f"profile_{args.model}.json")
    path.write_text(json.dumps(result, indent=2, default=str))
    log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
