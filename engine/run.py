"""engine.run: check the batch, pick the backend, run one step through the loop.

    out = engine.run(mg, batch)                       # out["loss"]
    out = engine.run(mg, batch, ordering="deterministic", trace="step.json")

Everything that can be checked before work starts (the batch, the ordering,
stream counts, workspace, locks) is checked first, so a bad call changes nothing.
A step that fails before any weight was updated can simply be run again. One
that fails after some weights were updated in place leaves them a mix of two
steps: the error says so, and every later run, ``mg.state_dict()`` and
``mg.save()`` refuse until ``mg.release()`` starts over from the compiled weights.
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from turnip.engine.chrome_trace import write_trace
from turnip.engine.completions import completion_mode
from turnip.engine.errors import BatchError, EngineError
from turnip.engine.loop import Record, Scheduler, drive
from turnip.engine.policy import Policy, make_policy
from turnip.engine.resources import StreamPool, WorkspacePool, stream_counts, transfer_depth
from turnip.ir.memgraph import MemGraph, Stream
from turnip.ir.optimizer import mark_stepped
from turnip.ir.taskgraph import batch_leaf_names, flatten_batch_structure

log = logging.getLogger(__name__)

# mg.device -> module providing create_runtime(mg); imported on first use so a
# CPU-only install never imports CUDA code.
BACKENDS = {"cpu": "turnip.engine.cpu", "cuda": "turnip.engine.cuda"}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _input_name(value, leaf: int) -> str:
    return value.name.removeprefix("batch:") if value.name else f"leaf {leaf}"


def _structure(spec) -> str:
    """A batch structure in one line: its leaves' paths."""
    names = batch_leaf_names(spec)
    return f"leaves {', '.join(names)}" if names else "no leaves"


def _same_constant(got, want) -> bool:
    if type(got) is not type(want):
        return False
    return got == want or (isinstance(want, float) and math.isnan(want) and math.isnan(got))


def _size_hint(leaf: torch.Tensor, value) -> str:
    """Advice when only the first (batch) dimension differs."""
    if leaf.dtype != value.dtype or leaf.dim() != len(value.shape) or leaf.dim() == 0 \
            or tuple(leaf.shape[1:]) != tuple(value.shape[1:]):
        return ""
    if leaf.shape[0] < value.shape[0]:
        return (" (a last, partial batch? use DataLoader(..., drop_last=True), or compile a MemGraph for "
                "this batch size too)")
    return " (another batch size than the traced example's: compile a MemGraph for this batch size)"


def check_batch(tg, batch) -> list[torch.Tensor]:
    """The batch's tensor leaves in the order of ``tg.batch_inputs``, after checking the batch against
    the traced example: the same structure (lists and tuples alike, dict keys in any order), tensors
    of the same shapes and dtypes, and non-tensor leaves (compile-time constants) equal. A step that
    accumulates gradients over k micro-batches (``tg.accumulation_steps``) takes a list or tuple of k
    batches, each checked so. Raises BatchError, one line naming the input, otherwise."""
    steps = tg.accumulation_steps
    if steps == 1:
        return _check_one(tg, tg.batch_inputs, batch, "")
    if not isinstance(batch, (list, tuple)) or hasattr(batch, "_fields") or len(batch) != steps:
        got = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (list, tuple)) \
            else f"a {type(batch).__name__}"
        raise BatchError(f"this MemGraph accumulates gradients over {steps} micro-batches (compiled with "
                         f"accumulation_steps={steps}): engine.run takes a list of {steps} batches, each like the "
                         f"example batch, got {got}")
    per = len(tg.batch_inputs) // steps
    tensors = []
    for micro, part in enumerate(batch):
        tensors += _check_one(tg, tg.batch_inputs[micro * per:(micro + 1) * per], part,
                              f"micro-batch {micro} of {steps}: ")
    return tensors


