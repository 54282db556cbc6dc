"""engine.run: check the batch, pick the backend, run one step through the loop.

    out = engine.run(mg, batch)                       # out["loss"]
    out = engine.run(mg, batch, ordering="deterministic", timeline="step.json")

Everything that can be checked before work starts (the batch, the ordering,
stream counts, workspace, locks) is checked first, so a bad call changes nothing.

A step is atomic or clearly broken, whatever stops it: a vertex that raises, Ctrl-C
(KeyboardInterrupt), an error of the loop or of the device. Stopping launches
nothing more, keeps launched units that have not started from starting, and waits
for the running ones at most DRAIN_S seconds (a second Ctrl-C: not at all). If no
vertex that writes a weight's or optimizer state's home had started, the MemGraph
is as before the step (weights, optimizer states, step count, random generator)
and the step can simply be run again. Otherwise the weights are a mix of two steps:
the error says so, and every later run, ``mg.state_dict()`` and ``mg.save()``
refuse until ``mg.release()`` starts over from ``mg.initial_state``. Units still
running when engine.run returned are waited for by the next run (at most SETTLE_S
seconds; then it refuses, naming them). A first Ctrl-C that arrives once a vertex
writing a home has begun does not stop the step (stopping would mix the weights): the
step runs to its end and counts, then KeyboardInterrupt is raised; so does one that
arrives once every unit of the step has run.
"""

from __future__ import annotations

import importlib
import logging
import time
import warnings
from pathlib import Path

import torch

from ..ir.batch import check_batch
from ..ir.memgraph import MemGraph, Stream
from ..ir.optimizer import mark_stepped
from .collector import collector_paused
from .completions import completion_mode
from .errors import EngineError
from .loop import Interrupts, LoopTime, Record, Scheduler, drive
from .policy import Policy, make_policy
from .resources import StreamPool, WorkspacePool, stream_counts, transfer_depth
from .timeline import write_timeline

log = logging.getLogger(__name__)

# mg.device -> module providing create_runtime(mg); imported on first use so a
# CPU-only install never imports CUDA code.
BACKENDS = {"cpu": "turnip.engine.cpu", "cuda": "turnip.engine.cuda"}

SETTLE_S = 10.0  # a run after a step that left units running waits this long for them, then refuses


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


def run(mg: MemGraph, batch, ordering: str | Policy = "nondeterministic", timeline: str | Path | None = None,
        seed: int | None = None, streams: dict | None = None, transfer_ahead: int | None = None,
        completion: str | None = None, *, trace: str | Path | None = None) -> dict:
    """Run one training step of ``mg`` on ``batch``; return its outputs (``out["loss"]``).

    A MemGraph compiled with accumulation_steps=k takes a list of k micro-batches, each like the
    example batch, and returns out["losses"] (the k losses) and out["loss"] (their sum).

    ordering: "nondeterministic" (launch whatever is ready, earliest in mg.serial first),
    "deterministic" (mg.serial order within each stream class), "random" (seeded random
    priorities, for fuzzing), or a Policy. timeline: path of a Chrome/Perfetto JSON timeline of the
    step (engine/timeline.py); ``trace=`` is its former name, still accepted with a DeprecationWarning.
    streams: stream instances per class, e.g. {"compute": 4, "h2d": 2}.
    transfer_ahead: on CUDA, copies each copy stream reports to the loop when enqueued rather than
    when finished (None: the backend's default, engine.resources.CUDA_TRANSFER_AHEAD), so the next
    copy waits on the device, not on the host, for the one before; the order stays the loop's.
    completion: on CUDA, how the loop learns that work finished (engine/completions.py): "events"
    (poll the CUDA event after each unit) or "callback" (a host function per unit puts it on a queue
    the loop blocks on; needs CuPy); None: engine.completions.CUDA_COMPLETION. The CPU backend's
    workers always report through a queue: there the name is checked and has no effect.
    """
    if trace is not None:
        warnings.warn("engine.run(trace=...) is now timeline=...", DeprecationWarning, stacklevel=2)
        timeline = timeline if timeline is not None else trace
    policy = make_policy(ordering, seed)
    leaves = flatten_batch(mg, batch)
    if mg.optimizer is not None and mg.taskgraph.optimizer is not None:
        mg.taskgraph.optimizer.follow(mg.optimizer.param_groups)
    runtime = get_runtime(mg)
    runtime.check_consistent()
    counts = stream_counts(runtime.device_type, streams)
    copies_ahead = transfer_depth(runtime.device_type, transfer_ahead)
    mode = completion_mode(runtime.device_type, completion)
    with runtime.lock, collector_paused():
        settle(runtime)
        graph = runtime.graph
        pool = StreamPool([counts[stream] for stream, _ in graph.keys])
        scheduler = Scheduler(graph, runtime.ranks(mg, policy), policy.strict, pool,
                              WorkspacePool(runtime.workspace_capacity))
        step = runtime.step + 1
        records: list[Record] = []
        loop_time = LoopTime()
        # fuzzing: random orders also get random worker delays where a backend supports them
        runtime.fuzz_seed = getattr(policy, "seed", None) if policy.name == "random" else None
        runtime.timing = timeline is not None  # device timestamps cost events: only for a timeline
        runtime.transfer_depth = copies_ahead
        runtime.completion = mode
        runtime.stream_sizes = pool.sizes
        # one compute stream per device: no two vertices' op workspaces are ever in use at once
        runtime.shared_workspace = all(n == 1 for (stream, _), n in zip(graph.keys, pool.sizes)
                                       if stream is Stream.COMPUTE)
        origin = time.perf_counter()
        ok = False
        # from here until the step has counted (or stopped), Ctrl-C is seen by the loop, not raised anywhere
        with Interrupts() as interrupts:
            runtime.interrupts = interrupts  # CUDA's end_step looks at it while it waits for the device
            try:
                runtime.begin_step(mg, leaves, step)  # backends make the step's token first (cancel_step)
                completions = runtime.completion_source()
                notify = completions.put
                drive(mg, scheduler, lambda item: runtime.launch(item, notify), completions, records,
                      interrupts=interrupts, stop=runtime.cancel_step,
                      finish=lambda: bool(runtime.home_writers.intersection(scheduler.launch_order)),
                      spent=loop_time)
                outputs = runtime.end_step()
                # the step counter moves only when the step completed, so a stopped step can be rerun
                runtime.step = step
                ok = True
                mark_stepped(mg.optimizer)  # the update ran: LR schedulers stepped next must not warn
            except BaseException as exc:
                try:
                    stopped(mg, runtime, scheduler, exc, step, policy, interrupts)
                except Exception as err:  # never lose exc; and never leave the weights unmarked
                    log.exception("accounting for the stopped step failed")
                    runtime.mixed = (f"step {step} stopped ({type(exc).__name__}) and what it left could not be "
                                     f"determined ({type(err).__name__}: {err}): the weights may mix steps "
                                     f"{step - 1} and {step}. Call mg.release() to start again from "
                                     f"mg.initial_state, or memgraph.load a saved MemGraph")
                raise
            finally:
                if not ok:
                    try:
                        runtime.abort_step()
                    except Exception:  # the error that stopped the step is the one to raise
                        log.exception("abort_step failed after step %d stopped", step)
                runtime.interrupts = None
                runtime.last_records = records
                runtime.last_loop_time = loop_time
                runtime.last_launch_order = scheduler.launch_order
                if timeline is not None:
                    write_timeline(timeline, mg, runtime.device_records(records, origin), graph.keys, origin,
                                   instances={k: n for k, n in enumerate(pool.sizes)},
                                   meta={"step": step, "ordering": policy.name, "policy": repr(policy), "ok": ok,
                                         "vertices": graph.n, "wall_s": time.perf_counter() - origin},
                                   launched=runtime.launched)
            if interrupts.pending is not None:  # raised as the block ends
                interrupts.pending.add_note(f"step {step} ran to its end (the interrupt came after its updates had "
                                            f"begun, or once every unit had run): it counts (the weights, optimizer "
                                            f"states and step count are those after it)")
        log.debug("step %d: %d vertices in %.3f ms (%s)", step, graph.n,
                  (time.perf_counter() - origin) * 1e3, policy)
        return outputs


