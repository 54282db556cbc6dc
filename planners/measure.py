"""Measure one vertex, or the host<->device link, on a real device.

Used by CostModel only for signatures its cache cannot answer. On CUDA, times come from CUDA
events (median of several runs after warm-up) and workspace from the caching allocator's peak;
on other devices (tests, the CPU backend) from the wall clock, with no workspace.
"""

from __future__ import annotations

import logging
import platform
import statistics
import threading
import time

import torch

from ..ir.taskgraph import TaskGraph, TensorRef, Vertex
from ..kernels.capture import captured
from ..kernels.launch import PreparedVertex
from ..kernels.threads import host_threads, kernel_threads
from ..kernels.views import ref_view

log = logging.getLogger(__name__)


def device_name(device: str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev.index if dev.index is not None else torch.cuda.current_device())
    return f"{dev.type}-{platform.machine()}-{platform.processor() or 'unknown'}"


class _Scalars(dict):
    """Optimizer scalars for timing: any name resolves (the kernel is the same for every value)."""

    def __missing__(self, key):
        return 0.5


def _fill(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return t.normal_()
    return t.zero_()  # indices and targets: 0 is valid for embeddings, gathers and losses


def _inputs(tg: TaskGraph, vertex: Vertex, dev: torch.device) -> dict[int, torch.Tensor]:
    env = {}
    for vid in vertex.inputs():
        val = tg.values[vid]
        env[vid] = _fill(torch.empty_strided(val.shape, val.stride, dtype=val.dtype, device=dev))
    return env


def _outputs(tg: TaskGraph, vertex: Vertex, dev: torch.device) -> list[torch.Tensor | None]:
    outs = []
    for vid in vertex.outputs:
        if vid < 0:
            outs.append(None)
            continue
        val = tg.values[vid]
        outs.append(torch.empty_strided(val.shape, val.stride, dtype=val.dtype, device=dev))
    return outs


def prepare_for_timing(tg: TaskGraph, vertex: Vertex, dev: torch.device) -> PreparedVertex:
    """`vertex` bound to fresh inputs and outputs on `dev`, as the engine binds it to arena places.
    An in-place version takes its old version's place (the builder puts it there: buffer donation,
    the optimizer's updates in their homes), so it is bound over one buffer: the kernel is timed
    as the engine runs it, not after a copy of the old version into a separate output."""
    env = _inputs(tg, vertex, dev)
    outs = _outputs(tg, vertex, dev)
    own = {vid: i for i, vid in enumerate(vertex.outputs) if vid >= 0}
    for old, new in vertex.copy_in:
        if env[old].shape == outs[own[new]].shape and env[old].stride() == outs[own[new]].stride():
            outs[own[new]] = env[old]

    def resolve(ref: TensorRef) -> torch.Tensor:
        return ref_view(env[ref.value], ref)

    return PreparedVertex(vertex, resolve, outs)


def measure_vertex(tg: TaskGraph, vertex: Vertex, device: str, runs: int = 7, warmup: int = 2) -> tuple[float, int]:
    """(median seconds, workspace bytes) of running `vertex` the way the engine does: bound once
    to preallocated inputs and outputs (prepare_for_timing; PreparedVertex: the out= overload
    where the op has one), so the workspace is what the op allocates beyond its outputs."""
    dev = torch.device(device)
    prepared = prepare_for_timing(tg, vertex, dev)
    scalars = _Scalars(tg.optimizer.scalars(1) if tg.optimizer is not None else {})

    def once():
        prepared(scalars, None, dev)

    for _ in range(warmup):
        once()
    if dev.type == "cuda":
        return _time_cuda(once, runs, dev)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        once()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), 0


BACK_TO_BACK = 8  # launches per timing sample