def _check_one(tg, inputs: list[int], batch, where: str) -> list[torch.Tensor]:
    """check_batch for one batch like the example, whose tensors are the values `inputs`; `where`
    starts every message (the micro-batch)."""
    leaves, spec = flatten_batch_structure(batch)
    expected = [tg.values[v] for v in inputs]
    constants = tg.batch_constants
    if len(leaves) != len(expected) + len(constants):
        if tg.batch_spec is not None:
            names = ", ".join(batch_leaf_names(tg.batch_spec)) or "none"
        else:
            names = ", ".join(repr(_input_name(v, i)) for i, v in enumerate(expected)) or "none"
        raise BatchError(f"{where}batch has {len(leaves)} leaves, the traced example had "
                         f"{len(expected) + len(constants)} ({names})")
    if tg.batch_spec is not None and spec != tg.batch_spec:
        got, want = _structure(spec), _structure(tg.batch_spec)
        if got == want:  # same paths, other containers (a named tuple for a tuple, say)
            got, want = repr(pytree.tree_unflatten([0] * spec.num_leaves, spec)), \
                repr(pytree.tree_unflatten([0] * tg.batch_spec.num_leaves, tg.batch_spec))
        raise BatchError(f"{where}batch structure differs from the traced example's: {got}, expected {want}")
    names = batch_leaf_names(tg.batch_spec) if tg.batch_spec is not None else None
    tensors = []
    it = iter(expected)
    for i, leaf in enumerate(leaves):
        if i in constants:
            want = constants[i]
            if not _same_constant(leaf, want):
                raise BatchError(f"{where}batch input '{names[i] if names else i}' (leaf {i}) is a constant of the "
                                 f"compiled step: traced with {want!r} ({type(want).__name__}), got {leaf!r} "
                                 f"({type(leaf).__name__}); pass it as a tensor, or compile again for this value")
            continue
        value = next(it)
        want = f"shape {tuple(value.shape)} {_dtype_name(value.dtype)}"
        name = _input_name(value, i)
        if not isinstance(leaf, torch.Tensor):
            raise BatchError(f"{where}batch input '{name}' (leaf {i}): expected a tensor of {want}, "
                             f"got {type(leaf).__name__}")
        if tuple(leaf.shape) != tuple(value.shape) or leaf.dtype != value.dtype:
            raise BatchError(f"{where}batch input '{name}' (leaf {i}): expected {want}, "
                             f"got {tuple(leaf.shape)} {_dtype_name(leaf.dtype)}{_size_hint(leaf, value)}")
        tensors.append(leaf)
    return tensors


def flatten_batch(mg: MemGraph, batch) -> list[torch.Tensor]:
    """The batch's tensor leaves, in the traced order, after checking them against the example."""
    return check_batch(mg.taskgraph, batch)


def get_runtime(mg: MemGraph):
    """mg.runtime, created (arena and storage allocated, initial state written) on first use."""
    if mg.runtime is not None:
        return mg.runtime
    device_type = str(mg.device).split(":")[0]  # "cuda:0" runs on the cuda backend
    module_name = BACKENDS.get(device_type)
    if module_name is None:
        raise EngineError(f"no engine backend for device {mg.device!r} (known: {sorted(BACKENDS)})")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise EngineError(f"the {device_type} engine backend ({module_name}) is not available in this "
                          f"turnip install; run the MemGraph with device='cpu' or install it") from None
    mg.runtime = module.create_runtime(mg)
    return mg.runtime


