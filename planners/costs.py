"""Cost model: how long each TaskGraph vertex takes, how much scratch memory it needs, and how
fast bytes cross the host<->device link.

Two sources, one interface:
- measured on the target device (``measure=True``, CUDA events, median of several runs; see
  measure.py), each distinct op signature once, answers cached on disk keyed by device name,
  torch version and signature, so a second compile of the same model measures nothing;
- analytic (FLOPs and bytes over the device's rates), for the CPU backend and for planning a
  device you are not on. Defaults describe an H100/H200-class GPU.

``CostModel.annotate(tg)`` fills ``vertex.time`` and ``vertex.workspace``; planners read those,
the two bandwidths and the host seconds the engine spends per vertex it launches
(``CostModel.host_per_vertex_on(device)``), a third resource beside the GPU and the link.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..ir.costs import HostLinks
from ..ir.sizes import ALLOCATOR_SLACK
from ..ir.taskgraph import MESSAGE_OPS, RECV, ScalarRef, TaskGraph, TensorRef, Vertex
from ..kernels.launch import writes_in_place
from ..kernels.ops import resolve_op
from . import measure

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # 2: workspace and time measured through PreparedVertex, back to back


@dataclass(frozen=True)
class DeviceSpec:
    """Rates of a device for the analytic model (per second)."""

    name: str = "h100-class (assumed)"
    # Dense matmul throughput by dtype name. fp32 is without TF32: PyTorch's default keeps
    # TF32 off for matmuls, and results must match eager.
    flops: dict = field(default_factory=lambda: {
        "bfloat16": 700e12, "float16": 700e12, "float32": 50e12, "float64": 25e12,
        "float8_e4m3fn": 1400e12, "float8_e5m2": 1400e12,
    })
    default_flops: float = 50e12  # dtypes not in the table (integers, synthetic graphs)
    mem_bw: float = 3e12  # HBM bytes/s
    d2d: float = 300e9  # bytes/s from one device's memory to another's (NVLink; 394 measured on H100 NV18 pairs)
    # bytes/s of a message between ranks (trace/ranks.py): another host's, through a 200 Gb/s NIC per GPU;
    # compile's rank_bandwidth= gives the figure of the machines at hand
    rank_link: float = 25e9
    # share of a GPU's compute speed left while one of its rank's messages is on it (NCCL's kernel, moving
    # bytes or spinning for its peer, holds SMs and HBM): two ranks of one H200 each, gpt1.3b at 100%,
    # computed 167.0 and 162.4 ms a step with messages on them 126 and 91 ms, against 155.4 in one process
    # (bench/results/h200x2/s9/call2_*ranks*timeline*): about 8% slower while a message is on
    compute_beside_messages: float = 0.92
    # what the host moves over every device's link together (ir.costs.HostLinks): a CostModel of a
    # step over several CUDA devices measures it; the analytic default caps nothing
    host_links: HostLinks = field(default_factory=HostLinks)
    h2d: float = 50e9  # pinned host -> device bytes/s
    d2h: float = 50e9  # device -> pinned host bytes/s
    # bytes/s in all with both directions copying at once; None: each direction at its own rate
    duplex: float | None = None
    launch: float = 5e-6  # floor per op on the device: launch latency
    # Host seconds the engine's Python event loop spends per MemGraph vertex it launches
    # (compute, offload, reload, ...). Host and device run concurrently, so this is a resource of
    # its own rather than part of an op's time: a run of tiny ops is bound by it, which op times
    # alone never show. Measured on an H100 (bench/engine_overhead.py): about 15 us per vertex,
    # against about 6 us for an eager PyTorch launch of the same kernel.
    host_per_vertex: float = 15e-6
    # Parameters per second a CPU optimizer step (torch's CPU _fused_adamw_) updates inside a step:
    # the rate of the host lane that runs plan.host_update. The H100 machine's 16 cores did 4.44e9
    # alone and about 2.4e9 inside a step, beside the copies; a CUDA cost model that measures
    # replaces it with this host's own figure (planners/measure.py measure_host_update).
    host_update_rate: float = 2.4e9

    def rate(self, dtype: Any) -> float:
        return self.flops.get(dtype_name(dtype), self.default_flops)


H100 = DeviceSpec()
# A rough CPU spec, only used when a user asks to plan for the host itself.
# The CPU backend runs ops on worker threads, so its host time is already inside the op times.
CPU = DeviceSpec(name="cpu (assumed)", flops={"float32": 1e12, "bfloat16": 1e12, "float64": 0.5e12},
                 default_flops=0.5e12, mem_bw=100e9, h2d=20e9, d2h=20e9, launch=10e-6, host_per_vertex=0.0)


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def itemsize(dtype: Any) -> int:
    name = dtype_name(dtype)
    match = re.search(r"(\d+)", name)
    if name == "bool":
        return 1
    if name.startswith("complex") and match:
        return int(match.group(1)) // 8
    return max(1, int(match.group(1)) // 8) if match else 4


def _numel(size) -> int:
    return math.prod(size) if size else 1


# -- analytic model ---------------------------------------------------------------------------

def _tensor_args(vertex: Vertex) -> list[TensorRef]:
    return [a for a in vertex.args if isinstance(a, TensorRef)]


def _dims(ref: TensorRef) -> tuple[int, ...]:
    return tuple(ref.size)


def matmul_flops(tg: TaskGraph, vertex: Vertex) -> float | None:
    """FLOPs of the compute-bound ops; None for ops that are bound by memory traffic."""
    base = vertex.op.removeprefix("aten::").split(".")[0]
    t = _tensor_args(vertex)
    try:
        if base == "mm" and len(t) >= 2:
            (m, k), (_, n) = _dims(t[0]), _dims(t[1])
            return 2.0 * m * n * k
        if base == "addmm" and len(t) >= 3:
            (m, k), (_, n) = _dims(t[1]), _dims(t[2])
            return 2.0 * m * n * k + m * n
        if base in ("bmm", "baddbmm") and len(t) >= 2:
            a, b = (t[1], t[2]) if base == "baddbmm" else (t[0], t[1])
            (bs, m, k), (_, _, n) = _dims(a), _dims(b)
            return 2.0 * bs * m * n * k
        if base.startswith(("_scaled_dot_product", "_flash_attention", "_efficient_attention")):
            return _attention_flops(vertex, t, backward=base.endswith("backward"))
        if base in ("convolution", "_convolution", "cudnn_convolution") and vertex.outputs[0] >= 0:
            w = _dims(t[1])  # (C_out, C_in/groups, *kernel): each output element costs 2*prod(w[1:])
            return 2.0 * math.prod(w[1:]) * _numel(tg.values[vertex.outputs[0]].shape)
        if base == "convolution_backward":  # (grad_out, input, weight, ...): input grad + weight grad
            return 4.0 * math.prod(_dims(t[2])[1:]) * _numel(_dims(t[0]))
    except (ValueError, IndexError):
        return None  # unexpected argument layout: fall back to the bytes-bound estimate
    return None


def _attention_flops(vertex: Vertex, t: list[TensorRef], backward: bool) -> float:
    # forward args start (q, k, v); backward args start (grad_out, q, k, v)
    q, k = (t[1], t[2]) if backward else (t[0], t[1])
    *batch, lq, e = _dims(q)
    lk = _dims(k)[-2]
    flops = 4.0 * _numel(batch) * lq * lk * e  # QK^T and PV
    if _arg(vertex, "is_causal"):
        flops *= 0.5
    return flops * (2.5 if backward else 1.0)  # backward: recompute P, then dQ, dK, dV, dP


def _arg(vertex: Vertex, name: str) -> Any:
    """A named argument of an ATen op, looked up in its schema (positions differ per overload)."""
    if name in vertex.kwargs:
        return vertex.kwargs[name]
    try:
        names = [a.name for a in resolve_op(vertex.op)._schema.arguments]
    except (ValueError, AttributeError, ImportError):
        return None
    i = names.index(name) if name in names else -1
    return vertex.args[i] if 0 <= i < len(vertex.args) else None


def analytic_time(tg: TaskGraph, vertex: Vertex, spec: DeviceSpec) -> float:
    """Roofline estimate: max(FLOPs / matmul rate, bytes / HBM bandwidth) plus a launch floor."""
    read, dtype = 0, None
    own = set(vertex.outputs)
    for ref in vertex.refs():
        if ref.value in own:
            continue
        val = tg.values[ref.value]
        if val.dtype is not None and dtype_name(val.dtype).startswith(("float", "bfloat", "complex")):
            dtype = dtype or val.dtype
        # a broadcast view reads no more than its value's storage
        read += min(_numel(ref.size) * itemsize(val.dtype), val.nbytes)
    for old, _new in vertex.copy_in:
        read += tg.values[old].nbytes
    written = sum(tg.values[o].nbytes for o in vertex.outputs if o >= 0)
    flops = matmul_flops(tg, vertex)
    compute = flops / spec.rate(dtype) if flops else 0.0
    return max(compute, (read + written) / spec.mem_bw) + spec.launch


def analytic_workspace(tg: TaskGraph, vertex: Vertex) -> int:
    """Temporary bytes beyond the outputs. Ops with an out= overload write straight into their
    places; the others (fused attention and its backward) compute, then copy, so their own
    result is scratch memory while they run."""
    if writes_in_place(vertex):
        return 0
    return sum(tg.values[o].nbytes for o in vertex.outputs if o >= 0)


# -- signatures and the disk cache ------------------------------------------------------------

def _normalize(template: Any, tg: TaskGraph, own: dict[int, int]) -> Any:
    if isinstance(template, TensorRef):
        val = tg.values[template.value]
        tag = f"out{own[template.value]}" if template.value in own else "in"
        return ("T", tag, tuple(template.size), tuple(template.stride), template.storage_offset,
                dtype_name(val.dtype), tuple(val.shape), tuple(val.stride))
    if isinstance(template, ScalarRef):
        return ("S",)  # the value changes per step; the kernel does not
    if isinstance(template, (list, tuple)):
        return (type(template).__name__, tuple(_normalize(t, tg, own) for t in template))
    if isinstance(template, dict):
        return ("dict", tuple(sorted((k, _normalize(v, tg, own)) for k, v in template.items())))
    return ("C", repr(template))


def signature(tg: TaskGraph, vertex: Vertex) -> str:
    """Identical ops on identical shapes/strides/dtypes (e.g. the same layer repeated) share one."""
    own = {vid: i for i, vid in enumerate(vertex.outputs) if vid >= 0}
    outs = tuple((tuple(tg.values[o].shape), tuple(tg.values[o].stride), dtype_name(tg.values[o].dtype))
                 if o >= 0 else None for o in vertex.outputs)
    # "over old": in-place versions are timed over their old version's buffer (measure.py), a
    # marker so costs cached before, timed after a copy into a separate output, are measured again
    key = repr((vertex.op, _normalize(vertex.args, tg, own), _normalize(vertex.kwargs, tg, own), outs,
                tuple(own.get(n, -1) for _, n in vertex.copy_in)) + (("over old",) if vertex.copy_in else ()))
    return hashlib.sha1(key.encode()).hexdigest()


def default_cache_dir() -> Path:
    env = os.environ.get("TURNIP_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "turnip"


class CostCache:
    """JSON file of measured op costs and link bandwidths for one (device, torch version)."""

    def __init__(self, cache_dir: str | Path, device_name: str, torch_version: str):
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{device_name}-torch{torch_version}")
        self.path = Path(cache_dir) / f"costs-{slug}.json"
        self.device_name, self.torch_version = device_name, torch_version
        self.ops: dict[str, dict] = {}
        self.bandwidth: dict[str, float] = {}
        self._load()

    def _load(self) -> None:
        try:
            blob = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if blob.get("version") != CACHE_VERSION or blob.get("device") != self.device_name \
                or blob.get("torch") != self.torch_version:
            log.info("ignoring cost cache %s (other device, torch or format)", self.path)
            return
        self.ops = dict(blob.get("ops", {}))
        self.bandwidth = dict(blob.get("bandwidth", {}))

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        blob = {"version": CACHE_VERSION, "device": self.device_name, "torch": self.torch_version,
                "ops": self.ops, "bandwidth": self.bandwidth}
        # write-then-rename so a concurrent compile never reads half a file
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".costs-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(blob, f, indent=0, sort_keys=True)
        os.replace(tmp, self.path)


# -- the cost model -----------------------------------------------------------------------------

class CostModel:
    """Per-vertex time and workspace plus link bandwidths, measured (cached) or analytic.

    measure: None = measure when the target device is CUDA and present, else analytic.
    host_per_vertex: host seconds the engine spends per launched MemGraph vertex; None = the
    spec's figure on CUDA, 0 on the CPU backend (see host_per_vertex_on).
    devices: how many devices the step runs on (compile's ``devices``); the host's links are
    measured over that many (``host_links``).
    """

    def __init__(self, device: str | None = None, spec: DeviceSpec | None = None, measure: bool | None = None,
                 cache_dir: str | Path | None = None, runs: int = 7, warmup: int = 2,
                 host_per_vertex: float | None = None, devices: int = 1, rank_bandwidth: float | None = None):
        import torch

        if host_per_vertex is not None and not (host_per_vertex >= 0 and math.isfinite(host_per_vertex)):
            raise ValueError(f"host_per_vertex must be a finite number of seconds >= 0, not {host_per_vertex!r}")

        self.device = str(device) if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        is_cuda = self.device.startswith("cuda")
        self.measure = (is_cuda and torch.cuda.is_available()) if measure is None else measure
        self.spec = spec or H100
        self.runs, self.warmup = runs, warmup
        self.host_override = None if host_per_vertex is None else float(host_per_vertex)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._cache: CostCache | None = None
        self.measured = 0  # ops measured by this model (tests check the cache answers instead)
        self.cache_hits = 0
        self._reserve: int | None = None
        self.devices = devices  # the step's device count: host_links is measured over that many links
        if rank_bandwidth is not None and not (rank_bandwidth > 0 and math.isfinite(rank_bandwidth)):
            raise ValueError(f"rank_bandwidth must be a finite number of bytes/s > 0, not {rank_bandwidth!r}")
        self.rank_bandwidth = float(rank_bandwidth) if rank_bandwidth is not None else self.spec.rank_link

    # the cache is opened lazily: an analytic model never touches the disk
    @property
    def cache(self) -> CostCache:
        if self._cache is None:
            import torch

            self._cache = CostCache(self.cache_dir, measure.device_name(self.device), torch.__version__)
        return self._cache

    @property
    def runtime_reserve(self) -> int:
        """Bytes the engine's compute stream keeps beside arena and op workspace: the cuBLAS and
        cuBLASLt workspaces a new stream gets on its first matmul (measured), and the caching
        allocator's slack (``ir.sizes.ALLOCATOR_SLACK``: the segments it reserves beyond what it hands
        out, the step's own small blocks among them); 0 off CUDA. Without the small blocks the peaks
        on the H100 were over their budgets by 2,560 bytes to 1.5 MB (prefill_s11.json,
        suite_gpt1.3b_s9.json); without the segments' rounding, reserved by 43 MiB on two H200s."""
        if not self._measures_device:
            return 0
        if self._reserve is None:
            self._reserve = measure.measure_stream_reserve(self.device)
        return self._reserve + ALLOCATOR_SLACK

    @property
    def h2d_bandwidth(self) -> float:
        return self._bandwidth("h2d")

    @property
    def d2h_bandwidth(self) -> float:
        return self._bandwidth("d2h")

    @property
    def duplex_bandwidth(self) -> float:
        """Bytes/s the link moves in all when both directions copy at once (measured on CUDA, else
        the spec's; at most the two directions' rates added)."""
        both = self.h2d_bandwidth + self.d2h_bandwidth
        if not self._measures_device:
            return min(self.spec.duplex or both, both)
        return min(self._cached_rate("duplex", lambda: {"duplex": measure.measure_duplex(self.device)}), both)

    def _bandwidth(self, direction: str) -> float:
        if not self._measures_device:
            return getattr(self.spec, direction)
        return self._cached_rate(direction, lambda: measure.measure_bandwidth(self.device))

    @property
    def _measures_device(self) -> bool:
        """Rates and reserves come from measurements on this CUDA device (else from the spec)."""
        return self.measure and self.device.startswith("cuda")

    def _cached_rate(self, key: str, measured: Callable[[], dict[str, float]]) -> float:
        """The rate cached under ``key`` beside the link bandwidths, measured (and the cache saved)
        the first time it is asked for; ``measured`` returns the rates it measured by key."""
        cache = self.cache
        if key not in cache.bandwidth:
            cache.bandwidth.update(measured())
            cache.save()
        return cache.bandwidth[key]

    @property
    def host_links(self) -> HostLinks:
        """What the host moves over the step's device links together: measured (cached by device
        count) on CUDA for a step over several present devices, else the spec's."""
        if not self._measures_device or self.devices < 2 or torch.cuda.device_count() < self.first_gpu + self.devices:
            return self.spec.host_links
        keys = {way: f"host_{way}_x{self.devices}" for way in ("h2d", "d2h", "both")}

        def measured() -> dict[str, float]:  # all three at once: the first key caches the others too
            rates = measure.measure_host_links([f"cuda:{self.first_gpu + k}" for k in range(self.devices)])
            return {keys[way]: rate for way, rate in rates.items()}

        return HostLinks(**{way: self._cached_rate(key, measured) for way, key in keys.items()})

    @property
    def compute_beside_messages(self) -> float:
        """Share of a device's compute speed while a message between ranks is on it: the spec's on
        CUDA (NCCL's kernels); 1 on the CPU backend, whose gloo messages run on threads of their own."""
        return self.spec.compute_beside_messages if self.device.startswith("cuda") else 1.0

    @property
    def d2d_bandwidth(self) -> float:
        """Bytes/s of a copy from one GPU to another: measured between the step's first GPU and the
        next when there is one, else the spec's."""
        first = self.first_gpu
        if not self._measures_device or torch.cuda.device_count() < first + 2:
            return self.spec.d2d
        return self._cached_rate("d2d", lambda: {"d2d": measure.measure_d2d(f"cuda:{first}", f"cuda:{first + 1}")})

    @property
    def first_gpu(self) -> int:
        """The index of the step's first GPU (a rank's step may start past cuda:0)."""
        return torch.device(self.device).index or 0

    @property
    def hbm_bandwidth(self) -> float:
        """Device memory bytes/s (the spec's)."""
        return self.spec.mem_bw

    @property
    def host_per_vertex(self) -> float:
        """Host seconds per launched vertex when running on this model's own device."""
        return self.host_per_vertex_on(self.device)

    def host_per_vertex_on(self, device: str) -> float:
        """Host seconds per launched MemGraph vertex for a graph that runs on `device` (the
        engine backend decides, so planners pass the TaskGraph's device): the override when
        given, else the spec's figure for CUDA, else 0 (the CPU backend's ops run on worker
        threads, and their host time is already in the measured or estimated op times)."""
        if self.host_override is not None:
            return self.host_override
        return self.spec.host_per_vertex if str(device).startswith("cuda") else 0.0

    @property
    def host_update_rate(self) -> float:
        """Parameters per second the host's cores update in a CPU optimizer step while the step's
        copies run (measured on CUDA cost models that measure, cached with the link bandwidths;
        else the spec's figure)."""
        if not self._measures_device:
            return self.spec.host_update_rate
        key = "host_update_beside_copies"
        return self._cached_rate(key, lambda: {key: measure.measure_host_update(self.device)})

    def transfer_time(self, nbytes: int, direction: str) -> float:
        return nbytes / (self.h2d_bandwidth if direction == "h2d" else self.d2h_bandwidth)

    def estimate(self, tg: TaskGraph, vertex: Vertex) -> tuple[float, int]:
        """(seconds, workspace bytes) of one vertex from the analytic model; a message to or from
        another rank, its bytes over the link between ranks."""
        if vertex.op in MESSAGE_OPS:
            moved = tg.values[vertex.outputs[0] if vertex.op == RECV else vertex.args[0].value].nbytes
            return moved / self.rank_bandwidth + self.spec.launch, 0
        return analytic_time(tg, vertex, self.spec), analytic_workspace(tg, vertex)

    def annotate(self, tg: TaskGraph, overwrite: bool = False) -> TaskGraph:
        """Fill vertex.time and vertex.workspace. Vertices that already carry a time keep it
        unless overwrite (synthetic graphs set their own). Also sets the graph's runtime reserve."""
        tg.runtime_reserve = max(tg.runtime_reserve, self.runtime_reserve)
        todo = [v for v in tg.vertices if overwrite or v.time <= 0]
        for v in todo:
            if v.op in MESSAGE_OPS:  # priced, never run alone: it needs its peer
                v.time, v.workspace = self.estimate(tg, v)
        todo = [v for v in todo if v.op not in MESSAGE_OPS]
        if not todo:
            return tg
        if not self.measure:
            for v in todo:
                v.time, ws = self.estimate(tg, v)
                v.workspace = max(v.workspace, ws) if not overwrite else ws
            return tg
        self._annotate_measured(tg, todo)
        return tg

    def _annotate_measured(self, tg: TaskGraph, todo: list[Vertex]) -> None:
        cache = self.cache
        sigs = {v.id: signature(tg, v) for v in todo}
        missing: dict[str, Vertex] = {}
        for v in todo:
            if sigs[v.id] not in cache.ops:
                missing.setdefault(sigs[v.id], v)
        self.cache_hits += len(todo) - sum(1 for v in todo if sigs[v.id] in missing)
        if missing:
            log.info("measuring %d distinct ops on %s (%d vertices, %d answered by the cache)",
                     len(missing), self.device, len(todo), self.cache_hits)
        for sig, v in missing.items():
            try:
                seconds, workspace = measure.measure_vertex(tg, v, self.device, runs=self.runs, warmup=self.warmup)
            except Exception as err:  # noqa: BLE001 - any op that cannot run standalone: estimate, do not cache
                log.warning("cannot measure %s (%s); using the analytic estimate", v.op, err)
                seconds, workspace = self.estimate(tg, v)
                for u in todo:
                    if sigs[u.id] == sig:
                        u.time, u.workspace = seconds, workspace
                continue
            self.measured += 1
            cache.ops[sig] = {"time": seconds, "workspace": int(workspace), "op": v.op}
        if missing:
            cache.save()
        for v in todo:
            entry = cache.ops.get(sigs[v.id])
            if entry is not None:
                v.time, v.workspace = float(entry["time"]), int(entry["workspace"])


def default_costs(tg: TaskGraph, rank_bandwidth: float | None = None) -> CostModel:
    """Measured on the graph's device when it is a present CUDA device, analytic otherwise;
    ``rank_bandwidth``: bytes/s of a message between ranks (default: the spec's)."""
    return CostModel(device=tg.device, devices=tg.devices, rank_bandwidth=rank_bandwidth)