def _time_cuda(once, runs: int, dev: torch.device) -> tuple[float, int]:
    """Median seconds per launch over samples of BACK_TO_BACK launches replayed as one CUDA graph,
    as the engine replays a segment (memgraph/segments.py): the GPU's own time for the op,
    with no host launch cost in it (the simulator charges that per launched unit); and the
    bytes allocated beyond the inputs and outputs (the op's real workspace). An op that cannot
    be captured is timed as BACK_TO_BACK ordinary launches in a row, as the engine runs it."""
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    once()
    torch.cuda.synchronize(dev)
    workspace = max(0, torch.cuda.max_memory_allocated(dev) - base)

    def launches():
        for _ in range(BACK_TO_BACK):
            once()

    run, graph = launches, _captured(launches, dev)
    if graph is not None:
        run = graph.replay
    samples = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / BACK_TO_BACK)
    return statistics.median(samples), workspace


def _captured(launches, dev: torch.device) -> torch.cuda.CUDAGraph | None:
    stream = torch.cuda.Stream(device=dev)  # capture never runs on the legacy default stream
    stream.wait_stream(torch.cuda.current_stream(dev))
    try:
        with torch.cuda.stream(stream):
            graph = captured(launches)
    except Exception as exc:  # noqa: BLE001 - an op that cannot be captured is timed as launched
        log.debug("op not capturable for timing (%s); timing plain launches", exc)
        return None
    torch.cuda.current_stream(dev).wait_stream(stream)
    return graph


