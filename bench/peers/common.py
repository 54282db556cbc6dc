"""What every system in the benchmark shares: the workload, the result record, timing, memory, OOM.

A *workload* is one model + loss + batch + optimizer, built so that every
system starts from the same weights (a canonical CPU model, copied to the
device per system). A *peer* is a function ``run(workload, steps, ...) ->
PeerResult``: it builds its own copy of the model, runs ``warmup + steps``
training steps, and reports step times, losses, peak GPU memory and bytes
moved, or the OOM / error that stopped it. Results are plain dataclasses so
they go straight into the suite's JSON.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import importlib.util
import logging
import math
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ... import engine

log = logging.getLogger(__name__)

OK, OOM, INFEASIBLE, ERROR, TIMEOUT, NOT_INSTALLED, SKIPPED = (
    "ok", "oom", "infeasible", "error", "timeout", "not installed", "skipped")
# what a row computes: eager's math (fp32 weights, the workload's optimizer and options, no clipping; bf16 only
# where the loss's autocast puts it), or bf16 weights (fp32 master weights in the optimizer: trades precision)
EAGER_MATH, BF16_WEIGHTS = "eager", "bf16 weights"


@dataclass
class OptimizerSpec:
    """An optimizer factory that also says its class and options (DeepSpeed / torchao need them apart)."""

    cls: type = torch.optim.AdamW
    kwargs: dict = field(default_factory=lambda: {"lr": 1e-4})

    def options(self, fused: bool = False) -> dict:
        """Its options, with the optimizer's fused kernel where asked (``fused=True``: the fastest CUDA AdamW)."""
        return {**self.kwargs, "fused": True} if fused else dict(self.kwargs)

    def __call__(self, params, fused: bool = False) -> torch.optim.Optimizer:
        return self.cls(params, **self.options(fused))

    @property
    def name(self) -> str:
        return self.cls.__name__

    def hyperparameters(self) -> dict:
        """Every option the optimizer runs with, its defaults included (lr, betas, eps, weight_decay, ...):
        what a peer with its own implementation (DeepSpeed's CPU Adam) must be given to do the same update."""
        probe = torch.zeros(1, requires_grad=True)
        return dict(self.cls([probe], **self.kwargs).defaults)


@dataclass
class Workload:
    name: str
    model: nn.Module  # canonical weights, on the CPU: every system starts from a copy of these
    loss_fn: Callable  # loss_fn(model, batch) -> scalar tensor
    batch: Any  # CPU tensors; moved to the device by each system
    optimizer: OptimizerSpec
    info: dict = field(default_factory=dict)  # config facts for the JSON (parameters, batch shape, ...)

    def fresh_model(self, device) -> nn.Module:
        """A copy of the canonical model on ``device`` (deepcopy keeps tied weights and every buffer)."""
        return copy.deepcopy(self.model).to(device)

    def batch_on(self, device):
        return batch_on(self.batch, device)


def batch_on(batch, device):
    """``batch`` (any structure of tensors and other leaves) with its tensors on ``device``."""
    return torch.utils._pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def trainable_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of the trainable parameters (as ``dtype`` when given): what a peer that moves every gradient
    or weight across the link once per step moves."""
    return sum(p.numel() * (dtype.itemsize if dtype is not None else p.element_size()) for p in trainable(model))


def parameter_count(model: nn.Module) -> dict:
    seen, total, train = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        train += p.numel() if p.requires_grad else 0
    return {"parameters": total, "trainable_parameters": train}


@dataclass
class PeerResult:
    system: str
    status: str = OK
    error: str | None = None
    step_s: list[float] = field(default_factory=list)  # timed steps (after warmup)
    first_step_s: float | None = None  # warmup step: allocator growth, autotuning, arena allocation
    losses: list[float] = field(default_factory=list)  # every step's loss, warmup included
    peak_allocated: int | None = None  # torch.cuda.max_memory_allocated over the run; None on CPU
    peak_reserved: int | None = None  # torch.cuda.max_memory_reserved (what the caching allocator held)
    bytes_h2d: int | None = None  # per step, where knowable
    bytes_d2h: int | None = None
    math: str | None = None  # EAGER_MATH or BF16_WEIGHTS: whether the row computes eager's numbers
    extra: dict = field(default_factory=dict)

    def stats(self) -> dict:
        times = sorted(self.step_s)
        if not times:
            return {"step_s_median": None, "step_s_min": None, "step_s_max": None, "step_s_spread": None}
        med = statistics.median(times)
        return {"step_s_median": med, "step_s_min": times[0], "step_s_max": times[-1],
                # relative spread (max - min) / median: how much to trust a difference between rows
                "step_s_spread": (times[-1] - times[0]) / med if med > 0 else 0.0}

    def row(self) -> dict:
        out = asdict(self)
        extra = out.pop("extra")
        return {**out, **self.stats(), **extra}


# -- device helpers -----------------------------------------------------------------------------

def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def sync(device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def release_memory(device) -> None:
    """Free what the last system left (cycles included) and reset the peak counters for the next."""
    gc.collect()
    if is_cuda(device) and torch.cuda.is_available():
        torch.cuda.synchronize(device)
        # cuBLAS keeps a workspace per stream it ran on: the last system's would count in the next one's peak
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        # pinned host blocks (save_on_cpu, turnip's CPU storage) stay cached by torch otherwise,
        # and a suite of large models would pile them up in host memory
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if host_empty_cache is not None:
            host_empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def record_peaks(result: PeerResult, device) -> None:
    if is_cuda(device) and torch.cuda.is_available():
        result.peak_allocated = int(torch.cuda.max_memory_allocated(device))
        result.peak_reserved = int(torch.cuda.max_memory_reserved(device))


def importable(module: str) -> str | None:
    """None if ``module`` imports, else why not (missing, or broken: e.g. built for another torch)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{module.split('.')[0]} is not installed"
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken install is as good as a missing one here
        return f"{module} does not import: {type(exc).__name__}: {exc}"[:300]
    return None


