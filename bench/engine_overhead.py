"""Engine overhead: microseconds per vertex for a graph of tiny kernels, beside eager launches.

    python -m turnip.bench.engine_overhead [--chains 8] [--length 250] [--repeat 5]

The graph is `chains` independent chains of `length` tiny adds (1024 floats), summed into a loss;
only the first add of a chain reads the batch, so each chain is one segment (memgraph/segments.py)
when segments are on. The same kernels launched from a plain Python loop give the eager cost per
kernel; turnip's cost per vertex is its step time over its vertex count (amortized over a
segment's vertices where segments are on). Each row is one setting: segments on or off (build's
segment_size), completion by polled events or by stream callbacks (engine.run's completion; the
callback rows need CuPy and are left out, with a warning, without it), launch-ahead depth,
ordering, compute streams. Needs a CUDA device. Writes bench/results/engine_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import statistics
import time
from typing import NamedTuple

import torch

from .. import engine, memgraph
from ..engine.completions import launch_host_func
from ..engine.cuda import CudaRuntime
from ..engine.errors import EngineError
from ..ir.plan import Plan
from ..ir.taskgraph import TaskGraph, ValueKind
from .results import result_path, run_metadata

log = logging.getLogger(__name__)

WARMUP = 2  # the first run binds vertices and makes library handles, the second captures the segments


class Setting(NamedTuple):
    system: str
    segments: bool
    completion: str
    depth: int = 16
    ordering: str = "nondeterministic"
    compute_streams: int = 1


SETTINGS = [
    Setting("turnip, segments off, events (launch-ahead 16, nondeterministic)", False, "events"),
    Setting("turnip, segments off, callbacks", False, "callback"),
    Setting("turnip, segments on, events", True, "events"),
    Setting("turnip, segments on, callbacks", True, "callback"),
    Setting("turnip, segments off, events, deterministic", False, "events", ordering="deterministic"),
    Setting("turnip, segments off, events, launch-ahead 64", False, "events", depth=64),
    Setting("turnip, segments off, events, no launch-ahead (wait for every completion)", False, "events", depth=0),
    Setting("turnip, segments off, callbacks, no launch-ahead", False, "callback", depth=0),
    Setting("turnip, segments off, events, 3 compute streams", False, "events", compute_streams=3),
]


def tiny_chains(chains: int, length: int, numel: int = 1024, device: str = "cuda") -> TaskGraph:
    """Each chain: base = x + x, then length - 1 times cur = cur + base; the chain ends are summed."""
    tg = TaskGraph(device=torch.device(device).type)
    nbytes = numel * 4
    x = tg.add_value((numel,), (1,), torch.float32, nbytes, ValueKind.BATCH, name="batch:x")
    tg.batch_inputs.append(x)

    def add(a: int, b: int) -> int:
        out = tg.add_value((numel,), (1,), torch.float32, nbytes)
        tg.add_vertex("aten::add.Tensor", (tg.values[a].dense_ref, tg.values[b].dense_ref), {}, (out,))
        return out

    ends = []
    for _ in range(chains):
        base = cur = add(x, x)
        for _ in range(length - 1):
            cur = add(cur, base)
        ends.append(cur)
    total = ends[0]
    for end in ends[1:]:
        total = add(total, end)
    loss = tg.add_value((), (), torch.float32, 4)
    tg.add_vertex("aten::sum", (tg.values[total].dense_ref,), {}, (loss,))
    tg.outputs["loss"] = loss
    return tg


def eager_us_per_kernel(chains: int, length: int, repeat: int, numel: int = 1024) -> list[float]:
    """The kernels of tiny_chains launched from a Python loop."""
    add = torch.ops.aten.add.Tensor
    x = torch.randn(numel, device="cuda")
    n = chains * length + chains
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ends = []
        for _ in range(chains):
            base = cur = add(x, x)
            for _ in range(length - 1):
                cur = add(cur, base)
            ends.append(cur)
        total = ends[0]
        for end in ends[1:]:
            total = add(total, end)
        torch.ops.aten.sum.default(total)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return times[1:]


def primitive_costs(host_func, iterations: int = 2000) -> dict[str, float]:
    """Host cost (us) of the CUDA calls the engine makes per vertex; ``host_func``: CuPy's
    cudaLaunchHostFunc (None: not measured)."""
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

    costs = {
        "aten.add.out launch": timed(lambda: add_out(x, x, out=out)),
        "event.record": timed(lambda: event.record(stream)),
        "event.query": timed(event.query),
        "stream.wait_event": timed(lambda: stream.wait_event(event)),
        "torch.cuda.stream context": timed(stream_context),
        "torch.cuda.set_stream": timed(lambda: torch.cuda.set_stream(stream)),
    }
    if host_func is not None:
        fired: queue.SimpleQueue[int] = queue.SimpleQueue()
        handle = stream.cuda_stream
        costs["cudaLaunchHostFunc (CuPy) of SimpleQueue.put"] = timed(lambda: host_func(handle, fired.put, 0))
    return costs


def host_func_launcher():
    """CuPy's cudaLaunchHostFunc, or None (logged) without CuPy: the callback rows are then left out."""
    try:
        return launch_host_func()
    except EngineError as exc:
        log.warning("callback rows left out: %s", exc)
        return None


