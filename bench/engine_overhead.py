"""Engine overhead: microseconds per vertex for a graph of tiny kernels, beside eager launches.

    python -m turnip.bench.engine_overhead [--chains 8] [--length 250] [--repeat 5]

The graph is `chains` independent chains of `length` tiny adds (1024 floats),
summed into a loss. The same kernels launched from a plain Python loop give the
eager cost per kernel; turnip's cost per vertex is its step time over its
vertex count. Each completion mechanism / launch-ahead depth is a row.
Writes bench/results/engine_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch
from turnip.bench.results import result_path, run_metadata
from turnip.engine.cuda import CudaRuntime
from turnip.ir.plan import Plan
from turnip.ir.taskgraph import TaskGraph, ValueKind

from turnip import engine, memgraph

log = logging.getLogger(__name__)


def tiny_chains(chains: int, length: int, numel: int = 1024, device: str = "cuda") -> TaskGraph:
    tg = TaskGraph(device=torch.device(device).type)
    nbytes = numel * 4
    x = tg.add_value((numel,), (1,), torch.float32, nbytes, ValueKind.BATCH, name="batch:x")
    tg.batch_inputs.append(x)
    ends = []
    for _ in range(chains):
        cur = x
        for _ in range(length):
            out = tg.add_value((numel,), (1,), torch.float32, nbytes)
            tg.add_vertex("aten::add.Tensor", (tg.values[cur].dense_ref, tg.values[x].dense_ref), {}, (out,))
            cur = out
        ends.append(cur)
    total = ends[0]
    for end in ends[1:]:
        out = tg.add_value((numel,), (1,), torch.float32, nbytes)
        tg.add_vertex("aten::add.Tensor", (tg.values[total].dense_ref, tg.values[end].dense_ref), {}, (out,))
        total = out
    loss = tg.add_value((), (), torch.float32, 4)
    tg.add_vertex("aten::sum", (tg.values[total].dense_ref,), {}, (loss,))
    tg.outputs["loss"] = loss
    return tg


def eager_us_per_kernel(chains: int, length: int, repeat: int, numel: int = 1024) -> list[float]:
    add = torch.ops.aten.add.Tensor
    x = torch.randn(numel, device="cuda")
    n = chains * length + chains
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ends = []
        for _ in range(chains):
            cur = x
            for _ in range(length):
                cur = add(cur, x)
            ends.append(cur)
        total = ends[0]
        for end in ends[1:]:
            total = add(total, end)
        torch.ops.aten.sum.default(total)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return times[1:]


def primitive_costs(iterations: int = 2000) -> dict[str, float]:
    """Host cost (us) of the CUDA calls the engine makes per vertex."""
    x = torch.randn(1024, device="cuda")
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    event = torch.cuda.Event()
    add_out = torch.ops.aten.add.out

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iterations):
            fn()
        elapsed = time.perf_counter() - t0
        torch.cuda.synchronize()
        return elapsed / iterations * 1e6

    def stream_context():
        with torch.cuda.stream(stream):
            pass

    return {
        "aten.add.out launch": timed(lambda: add_out(x, x, out=out)),
        "event.record": timed(lambda: event.record(stream)),
        "event.query": timed(event.query),
        "stream.wait_event": timed(lambda: stream.wait_event(event)),
        "torch.cuda.stream context": timed(stream_context),
        "torch.cuda.set_stream": timed(lambda: torch.cuda.set_stream(stream)),
    }


def turnip_us_per_vertex(tg: TaskGraph, repeat: int, ordering: str, depth: int, streams: dict | None):


    mg = memgraph.build(tg, Plan(gpu_budget=1 << 34))
    mg.device = "cuda"
    mg.runtime = CudaRuntime(mg, depth=depth)
    batch = torch.randn(tg.values[tg.batch_inputs[0]].shape, device="cuda")
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.run(mg, batch, ordering=ordering, streams=streams)
        times.append((time.perf_counter() - t0) / len(mg.vertices) * 1e6)
    return times[1:], len(mg.vertices)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chains", type=int, default=8)
    parser.add_argument("--length", type=int, default=250)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        raise SystemExit("engine_overhead needs a CUDA device")
    tg = tiny_chains(args.chains, args.length)
    rows = []
    eager = eager_us_per_kernel(args.chains, args.length, args.repeat)
    rows.append({"system": "eager launches", "us_per_vertex": statistics.median(eager), "runs": eager})
    configs = [
        ("turnip event-poll, launch-ahead 16, nondeterministic", "nondeterministic", 16, {"compute": 1}),
        ("turnip event-poll, launch-ahead 16, deterministic", "deterministic", 16, {"compute": 1}),
        ("turnip event-poll, launch-ahead 64", "nondeterministic", 64, {"compute": 1}),
        ("turnip event-poll, no launch-ahead (wait for each completion)", "nondeterministic", 0, {"compute": 1}),
        ("turnip event-poll, launch-ahead 16, 3 compute streams", "nondeterministic", 16, {"compute": 3}),
    ]
    for name, ordering, depth, streams in configs:
        times, n = turnip_us_per_vertex(tg, args.repeat, ordering, depth, streams)
        rows.append({"system": name, "us_per_vertex": statistics.median(times), "runs": times, "vertices": n})
    base = rows[0]["us_per_vertex"]
    for row in rows:
        row["overhead_us_vs_eager"] = row["us_per_vertex"] - base
        log.info("%-70s %7.2f us/vertex (+%.2f)", row["system"], row["us_per_vertex"], row["overhead_us_vs_eager"])
    primitives = primitive_costs()
    torch.cuda.set_stream(torch.cuda.default_stream())
    for name, us in primitives.items():
        log.info("%-30s %6.2f us", name, us)
    out = {"benchmark": "engine_overhead", **run_metadata(), "chains": args.chains, "length": args.length,
           "rows": rows, "primitives_us": primitives}
    path = result_path("engine_overhead.json")
    path.write_text(json.dumps(out, indent=2))
    log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