def settle(runtime) -> None:
    """Before a step: wait (at most SETTLE_S) for units an earlier stopped step left running; refuse
    if they still run, since the new step would share the arena with them."""
    unsettled = runtime.unsettled
    if unsettled is None:
        return
    if not runtime.quiesce(SETTLE_S):
        raise EngineError(f"{unsettled}, and they still run {SETTLE_S:g} s later: a new step would share "
                          f"the arena with them. Run again once they have finished, or call mg.release() "
                          f"(which keeps the weights: none of them updates a weight)")
    runtime.unsettled = None


def stopped(mg: MemGraph, runtime, scheduler: Scheduler, exc: BaseException, step: int, policy: Policy,
            interrupts: Interrupts) -> None:
    """A step stopped before it counted: start nothing more of it, wait for what runs (the drain's
    bound; no wait after a second Ctrl-C), then mark what it left: weights that mix two steps if a
    vertex writing a home had started (``runtime.mixed``), units still running (``runtime.unsettled``)."""
    exc.add_note(f"step {step}, ordering {policy!r}")  # a failing random order can be replayed by seed
    what = ("failed" if isinstance(exc, Exception) else f"was interrupted ({type(exc).__name__})")
    started = runtime.cancel_step()  # units that ran or run; None: assume all launched
    idle, device_error = True, None
    timeout = 0.0 if interrupts.hard else max(0.0, interrupts.drain_deadline() - time.monotonic())
    try:
        idle = runtime.quiesce(timeout)
    except Exception as err:  # noqa: BLE001 - the device failed (a CUDA error): nothing of it can be trusted
        idle, device_error = False, err
    if started is None:
        ran = set(scheduler.launch_order)
    else:
        units = runtime.graph.units
        ran = {vid for unit in started for vid in units[unit]}
    updated = runtime.home_writers.intersection(ran)
    if device_error is not None:
        runtime.mixed = (f"step {step} {what}, and the device then reported {type(device_error).__name__}: "
                         f"{device_error}. Nothing it holds can be trusted: restart the process and "
                         f"memgraph.load the last saved MemGraph")
        exc.add_note(runtime.mixed)
    elif updated:
        runtime.mixed = (f"step {step} {what} after {len(updated)} of {len(runtime.home_writers)} vertices that "
                         f"update weights or optimizer states in place had run: the weights mix steps {step - 1} "
                         f"and {step}. Call mg.release() to start again from mg.initial_state (the compiled "
                         f"weights, or those it was loaded or released with), or memgraph.load a saved MemGraph")
        exc.add_note(runtime.mixed)
    else:
        exc.add_note(f"no weight or optimizer state was updated: the MemGraph is as before step {step}, which "
                     f"can simply be run again")
    if not idle and device_error is None and not updated:
        runtime.unsettled = f"step {step} {what} with units still running"
        exc.add_note(f"some of its units were still running when engine.run returned; the next engine.run "
                     f"waits for them (at most {SETTLE_S:g} s)")
