"""A step is atomic or clearly broken (issue 30, item 1), whatever stops engine.run.

A KeyboardInterrupt or a RuntimeError raised inside a vertex of every kind (compute in the forward,
the backward and the optimizer update; offload, reload, copy, input, output), in every ordering;
Ctrl-C sent to the main thread from a timer (``_thread.interrupt_main``) at many points of a step,
once or twice; an error of the loop itself. Afterwards the MemGraph is either as before the step
(the next runs equal eager's from the state before it, bitwise: weights, AdamW states, step count)
or marked mixed (run, state_dict, save and the optimizer's state_dict refuse, saying so); and
nothing hangs: engine.run runs in a thread joined with a deadline, or, where it must run on the
main thread (signals reach only that one), under a faulthandler watchdog that ends the process
with every thread's traceback instead of hanging the suite.
"""

from __future__ import annotations

import _thread
import copy
import faulthandler
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from cases import OPTIMIZERS, assert_same_optimizer_state, assert_same_state, make_case, trainable
from engine_graphs import step_graph
from turnip.bench.models import mlp as mlp_model
from turnip.engine import VertexError
from turnip.engine import loop as engine_loop
from turnip.engine import run_step as engine_run_step
from turnip.engine.cpu import CpuRuntime
from turnip.engine.errors import EngineError
from turnip.engine.loop import Scheduler
from turnip.ir.memgraph import Kind

from turnip import engine, memgraph

ORDERS = [("deterministic", None), ("nondeterministic", None), ("random", 1), ("random", 2), ("random", 3)]
KINDS = ["forward", "backward", "optimizer", "offload", "reload", "input", "output"]
DEADLINE_S = 60.0


def run_bounded(fn, timeout=DEADLINE_S):
    """Call fn in a thread; fail (instead of hanging the suite) if it does not return in time."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"hung for {timeout} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture(autouse=True)
def _sigint_handled():
    """Python's own SIGINT handler for each test. A process a non-interactive shell starts in the
    background inherits SIGINT ignored, and ``_thread.interrupt_main`` does nothing then: these tests
    would see no Ctrl-C at all (``nohup python -m pytest ... &`` failed five of them)."""
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, signal.SIG_DFL):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def watchdog(request):
    """For code that must run on the main thread: a hang dumps every thread's traceback (to the
    terminal, past pytest's capture) and ends the process, failing the run instead of hanging it."""
    try:
        from _pytest.faulthandler import fault_handler_stderr_fd_key
        out = request.config.stash[fault_handler_stderr_fd_key]
    except (ImportError, KeyError):
        out = sys.__stderr__
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True, file=out)
    yield
    faulthandler.cancel_dump_traceback_later()


# -- the oracle ------------------------------------------------------------------------------------

def eager_snapshots(model, loss_fn, batches, make_opt, seed: int = 123, device="cpu"):
    """After each eager step: its loss, the weights and the optimizer's state_dict (copies)."""
    model = copy.deepcopy(model)
    opt = make_opt(trainable(model))
    torch.manual_seed(seed)
    if device != "cpu":
        torch.cuda.manual_seed(seed)
    snaps = []
    for batch in batches:
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        snaps.append(SimpleNamespace(loss=loss.detach().clone(), weights=copy.deepcopy(model.state_dict()),
                                     opt=copy.deepcopy(opt.state_dict())))
    return snaps


@pytest.fixture(scope="module")
def mlp():
    """An MLP with dropout, AdamW, at half its unplanned peak: offloads, reloads and CPU homes."""
    model, loss_fn, batches = make_case("mlp", dropout=0.1)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS["adamw"](trainable(model)),
                          budget=0.5, device="cpu")
    kinds = {mv.kind for mv in mg.vertices}
    assert {Kind.OFFLOAD, Kind.RELOAD, Kind.INPUT, Kind.OUTPUT} <= kinds
    assert any(p.where == "cpu" for p in mg.homes.values())
    snaps = eager_snapshots(model, loss_fn, batches, OPTIMIZERS["adamw"])
    return SimpleNamespace(mg=mg, batches=batches, snaps=snaps)


