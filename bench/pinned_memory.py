"""Link bandwidth by kind of pinned host memory, with copies spread over a large buffer as a step's are.

    python -m turnip.bench.pinned_memory [--gib 8] [--chunk-mib 64] [--copies 48]

A training step's reloads read 16-128 MB pieces from all over many GB of pinned storage, while
planners/measure.py times one 64 MB buffer copied again and again. Each row here copies `copies`
chunks at random chunk-aligned offsets of a `gib` GiB buffer (or the same chunk every time, for
comparison), host to device, device to host, both at once on two streams, and host to device
beside a stream of bf16 matmuls. The buffers:

- ``register``: ``torch.empty`` pinned with cudaHostRegister (engine/cuda.py's pinned_bytes, the
  engine's default; base pages of 4 KiB);
- ``register-hugepage``: an anonymous mapping advised MADV_HUGEPAGE (transparent huge pages of
  2 MiB) and pinned with cudaHostRegister;
- ``hostalloc``: torch's pinned allocator (cudaHostAlloc; it rounds a request up to a power of two).

With ``--step MODEL --budget B`` it also compiles a bench model's training step at B (compile's
budget: bytes, a size such as 8.66GiB, or a fraction of the unplanned peak) and times it with the
engine's pinned storage made each way (``CudaRuntime(huge_pages=...)``), the two alternating for
``--rounds`` rounds on the one MemGraph: the step's reloads are where a difference shows.

Measured on the H100 (bench/results/h100/pinned_memory*.json): every kind and layout moves 54.6-55.2
GB/s one way and about 50 GB/s each way both at once, and gpt1.3b's step at 25% of eager's peak took
415.9 ms (huge pages) against 413.6 (base pages), so the engine keeps base pages.

Needs a CUDA device. Writes bench/results/pinned_memory.json.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
from pathlib import Path

import torch

from .. import engine, memgraph
from ..engine.cuda import CudaRuntime, pinned_bytes, unpin
from .models.sizes import make_workload
from .peers.common import device_timed_steps, trainable
from .results import run_metadata, write_result

log = logging.getLogger(__name__)

KINDS = ("register", "register-hugepage", "hostalloc")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def host_buffer(kind: str, nbytes: int) -> tuple[torch.Tensor, bool]:
    """(pinned buffer of nbytes, whether to unpin it with cudaHostUnregister when done)."""
    if kind == "hostalloc":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False
    return pinned_bytes(nbytes, huge_pages=kind == "register-hugepage"), True


def time_copies(pairs_by_stream: list[list[tuple[torch.Tensor, torch.Tensor]]], matmuls: int = 0) -> list[float]:
    """Seconds each stream took for its copies, all streams started together."""
    streams = [torch.cuda.Stream() for _ in pairs_by_stream]
    start = torch.cuda.Event(enable_timing=True)
    ends = [torch.cuda.Event(enable_timing=True) for _ in streams]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) if matmuls else None
    torch.cuda.synchronize()
    start.record()
    for stream, pairs, end in zip(streams, pairs_by_stream, ends, strict=True):
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            end.record()
    for _ in range(matmuls):
        a @ a
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for end in ends]


def measure(kind: str, nbytes: int, chunk: int, copies: int, seed: int = 0) -> list[dict]:
    host, registered = host_buffer(kind, nbytes)
    try:
        host.view(-1)[::4096].fill_(1)  # every page touched before timing
        device = torch.empty(copies * chunk, dtype=torch.uint8, device="cuda")
        rng = random.Random(seed)
        offsets = [rng.randrange(nbytes // chunk) * chunk for _ in range(copies)]
        spread = [host[o:o + chunk] for o in offsets]
        same = [host[:chunk]] * copies
        dev = [device[k * chunk:(k + 1) * chunk] for k in range(copies)]
        rows = []
        for layout, srcs in (("spread", spread), ("same chunk", same)):
            h2d = list(zip(dev, srcs, strict=True))
            d2h = list(zip(srcs, dev, strict=True))
            time_copies([h2d[:4]])  # warm-up
            cases = {"h2d": ([h2d], 0), "d2h": ([d2h], 0), "both": ([h2d, d2h], 0), "h2d beside matmuls": ([h2d], 40)}
            for case, (streams, matmuls) in cases.items():
                seconds = time_copies(streams, matmuls)
                row = {"kind": kind, "layout": layout, "case": case, "chunk_bytes": chunk, "copies": copies,
                       "buffer_bytes": nbytes, "seconds": seconds,
                       "gb_per_s": [copies * chunk / s / 1e9 for s in seconds]}
                log.info("%-18s %-10s %-20s %s GB/s", kind, layout, case,
                         " / ".join(f"{g:.1f}" for g in row["gb_per_s"]))
                rows.append(row)
        return rows
    finally:
        if registered:
            unpin(host)


def time_step(model: str, budget: str, rounds: int, steps: int, warmup: int = 2) -> dict:
    """Median step seconds of one compiled MemGraph per kind of pinned storage, kinds alternating."""
    workload = make_workload(model)
    batch = workload.batch_on("cuda")
    optimizer = workload.optimizer(trainable(workload.model))
    mg = memgraph.compile(workload.model, workload.loss_fn, batch, optimizer=optimizer, budget=int(budget) if budget.isdigit() else budget,
                          device="cuda")
    times: dict[str, list[float]] = {"register-hugepage": [], "register": []}
    for _ in range(rounds):
        for kind in times:
            mg.release(keep=False)
            mg.runtime = CudaRuntime(mg, huge_pages=kind == "register-hugepage")
            times[kind] += device_timed_steps(lambda: engine.run(mg, batch), steps, warmup)
            log.info("%s %s: %s ms", model, kind, " ".join(f"{t * 1e3:.1f}" for t in times[kind][-steps:]))
    mg.release(keep=False)
    return {"model": model, "budget": budget, "gpu_budget": mg.plan.gpu_budget, "pinned_bytes": mg.cpu_bytes,
            "rounds": rounds, "steps_per_round": steps, "steps_s": times,
            "median_s": {kind: statistics.median(ts) for kind, ts in times.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m turnip.bench.pinned_memory", description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=8.0, help="pinned buffer size, GiB")
    ap.add_argument("--chunk-mib", type=int, default=64, help="bytes per copy, MiB")
    ap.add_argument("--copies", type=int, default=48, help="copies per timed batch")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--step", default=None, help="also time this bench model's step (gpt350m, gpt1.3b, ...)")
    ap.add_argument("--budget", default="0.25", help="compile's budget for --step")
    ap.add_argument("--rounds", type=int, default=2, help="--step: rounds of the two kinds, alternating")
    ap.add_argument("--steps", type=int, default=5, help="--step: timed steps per kind and round")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("pinned_memory needs a CUDA device")
    nbytes, chunk = int(args.gib * (1 << 30)), args.chunk_mib << 20
    rows = [row for kind in args.kinds.split(",") for row in measure(kind, nbytes, chunk, args.copies)]
    out = {**run_metadata(), "transparent_hugepage": THP.read_text().strip() if THP.exists() else None,
           "rows": rows}
    if args.step:
        out["step"] = time_step(args.step, args.budget, args.rounds, args.steps)
        log.info("step medians: %s", {k: f"{v * 1e3:.1f} ms" for k, v in out["step"]["median_s"].items()})
    write_result("pinned_memory.json", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