def unavailable(system: str, device, module: str) -> PeerResult | None:
    """The row of a peer that cannot run here, or None: "skipped" without a CUDA device (every offloading
    peer moves data between a GPU and the host), "not installed" where ``module`` does not import."""
    if not is_cuda(device) or not torch.cuda.is_available():
        why = "needs a CUDA device" if not is_cuda(device) else "CUDA is not available"
        return PeerResult(system, status=SKIPPED, error=why)
    why = importable(module)
    if why:
        log.info("%s: %s", system, why)
        return PeerResult(system, status=NOT_INSTALLED, error=why)
    return None


def is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and "out of memory" in str(exc).lower()


def describe(exc: BaseException, limit: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + " ..."


# -- time limits --------------------------------------------------------------------------------

class TimeLimitExceeded(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise TimeLimitExceeded in the main thread after ``seconds`` (SIGALRM); no-op elsewhere.

    Lets one slow system (a long compile, a stuck step) be recorded as a timeout while the
    suite goes on to the next, inside the device's per-command limit. The engine's loop
    drains in-flight work before re-raising, so it stays usable.
    """
    usable = (seconds is not None and seconds > 0 and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def on_alarm(_signum, _frame):
        raise TimeLimitExceeded(f"time limit of {seconds:.0f}s reached")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- the measured loop --------------------------------------------------------------------------

def timed_steps(result: PeerResult, step: Callable[[], torch.Tensor], steps: int, device, warmup: int = 1,
                deadline: float | None = None) -> None:
    """Run warmup + steps calls of ``step`` (one training step returning its loss); fill times and losses.

    synchronize + perf_counter around each step: the step's whole wall time, host work
    included (turnip's loop is host-driven, so CUDA events alone would flatter it).
    Stops early, keeping what it has, when ``deadline`` (time.monotonic()) passes.
    """
    for i in range(warmup + steps):
        if deadline is not None and time.monotonic() > deadline and i > warmup:
            result.extra["truncated"] = f"deadline after {i - warmup} timed steps"
            log.warning("%s: deadline reached after %d timed steps", result.system, i - warmup)
            break
        sync(device)
        t0 = time.perf_counter()
        loss = step()
        sync(device)
        elapsed = time.perf_counter() - t0
        value = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)
        result.losses.append(value)
        if i < warmup:
            result.first_step_s = elapsed
        else:
            result.step_s.append(elapsed)
        log.info("%s step %d/%d: %.1f ms, loss %.5f", result.system, i + 1 - warmup, steps, elapsed * 1e3, value)
        if not math.isfinite(value):
            log.warning("%s: non-finite loss at step %d", result.system, i)


def device_timed_steps(step: Callable[[], Any], steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step`` after ``warmup`` untimed ones, between CUDA
    events on the current stream, the device idle before each. Unlike timed_steps (wall time) this
    leaves out the host's work before the first launch and after the last; the A/B benches
    (bench/prefetch_ab.py, bench/pinned_memory.py) time both sides of a comparison with it."""
    times = []
    for k in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        if k >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return times


def ab_arguments(parser) -> None:
    """The arguments the A/B benches of one compiled bench model share (prefetch_ab, planner_ab)."""
    parser.add_argument("--model", default="gpt1.3b")
    parser.add_argument("--budget", default="0.25", help="compile's budget: bytes, a size, or a fraction")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the two MemGraphs, alternating")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per MemGraph and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per MemGraph and round")


def run_alternately(builds: dict, rows: dict[str, dict], batch, rounds: int, steps: int, warmup: int,
                    after_round: Callable[[int], None] | None = None) -> None:
    """Time each MemGraph of ``builds`` (name -> MemGraph) ``rounds`` times in turn, ``steps`` device-timed
    steps after ``warmup`` each, appending to ``rows[name]["steps_s"]`` and setting its "median_s" (of the
    steps so far) after every round, then calling ``after_round(rounds done)``: a bench cut short by its
    time limit keeps the rounds it ran. Each is released after its turn, so one arena and one pinned
    storage exist at a time."""
    for done in range(1, rounds + 1):
        for name, mg in builds.items():
            rows[name]["steps_s"] += device_timed_steps(lambda mg=mg: engine.run(mg, batch), steps, warmup)
            mg.release(keep=False)
            log.info("%s: %s ms", name, " ".join(f"{t * 1e3:.1f}" for t in rows[name]["steps_s"][-steps:]))
        for row in rows.values():
            row["median_s"] = statistics.median(row["steps_s"])
        if after_round is not None:
            after_round(done)


def guarded(result: PeerResult, device, body: Callable[[], None], limit_s: float | None = None) -> PeerResult:
    """Run ``body`` (which fills ``result``), turning OOM, time limits and errors into the result's status.

    The exception and its traceback (which hold the step's tensors) are dropped before the
    memory is released, so the next system starts from an empty device.
    """
    status, error = OK, None
    release_memory(device)
    try:
        with time_limit(limit_s):
            body()
    except TimeLimitExceeded as exc:
        status, error = TIMEOUT, str(exc)
    except Exception as exc:
        status, error = (OOM if is_oom(exc) else ERROR), describe(exc)
        if status == ERROR:
            log.exception("%s failed", result.system)
    record_peaks(result, device)
    if status != OK:
        result.status, result.error = status, error
        log.warning("%s: %s (%s)", result.system, status, error)
    release_memory(device)
    return result