def run(mg: MemGraph, batch, ordering: str | Policy = "nondeterministic", trace: str | Path | None = None,
        seed: int | None = None, streams: dict | None = None, transfer_ahead: int | None = None,
        completion: str | None = None) -> dict:
    """Run one training step of ``mg`` on ``batch``; return its outputs (``out["loss"]``).

    A MemGraph compiled with accumulation_steps=k takes a list of k micro-batches, each like the
    example batch, and returns out["losses"] (the k losses) and out["loss"] (their sum).

    ordering: "nondeterministic" (launch whatever is ready, earliest in mg.serial first),
    "deterministic" (mg.serial order within each stream class), "random" (seeded random
    priorities, for fuzzing), or a Policy. trace: path of a Chrome/Perfetto JSON trace.
    streams: stream instances per class, e.g. {"compute": 4, "h2d": 2}.
    transfer_ahead: on CUDA, copies each copy stream reports to the loop when enqueued rather than
    when finished (None: the backend's default, engine.resources.CUDA_TRANSFER_AHEAD), so the next
    copy waits on the device, not on the host, for the one before; the order stays the loop's.
    completion: on CUDA, how the loop learns that work finished (engine/completions.py): "events"
    (poll the CUDA event after each unit) or "callback" (a host function per unit puts it on a queue
    the loop blocks on; needs CuPy); None: engine.completions.CUDA_COMPLETION. The CPU backend's
    workers always report through a queue: there the name is checked and has no effect.
    """
    policy = make_policy(ordering, seed)
    leaves = flatten_batch(mg, batch)
    if mg.optimizer is not None and mg.taskgraph.optimizer is not None:
        mg.taskgraph.optimizer.follow(mg.optimizer.param_groups)
    runtime = get_runtime(mg)
    runtime.check_consistent()
    counts = stream_counts(runtime.device_type, streams)
    copies_ahead = transfer_depth(runtime.device_type, transfer_ahead)
    mode = completion_mode(runtime.device_type, completion)
    with runtime.lock:
        graph = runtime.graph
        pool = StreamPool([counts[stream] for stream, _ in graph.keys])
        scheduler = Scheduler(graph, runtime.ranks(mg, policy), policy.strict, pool,
                              WorkspacePool(runtime.workspace_capacity))
        step = runtime.step + 1
        records: list[Record] = []
        # fuzzing: random orders also get random worker delays where a backend supports them
        runtime.fuzz_seed = getattr(policy, "seed", None) if policy.name == "random" else None
        runtime.timing = trace is not None  # device timestamps cost events: only when tracing
        runtime.transfer_depth = copies_ahead
        runtime.completion = mode
        runtime.stream_sizes = pool.sizes
        # one compute stream per device: no two vertices' op workspaces are ever in use at once
        runtime.shared_workspace = all(n == 1 for (stream, _), n in zip(graph.keys, pool.sizes)
                                       if stream is Stream.COMPUTE)
        runtime.begin_step(mg, leaves, step)
        completions = runtime.completion_source()
        notify = completions.put
        origin = time.perf_counter()
        ok = False
        try:
            drive(mg, scheduler, lambda item: runtime.launch(item, notify), completions, records)
            outputs = runtime.end_step()
            # the step counter moves only when the step completed, so a failed step can be rerun
            runtime.step = step
            ok = True
            mark_stepped(mg.optimizer)  # the update ran: LR schedulers stepped next must not warn
        except EngineError as exc:
            exc.add_note(f"step {step}, ordering {policy!r}")  # a failing random order can be replayed by seed
            updated = runtime.home_writers.intersection(scheduler.launch_order)
            if updated:
                runtime.mixed = (f"step {step} failed after {len(updated)} of {len(runtime.home_writers)} vertices "
                                 f"that update weights or optimizer states in place had run: the weights mix steps "
                                 f"{step - 1} and {step}. Call mg.release() to start again from the compiled "
                                 f"weights (or load a saved MemGraph)")
                exc.add_note(runtime.mixed)
            raise
        finally:
            if not ok:
                runtime.abort_step()
            runtime.last_records = records
            runtime.last_launch_order = scheduler.launch_order
            if trace is not None:
                write_trace(trace, mg, runtime.device_records(records, origin), graph.keys, origin,
                            instances={k: n for k, n in enumerate(pool.sizes)},
                            meta={"step": step, "ordering": policy.name, "policy": repr(policy), "ok": ok,
                                  "vertices": graph.n, "wall_s": time.perf_counter() - origin},
                            launched=runtime.launched)
        log.debug("step %d: %d vertices in %.3f ms (%s)", step, graph.n,
                  (time.perf_counter() - origin) * 1e3, policy)
        return outputs