def first_step(t, ordering="nondeterministic", seed=None):
    """Start again from the compiled weights and run step 1, as eager's first step."""
    t.mg.runtime = None
    torch.manual_seed(123)
    out = run_bounded(lambda: engine.run(t.mg, t.batches[0], ordering=ordering, seed=seed))
    assert torch.equal(out["loss"], t.snaps[0].loss)


def outcome(t, tmp_path, ordering="nondeterministic", seed=None, steps_before: int = 1) -> str:
    """What a stopped step left: "mixed" (every use refuses, saying so) or "as before" (the next runs
    are eager's from the state before the step, bitwise). With steps_before=2 the step counted."""
    mg, rt = t.mg, t.mg.runtime
    if rt.mixed is not None:
        assert rt.step == steps_before
        calls = [lambda: run_bounded(lambda: engine.run(mg, t.batches[1])), mg.state_dict,
                 lambda: mg.save(tmp_path / "mixed.mg"), mg.optimizer.state_dict]
        for call in calls:
            with pytest.raises(EngineError, match=f"mix steps {steps_before} and {steps_before + 1}.*mg.release"):
                call()
        assert not (tmp_path / "mixed.mg").exists()
        return "mixed"
    assert rt.step == steps_before
    assert_same_state(mg.state_dict(), t.snaps[steps_before - 1].weights)
    assert_same_optimizer_state(mg.optimizer.state_dict(), t.snaps[steps_before - 1].opt, groups=False)
    for i in range(steps_before, len(t.batches)):
        out = run_bounded(lambda i=i: engine.run(mg, t.batches[i], ordering=ordering, seed=seed))
        assert torch.equal(out["loss"], t.snaps[i].loss), f"step {i + 1}"
    assert rt.step == len(t.batches)
    assert_same_state(mg.state_dict(), t.snaps[-1].weights)
    assert_same_optimizer_state(mg.optimizer.state_dict(), t.snaps[-1].opt, groups=False)
    return "as before" if steps_before == 1 else "counted"


# -- faults inside vertices ------------------------------------------------------------------------

def vertices_of(mg, kind: str) -> list[int]:
    """The vertices of a kind ("forward", "backward", "optimizer": compute by phase), in serial order."""
    tasks = mg.taskgraph.vertices
    if kind in ("forward", "backward", "optimizer"):
        return [v for v in mg.serial if mg.vertices[v].kind is Kind.COMPUTE
                and tasks[mg.vertices[v].task_vertex].phase == kind]
    return [v for v in mg.serial if mg.vertices[v].kind is Kind(kind)]


class Fault:
    """While armed, vertex ``target`` raises ``error`` (before it runs, or after it ran); ``began``
    lists every vertex that began to run meanwhile (the engine's claim to check: the weights are
    marked mixed exactly when one of them writes a home)."""

    def __init__(self, monkeypatch, target: int, error: type[BaseException], after: bool):
        self.target, self.error, self.after, self.armed, self.fired = target, error, after, True, 0
        self.began: list[int] = []
        real = CpuRuntime.execute
        fault = self

        def execute(runtime, mg, vid):
            if not fault.armed:
                return real(runtime, mg, vid)
            fault.began.append(vid)  # list.append is atomic: workers call this concurrently
            if vid == fault.target:
                fault.fired += 1
                if fault.after:
                    real(runtime, mg, vid)
                raise fault.error(f"injected into vertex {vid}")
            return real(runtime, mg, vid)

        monkeypatch.setattr(CpuRuntime, "execute", execute)