def measure_stream_reserve(device: str) -> int:
    """Bytes that stay allocated after the first matmuls on a new stream (library workspaces kept
    per stream): the engine runs on streams of its own, so its step pays this once more."""
    dev = torch.device(device)
    a16, b16 = torch.randn(512, 512, device=dev, dtype=torch.bfloat16), torch.randn(512, 512, device=dev,
                                                                                    dtype=torch.bfloat16)
    bias16 = torch.randn(512, device=dev, dtype=torch.bfloat16)
    a32, b32, bias32 = a16.float(), b16.float(), bias16.float()
    out16, out32 = torch.empty_like(a16), torch.empty_like(a32)
    q = torch.randn(1, 2, 128, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    stream = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(stream):
        torch.mm(a16, b16, out=out16)
        torch.addmm(bias16, a16, b16, out=out16)  # a bias vector takes the cuBLASLt path
        torch.mm(a32, b32, out=out32)
        torch.addmm(bias32, a32, b32, out=out32)
        # attention kernels (cuDNN, flash) keep small per-stream buffers too
        attended = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        grad, = torch.autograd.grad(attended.sum(), q)
        del attended, grad
    stream.synchronize()
    reserve = max(0, torch.cuda.memory_allocated(dev) - before)
    del stream
    torch._C._cuda_clearCublasWorkspaces()  # the measuring stream's workspace must not stay allocated
    log.info("a new stream keeps %d bytes of library workspace on %s", reserve, device_name(device))
    return reserve


def link_capacity(samples) -> float:
    """What a link can move, from timed copies over it: the fastest sample. Anything else on the
    host (another process copying, a page fault, the clock) only slows a sample down, and the rate
    is cached per machine (planners/costs.py) for every later compile, so a median can keep a bad
    moment: two processes minutes apart on one 2-GPU H200 host measured the median h2d at 46.9 and
    55.0 GB/s and both ways at 74.9 and 100.6; with the low rates cached, compile simulated the
    casts layout of gpt1.3b at 50% at 214 ms and kept replicas (219.9 ms measured), where the casts
    ran 184.9 (bench/results/2026-11-28_h200x2_weight-layouts.md)."""
    return max(samples)


def measure_bandwidth(device: str, nbytes: int = 64 << 20, runs: int = 7) -> dict[str, float]:
    """Bytes/s host->device and device->host between pinned host memory and the device
    (link_capacity of ``runs`` copies each way)."""
    dev = torch.device(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out = {}
    for direction, (dst, src) in (("h2d", (gpu, host)), ("d2h", (host, gpu))):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize(dev)
        samples = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            samples.append(nbytes / (start.elapsed_time(end) / 1e3))
        out[direction] = link_capacity(samples)
    log.info("link bandwidth on %s: h2d %.1f GB/s, d2h %.1f GB/s", device_name(device),
             out["h2d"] / 1e9, out["d2h"] / 1e9)
    return out


def measure_d2d(source: str, target: str, nbytes: int = 256 << 20, runs: int = 5) -> float:
    """Bytes/s of a copy from one GPU's memory to another's (NVLink or PCIe peer to peer;
    link_capacity of ``runs`` copies)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=torch.device(source))
    dst = torch.empty(nbytes, dtype=torch.uint8, device=torch.device(target))
    dst.copy_(src)  # warm-up, and peer access enabled
    torch.cuda.synchronize(src.device)
    torch.cuda.synchronize(dst.device)
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(src.device)
        torch.cuda.synchronize(dst.device)
        samples.append(nbytes / (time.perf_counter() - started))
    rate = link_capacity(samples)
    log.info("device-to-device bandwidth %s -> %s: %.1f GB/s", source, target, rate / 1e9)
    return rate


def both_ways_rate(ends: list[list[float]], nbytes: int) -> float:
    """Bytes/s moved while every direction was busy, from each direction's copy end times (seconds
    from their common start, one per ``nbytes`` copy, in order): the copies every direction had
    finished by the time the first ran out of copies, over that time. A copy still running then is
    left out (with 16 copies a direction, at most a sixteenth too low), since when it began is not
    known. The time the last direction takes alone after that is not the link moving both ways, and
    counting it made the rate depend on how the copy engines shared the link between the directions."""
    first = min(times[-1] for times in ends)
    done = sum(1 for times in ends for end in times if end <= first)
    return done * nbytes / first


def measure_duplex(device: str, nbytes: int = 64 << 20, copies: int = 16, runs: int = 3) -> float:
    """Bytes/s the link moves in all with pinned copies running each way at once (two streams,
    ``copies`` of ``nbytes`` each way, so the two directions overlap for nearly all of it: with one
    64 MiB copy each way the H100 measured 71 GB/s, with 48 each way 99 GB/s, bench/pinned_memory.py):
    less than the two directions' own rates added (89.4 GB/s on the H100 against 55 each way alone).
    Each run's rate is both_ways_rate of its copies' end times: on one H200, a compile that timed the
    runs to their last copy measured 74.7 GB/s where others measured 100, and its simulated steps at
    25% and 10% of eager's memory came out 12-13% slower than they ran
    (bench/results/2026-11-29_h200_same-call-rows.md). Whether a direction left to finish alone made
    that rate low is not yet known: the log gives each run's rate and when each direction was done."""
    dev = torch.device(device)
    host_in, host_out = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    gpu_in, gpu_out = (torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2))
    streams = [torch.cuda.Stream(dev) for _ in range(2)]
    samples, finished = [], []
    for k in range(runs + 1):  # the first is a warm-up
        torch.cuda.synchronize(dev)
        start = torch.cuda.Event(enable_timing=True)
        ends = [[torch.cuda.Event(enable_timing=True) for _ in range(copies)] for _ in streams]
        start.record()
        for stream, stream_ends, (dst, src) in zip(streams, ends, ((gpu_in, host_in), (host_out, gpu_out)),
                                                   strict=True):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                for end in stream_ends:
                    dst.copy_(src, non_blocking=True)
                    end.record()
        torch.cuda.synchronize(dev)
        if k:
            seconds = [[start.elapsed_time(end) / 1e3 for end in stream_ends] for stream_ends in ends]
            samples.append(both_ways_rate(seconds, nbytes))
            finished.append("/".join(f"{times[-1] * 1e3:.1f}" for times in seconds))
    rate = link_capacity(samples)
    log.info("link bandwidth on %s, both ways at once: %.1f GB/s in all (runs %s GB/s; host-to-device / "
             "device-to-host copies done at %s ms)", device_name(device), rate / 1e9,
             ", ".join(f"{x / 1e9:.1f}" for x in samples), ", ".join(finished))
    return rate