def turnip_us_per_vertex(tg: TaskGraph, repeat: int, setting: Setting) -> tuple[list[float], dict]:
    mg = memgraph.build(tg, Plan(gpu_budget=1 << 34), segment_size=None if setting.segments else 1)
    mg.device = "cuda"
    mg.runtime = CudaRuntime(mg, depth=setting.depth)
    batch = torch.randn(tg.values[tg.batch_inputs[0]].shape, device="cuda")
    times = []
    for _ in range(repeat + WARMUP):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.run(mg, batch, ordering=setting.ordering, streams={"compute": setting.compute_streams},
                   completion=setting.completion)
        times.append((time.perf_counter() - t0) / len(mg.vertices) * 1e6)
    shape = {"vertices": len(mg.vertices), "segments": len(mg.segments), "units": mg.runtime.graph.n}
    mg.release(keep=False)
    return times[WARMUP:], shape


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chains", type=int, default=8)
    parser.add_argument("--length", type=int, default=250)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        raise SystemExit("engine_overhead measures CUDA launches and needs a CUDA device; none is available here")
    tg = tiny_chains(args.chains, args.length)
    rows = []
    eager = eager_us_per_kernel(args.chains, args.length, args.repeat)
    rows.append({"system": "eager launches of the same kernels", "us_per_vertex": statistics.median(eager),
                 "runs": eager})
    host_func = host_func_launcher()
    callbacks = host_func is not None
    for setting in SETTINGS:
        if setting.completion == "callback" and not callbacks:
            continue
        times, shape = turnip_us_per_vertex(tg, args.repeat, setting)
        rows.append({"system": setting.system, **setting._asdict(), "us_per_vertex": statistics.median(times),
                     "runs": times, **shape})
    base = rows[0]["us_per_vertex"]
    for row in rows:
        row["overhead_us_vs_eager"] = row["us_per_vertex"] - base
    log.info("%-75s %14s %12s", "system", "us per vertex", "above eager")
    for row in rows:
        log.info("%-75s %14.2f %+12.2f", row["system"], row["us_per_vertex"], row["overhead_us_vs_eager"])
    primitives = primitive_costs(host_func)
    torch.cuda.set_stream(torch.cuda.default_stream())
    for name, us in primitives.items():
        log.info("%-45s %6.2f us", name, us)
    out = {"benchmark": "engine_overhead", **run_metadata(), "chains": args.chains, "length": args.length,
           "callbacks_measured": callbacks, "rows": rows, "primitives_us": primitives}
    path = result_path("engine_overhead.json")
    path.write_text(json.dumps(out, indent=2))
    log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