OUTCOMES: dict[str, set] = {}  # kind -> outcomes seen, over the parametrized runs (checked last)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("kind", KINDS)
def test_a_vertex_that_raises_leaves_the_step_atomic_or_marked(mlp, kind, error, monkeypatch, tmp_path):
    candidates = vertices_of(mlp.mg, kind)
    assert candidates, kind
    for pick, (ordering, seed) in enumerate(ORDERS):
        first_step(mlp, ordering, seed)
        # the first vertex of the kind, raising before it runs; the last, after it ran; one between
        target, after = [(candidates[0], False), (candidates[-1], True),
                         (candidates[len(candidates) // 2], pick % 2 == 1)][pick % 3]
        fault = Fault(monkeypatch, target, error, after)
        with pytest.raises(VertexError if error is RuntimeError else KeyboardInterrupt) as info:
            run_bounded(lambda o=ordering, s=seed: engine.run(mlp.mg, mlp.batches[1], ordering=o, seed=s))
        fault.armed = False
        assert fault.fired == 1
        rt = mlp.mg.runtime
        assert rt.step == 1 and rt.unsettled is None
        if error is KeyboardInterrupt:  # raised as it is, not wrapped
            assert str(info.value) == f"injected into vertex {target}"
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "step 2, ordering" in notes
        updated = rt.home_writers.intersection(fault.began)
        result = outcome(mlp, tmp_path, ordering, seed)
        assert (result == "mixed") == bool(updated), (kind, ordering, seed, sorted(updated))
        assert ("mix steps 1 and 2" in notes) == bool(updated)
        OUTCOMES.setdefault(kind, set()).add(result)


def test_faults_in_vertices_ended_both_ways():
    """Over the runs above: some stopped before any update (and were checked bitwise), some after."""
    if len(OUTCOMES) < len(KINDS):
        pytest.skip("needs the parametrized runs above in this session")
    assert set().union(*OUTCOMES.values()) == {"as before", "mixed"}, OUTCOMES


def hand_made_case(kind: Kind, error: type[BaseException], ordering: str, seed, monkeypatch, tmp_path) -> str:
    mg, batch, reference = step_graph()
    want_outs, want_weights = reference(3)
    run_bounded(lambda: engine.run(mg, batch(1)))
    targets = [v for v in mg.serial if mg.vertices[v].kind is kind]
    fault = Fault(monkeypatch, targets[-1] if seed != 2 else targets[0], error, after=seed == 1)
    with pytest.raises(VertexError if error is RuntimeError else KeyboardInterrupt):
        run_bounded(lambda: engine.run(mg, batch(2), ordering=ordering, seed=seed))
    fault.armed = False
    assert mg.runtime.step == 1
    updated = mg.runtime.home_writers.intersection(fault.began)
    if mg.runtime.mixed is not None:
        assert updated
        for call in (lambda: engine.run(mg, batch(2)), mg.state_dict, lambda: mg.save(tmp_path / "s.mg")):
            with pytest.raises(EngineError, match="mix steps 1 and 2"):
                call()
        return "mixed"
    assert not updated
    assert_same_state(mg.state_dict(), reference(1)[1])
    for step in (2, 3):
        out = run_bounded(lambda s=step: engine.run(mg, batch(s), ordering=ordering, seed=seed))
        assert torch.equal(out["loss"], want_outs[step - 1]["loss"])
    assert_same_state(mg.state_dict(), want_weights)
    return "as before"


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("kind", [Kind.COPY, Kind.OFFLOAD, Kind.RELOAD, Kind.INPUT, Kind.OUTPUT, Kind.COMPUTE])
def test_hand_made_step_with_a_copy_home(kind, error, monkeypatch, tmp_path):
    """engine_graphs.step_graph: W's update is copied into its home (COPY), b's offloaded into its CPU
    home; every update comes after the input, so a fault in the input leaves the step as before."""
    seen = {hand_made_case(kind, error, ordering, seed, monkeypatch, tmp_path) for ordering, seed in ORDERS}
    if kind is Kind.INPUT:
        assert seen == {"as before"}
    if kind is Kind.COPY:  # the copy into W's home is itself an update
        assert seen == {"mixed"}


# -- an error of the loop itself -----------------------------------------------------------------

def break_the_loop(monkeypatch, where: str, at: int) -> None:
    """The at-th completion the loop takes (or hands to the scheduler) raises RuntimeError."""
    calls = {"n": 0}
    if where == "scheduler":
        real = Scheduler.complete

        def complete(self, vid, ran=True):
            calls["n"] += 1
            if calls["n"] == at:
                raise RuntimeError("the loop's books broke")
            return real(self, vid, ran)

        monkeypatch.setattr(Scheduler, "complete", complete)
        return
    real_source = CpuRuntime.completion_source

    class Broken:
        def __init__(self, inner):
            self.inner, self.put = inner, inner.put

        def get(self, timeout=None):
            calls["n"] += 1
            if calls["n"] == at:
                raise RuntimeError("the completion source broke")
            return self.inner.get(timeout=timeout)

    monkeypatch.setattr(CpuRuntime, "completion_source", lambda self: Broken(real_source(self)))


@pytest.mark.parametrize("where", ["scheduler", "completions"])
def test_an_error_of_the_loop_itself_is_drained_and_accounted_for(mlp, where, monkeypatch, tmp_path):
    for at in (1, 5, 150, 290):
        first_step(mlp)
        began = Fault(monkeypatch, -1, RuntimeError, after=False)  # records what began, raises nowhere
        break_the_loop(monkeypatch, where, at)
        with pytest.raises(RuntimeError, match="broke"):
            run_bounded(lambda: engine.run(mlp.mg, mlp.batches[1]))
        monkeypatch.undo()
        assert mlp.mg.runtime.unsettled is None  # the units in flight were waited for
        updated = mlp.mg.runtime.home_writers.intersection(began.began)
        assert (outcome(mlp, tmp_path) == "mixed") == bool(updated)


# -- Ctrl-C on the main thread -------------------------------------------------------------------

def interrupted_run(t, delays: list[float], ordering="nondeterministic", seed=None, **options) -> tuple[bool, float]:
    """engine.run of step 2 on the main thread with interrupt_main() from timers after ``delays``
    seconds; returns (engine.run raised KeyboardInterrupt, seconds it took). Every interrupt is
    received here, whenever it comes, so none escapes into the test."""
    timers = [threading.Timer(d, _thread.interrupt_main) for d in delays]
    raised, t0, took = False, time.perf_counter(), None
    try:
        try:
            for timer in timers:
                timer.start()
            engine.run(t.mg, t.batches[1], ordering=ordering, seed=seed, **options)
        except KeyboardInterrupt:
            raised = True
        took = time.perf_counter() - t0
        for timer in timers:
            timer.join()
        time.sleep(0.01)  # a late interrupt is raised here, at the latest
    except KeyboardInterrupt:
        pass
    for timer in timers:  # a second interrupt may still be pending in this except's body
        try:
            timer.join()
            time.sleep(0.01)
        except KeyboardInterrupt:
            pass
    return raised, took


def step_seconds(t) -> float:
    first_step(t)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        engine.run(t.mg, t.batches[1])
        times.append(time.perf_counter() - t0)
    return sorted(times)[1]


def test_ctrl_c_at_any_point_of_a_step(mlp, watchdog, tmp_path):
    step = step_seconds(mlp)
    seen = []
    fractions = [0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 2.0]
    for i, fraction in enumerate(fractions):
        ordering, seed = ORDERS[i % len(ORDERS)]
        first_step(mlp, ordering, seed)
        raised, _ = interrupted_run(mlp, [fraction * step], ordering, seed)
        rt = mlp.mg.runtime
        assert rt.unsettled is None
        if rt.mixed is None and rt.step == 2:  # the interrupt came once every unit had run: the step counts
            seen.append(outcome(mlp, tmp_path, ordering, seed, steps_before=2))
        else:
            assert raised  # an interrupt that stopped the step is raised by engine.run
            seen.append(outcome(mlp, tmp_path, ordering, seed))
    # one Ctrl-C never mixes steps: before any update it stops the step, after one it finishes it
    assert "as before" in seen and "counted" in seen and "mixed" not in seen, seen


def slow_vertex(monkeypatch, vid: int, seconds: float) -> dict:
    """Vertex vid sleeps before it runs, while armed (the armed flag is read when it begins)."""
    real, armed = CpuRuntime.execute, {"on": True}

    def execute(runtime, mg, v):
        if v == vid and armed["on"]:
            time.sleep(seconds)
        return real(runtime, mg, v)

    monkeypatch.setattr(CpuRuntime, "execute", execute)
    return armed


def first_compute(mg) -> int:
    """The first compute vertex in serial order: in deterministic order on one compute stream,
    no update can begin while it runs."""
    return next(v for v in mg.serial if mg.vertices[v].kind is Kind.COMPUTE)


def test_a_second_ctrl_c_returns_at_once_and_the_next_run_waits(mlp, watchdog, monkeypatch, tmp_path):
    """The first Ctrl-C drains, waiting for a vertex that takes 2 s; the second returns at once. The
    vertex still runs: the next engine.run waits for it, then runs as eager's from before the step."""
    first_step(mlp)
    armed = slow_vertex(monkeypatch, first_compute(mlp.mg), 2.0)
    raised, took = interrupted_run(mlp, [0.2, 0.4], ordering="deterministic", streams={"compute": 1})
    armed["on"] = False
    assert raised and took < 1.2, took
    rt = mlp.mg.runtime
    assert rt.mixed is None and rt.unsettled is not None and rt.step == 1
    assert_same_state(mlp.mg.state_dict(), mlp.snaps[0].weights)  # readable while the vertex still runs
    t0 = time.perf_counter()
    assert outcome(mlp, tmp_path) == "as before"
    assert time.perf_counter() - t0 > 0.5  # the next run waited for the slow vertex
    assert rt.unsettled is None


def last_compute(mg) -> int:
    """The last compute vertex in serial order: in deterministic order on one compute stream, updates
    of weights have begun by the time it runs."""
    return [v for v in mg.serial if mg.vertices[v].kind is Kind.COMPUTE][-1]


def test_one_ctrl_c_after_the_updates_began_finishes_the_step(mlp, watchdog, monkeypatch, tmp_path):
    """Nothing lost: stopping now would mix two steps, so the step runs to its end, counts, and
    engine.run raises the KeyboardInterrupt after it, saying so."""
    first_step(mlp)
    armed = slow_vertex(monkeypatch, last_compute(mlp.mg), 0.6)
    with pytest.raises(KeyboardInterrupt) as info:
        try:
            threading.Timer(0.2, _thread.interrupt_main).start()
            engine.run(mlp.mg, mlp.batches[1], ordering="deterministic", streams={"compute": 1})
        finally:
            armed["on"] = False
    assert "ran to its end" in "\n".join(info.value.__notes__)
    rt = mlp.mg.runtime
    assert rt.mixed is None and rt.unsettled is None and rt.step == 2
    assert outcome(mlp, tmp_path, steps_before=2) == "counted"


def test_a_second_ctrl_c_while_the_step_finishes_stops_it_marked_mixed(mlp, watchdog, monkeypatch, tmp_path):
    first_step(mlp)
    armed = slow_vertex(monkeypatch, last_compute(mlp.mg), 1.5)
    raised, took = interrupted_run(mlp, [0.2, 0.4], ordering="deterministic", streams={"compute": 1})
    armed["on"] = False
    assert raised and took < 1.2, took
    assert outcome(mlp, tmp_path) == "mixed"
    time.sleep(1.5)  # the slow vertex ends before the next test starts again


def test_the_drain_is_bounded_and_a_run_refuses_while_work_still_runs(mlp, watchdog, monkeypatch, tmp_path):
    monkeypatch.setattr(engine_loop, "DRAIN_S", 0.3)
    monkeypatch.setattr(engine_run_step, "SETTLE_S", 0.1)
    first_step(mlp)
    armed = slow_vertex(monkeypatch, first_compute(mlp.mg), 1.5)
    with pytest.raises(KeyboardInterrupt) as info:
        t0 = time.perf_counter()
        try:
            threading.Timer(0.2, _thread.interrupt_main).start()
            engine.run(mlp.mg, mlp.batches[1], ordering="deterministic", streams={"compute": 1})
        finally:
            took = time.perf_counter() - t0
    armed["on"] = False
    assert 0.4 < took < 1.2, took
    notes = "\n".join(info.value.__notes__)
    assert "still running after 0.3 s" in notes and "the next engine.run waits for them" in notes
    with pytest.raises(EngineError, match="with units still running, and they still run 0.1 s later"):
        engine.run(mlp.mg, mlp.batches[1])  # refused before any work
    time.sleep(1.5)
    assert outcome(mlp, tmp_path) == "as before"


def test_a_custom_sigint_handler_keeps_its_meaning(mlp, watchdog, tmp_path):
    """A handler that only records the signal (a trainer's "stop after this step") lets the step finish."""
    import signal

    got = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        first_step(mlp)
        step = step_seconds(mlp)
        first_step(mlp)
        timer = threading.Timer(step * 0.3, _thread.interrupt_main)
        timer.start()
        engine.run(mlp.mg, mlp.batches[1])
        timer.join()
        time.sleep(0.01)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert got == [signal.SIGINT] and mlp.mg.runtime.step == 2
    assert outcome(mlp, tmp_path, steps_before=2) == "counted"


# -- CUDA ----------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("completion", ["events", "callback"])
def test_ctrl_c_on_cuda_leaves_the_step_atomic_or_marked(completion, watchdog, tmp_path):
    if completion == "callback":
        pytest.importorskip("cupy")
    torch.manual_seed(0)  # wide enough that half its peak is above the floor that cuBLAS's workspace sets
    model, loss_fn = mlp_model.MLP(512, 1024, 10, depth=8).cuda(), mlp_model.mlp_loss
    batches = [mlp_model.example_batch(512, 10, batch=256, device="cuda", seed=i) for i in range(3)]
    snaps = eager_snapshots(model, loss_fn, batches, OPTIMIZERS["adamw"], device="cuda")
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS["adamw"](trainable(model)),
                          budget=0.5, device="cuda")

    def start():
        mg.runtime = None
        engine.run(mg, batches[0], completion=completion)

    start()
    t0 = time.perf_counter()
    for _ in range(3):
        engine.run(mg, batches[1], completion=completion)
    torch.cuda.synchronize()
    step = (time.perf_counter() - t0) / 3
    seen = []
    t = SimpleNamespace(mg=mg, batches=batches)
    for i, fraction in enumerate([0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5]):
        ordering, seed = ORDERS[i % len(ORDERS)]
        start()
        raised, took = interrupted_run(t, [fraction * step], ordering, seed, completion=completion)
        assert took < step + engine_loop.DRAIN_S
        rt = mg.runtime
        assert rt.unsettled is None
        if rt.mixed is not None:
            assert raised
            for call in (lambda: engine.run(mg, batches[1]), mg.state_dict, lambda: mg.save(tmp_path / "m.mg")):
                with pytest.raises(EngineError, match="mix steps 1 and 2"):
                    call()
            seen.append("mixed")
            continue
        done = rt.step
        assert done in (1, 2) and (raised or done == 2)
        assert_same_state(mg.state_dict(), snaps[done - 1].weights, exact=False)
        assert_same_optimizer_state(mg.optimizer.state_dict(), snaps[done - 1].opt, exact=False, groups=False)
        for i in range(done, len(batches)):
            out = engine.run(mg, batches[i], ordering=ordering, seed=seed, completion=completion)
            torch.testing.assert_close(out["loss"].cpu(), snaps[i].loss.cpu(), rtol=1e-4, atol=1e-5)
        assert_same_state(mg.state_dict(), snaps[-1].weights, exact=False)
        seen.append("as before" if done == 1 else "counted")
    print(completion, seen)