def measure_host_links(devices: list[str], nbytes: int = 64 << 20, copies: int = 8, runs: int = 3) -> dict[str, float]:
    """Bytes/s the host moves over the links of ``devices`` together, pinned copies running on every
    device at once: host to devices, devices to host, and both directions at once ("h2d", "d2h",
    "both"). Past two GPUs the host, not each PCIe link, is the limit (bench/pinned_memory.py: four
    H100s moved 164, 128 and 190 GB/s; two 84, 108 and 162)."""
    import itertools

    devs = [torch.device(d) for d in devices]
    ways = {"h2d": ("h2d",), "d2h": ("d2h",), "both": ("h2d", "d2h")}
    buffers = {(dev, way): (torch.empty(nbytes, dtype=torch.uint8, device=dev),
                            torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
               for dev, way in itertools.product(devs, ("h2d", "d2h"))}
    streams = {key: torch.cuda.Stream(key[0]) for key in buffers}

    def copy_all(directions: tuple[str, ...]) -> float:
        for dev in devs:
            torch.cuda.synchronize(dev)
        started = time.perf_counter()
        for dev, way in itertools.product(devs, directions):
            gpu, host = buffers[dev, way]
            dst, src = (gpu, host) if way == "h2d" else (host, gpu)
            with torch.cuda.stream(streams[dev, way]):
                for _ in range(copies):
                    dst.copy_(src, non_blocking=True)
        for dev in devs:
            torch.cuda.synchronize(dev)
        return len(devs) * len(directions) * copies * nbytes / (time.perf_counter() - started)

    out = {}
    for name, directions in ways.items():
        copy_all(directions)  # warm-up
        out[name] = link_capacity(copy_all(directions) for _ in range(runs))
    log.info("the host's links to %d devices together: h2d %.1f GB/s, d2h %.1f GB/s, both ways %.1f GB/s",
             len(devs), out["h2d"] / 1e9, out["d2h"] / 1e9, out["both"] / 1e9)
    return out


def measure_host_update(device: str | None = None, elements: int = 1 << 26, runs: int = 3) -> float:
    """Parameters per second of a CPU AdamW step (torch's CPU _fused_adamw_) as the engine's host lane
    runs it (plan.host_update): on one intra-op thread fewer than torch's (kernels/threads.py) and,
    given a CUDA ``device``, while pinned copies run both ways, since the step's transfers share the
    host's memory bandwidth with the update (on the H100 machine the rate alone measured 4.44 G/s,
    and updates inside a step ran at about 2.4). Median of ``runs``, after one untimed step that
    faults the pages in."""
    param, grad = torch.zeros(elements), torch.full((elements,), 1e-3)
    exp_avg, exp_avg_sq, step = torch.zeros(elements), torch.zeros(elements), torch.tensor(1.0)

    def update() -> float:
        started = time.perf_counter()
        torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
        return time.perf_counter() - started

    threads = host_threads()
    beside = device is not None and str(device).startswith("cuda")
    samples: list[float] = []

    before = torch.get_num_threads()

    def measure() -> None:  # on a thread of its own, like the host lane, whose thread count it takes
        with kernel_threads(threads, before):
            update()
            samples.extend(_beside_copies(torch.device(device), update, runs) if beside else
                           (update() for _ in range(runs)))

    worker = threading.Thread(target=measure, name="turnip-measure-host")
    worker.start()
    worker.join()
    rate = elements / statistics.median(samples)
    log.info("CPU AdamW step: %.2f G parameters/s on %d threads%s", rate / 1e9, threads,
             " beside pinned copies both ways" if beside else "")
    return rate


def _beside_copies(dev: torch.device, update, runs: int, nbytes: int = 256 << 20) -> list[float]:
    """Time ``update`` while the device copies pinned host memory in and out on two streams."""
    host_in, host_out = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    gpu_in, gpu_out = (torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2))
    h2d, d2h = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    samples = []
    for _ in range(runs):
        for _ in range(16):  # about 75 ms each way at 55 GB/s: longer than one update
            with torch.cuda.stream(h2d):
                gpu_in.copy_(host_in, non_blocking=True)
            with torch.cuda.stream(d2h):
                host_out.copy_(gpu_out, non_blocking=True)
        samples.append(update())
        torch.cuda.synchronize(dev)
    return samples
