"""Optimizer updates on the host's cores (Plan.host_update): built, verified, simulated and run on
the CPU backend, bitwise against eager's fused AdamW (the same CPU kernel)."""

import dataclasses
import re

import pytest
import torch
from cases import assert_same_state, eager_steps, make_case, trainable
from turnip.engine.host_lane import HostStream
from turnip.engine.timing_sim import simulate, time_floor
from turnip.ir.costs import FixedRates
from turnip.ir.memgraph import Kind, Stream
from turnip.ir.plan import CPU, Plan
from turnip.ir.taskgraph import ValueKind
from turnip.kernels.threads import host_threads
from turnip.memgraph.builder import build
from turnip.memgraph.checker import verify
from turnip.memgraph.report import plan_mix
from turnip.planners.host_update import fused_updates, host_update_candidates, with_host_updates

from turnip import engine, memgraph


def make_opt(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)


def run_steps(mg, batches, ordering="nondeterministic", seed=None):
    mg.runtime = None
    torch.manual_seed(123)
    losses = [engine.run(mg, b, ordering=ordering, seed=seed)["loss"].item() for b in batches]
    return losses, mg.state_dict()


@pytest.fixture(scope="module")
def gpt():
    model, loss_fn, batches = make_case("gpt", dropout=0.1)
    want_losses, want_state = eager_steps(model, loss_fn, batches, make_opt)
    return model, loss_fn, batches, [x.item() for x in want_losses], want_state


@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_every_update_on_the_host_matches_eager(gpt, budget):
    model, loss_fn, batches, want_losses, want_state = gpt
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=make_opt(trainable(model)), budget=budget,
                          device="cpu", fused_optimizer=True, host_update="all", cache=False, verbose=False)
    host = [mv for mv in mg.vertices if mv.stream is Stream.HOST]
    assert host and len(host) == len(mg.plan.host_update) == len(fused_updates(mg.taskgraph))
    assert all(p.where == "cpu" for mv in host for p in (*mv.reads.values(), *mv.writes.values()))
    # no state goes through the GPU: nothing writes a state's home but its update
    assert not any(mv.kind is Kind.OFFLOAD and mv.writes and next(iter(mv.writes.values())) in mg.homes.values()
                   for mv in mg.vertices)
    assert verify(mg) == []
    mix = plan_mix(mg)
    params = [v for v in mg.taskgraph.values if v.kind is ValueKind.PARAMETER]
    assert (mix.parameters_host_stepped, mix.parameters_streamed, mix.parameters_kept) == (len(params), 0, 0)
    assert mix.bytes_parameters_host_stepped == sum(v.nbytes for v in params)
    for ordering, seed in [("deterministic", None), ("nondeterministic", None), ("random", 1), ("random", 2)]:
        losses, state = run_steps(mg, batches, ordering, seed)
        assert losses == want_losses, f"{ordering} {seed}"
        assert_same_state(state, want_state)


def test_verify_catches_a_host_update_that_overtakes_a_reload(gpt):
    """The update overwrites a parameter's CPU home: every reload of the old version must come first."""
    model, loss_fn, batches, _, _ = gpt
    tg = memgraph.trace(model, loss_fn, batches[0], optimizer=make_opt(trainable(model)), fused_optimizer=True)
    plan = with_host_updates(tg, Plan(gpu_budget=1 << 40, planner="none"), 1.0)
    mg = build(tg, plan, alignment=64)
    assert verify(mg) == []
    first = min(mv.id for mv in mg.vertices if mv.stream is Stream.HOST)
    homes = {p for p in mg.homes.values() if p.where == "cpu"}
    reloads = {mv.id for mv in mg.vertices if mv.kind is Kind.RELOAD and set(mv.reads.values()) & homes}
    assert any(src in reloads for src, dst, _ in mg.edges if dst == first), \
        "a host update should wait for the reloads of the homes it overwrites"
    # nothing orders the update after anything: it may overwrite a home while a reload reads it
    broken = dataclasses.replace(mg, edges=[e for e in mg.edges if e[1] != first])
    races = [str(p) for p in verify(broken) if "race in cpu bytes" in str(p) and "(reload)" in str(p)]
    assert races and f"vertex {first} " in races[0]


def test_host_lane_is_simulated_at_the_host_rate(gpt):
    model, loss_fn, batches, _, _ = gpt
    tg = memgraph.trace(model, loss_fn, batches[0], optimizer=make_opt(trainable(model)), fused_optimizer=True)
    for v in tg.vertices:
        v.time = 1e-6
    plan = with_host_updates(tg, Plan(gpu_budget=1 << 40, planner="none"), 1.0)
    mg = build(tg, plan, alignment=64)

    rates = FixedRates(h2d_bandwidth=1e12, d2h_bandwidth=1e12,
                       host_update_rate=1.0)  # one parameter a second: the host lane is the whole step
    sim = simulate(mg, rates, backend="cpu")
    params = sum(p.numel() for p in trainable(model))
    assert sim.step_time >= params
    assert any(entry[1].startswith("host") for entry in sim.timeline)
    floor = time_floor(mg, rates, backend="cpu")  # the host lane's work is the floor here
    assert floor["host_updates"] == pytest.approx(params) and floor["floor"] == floor["host_updates"]
    assert sim.step_time >= floor["floor"] * (1 - 1e-9)


def test_candidates_add_host_variants_and_refuse_unknown_modes(gpt):
    model, loss_fn, batches, _, _ = gpt
    tg = memgraph.trace(model, loss_fn, batches[0], optimizer=make_opt(trainable(model)), fused_optimizer=True)
    updates = fused_updates(tg)
    some = next(iter(updates))
    plan = Plan(gpu_budget=1 << 40, planner="greedy", home={v: CPU for v in updates[some]})
    plans = host_update_candidates(tg, [plan], "auto")
    assert plans[0] is plan
    assert plans[1].host_update == {some} and plans[-1].host_update == set(updates)
    assert host_update_candidates(tg, [plan], "off") == [plan]
    with pytest.raises(ValueError, match="host_update"):
        host_update_candidates(tg, [plan], "sometimes")


def test_a_host_update_that_is_not_homed_on_the_cpu_is_refused(gpt):
    model, loss_fn, batches, _, _ = gpt
    tg = memgraph.trace(model, loss_fn, batches[0], optimizer=make_opt(trainable(model)), fused_optimizer=True)
    some = next(iter(fused_updates(tg)))
    with pytest.raises(ValueError, match="homed on the CPU"):
        build(tg, Plan(gpu_budget=1 << 40, planner="none", host_update={some}), alignment=64)


def mkl_threads() -> int | None:
    """MKL's thread count as the calling thread sees it (None: torch built without MKL)."""
    found = re.search(r"mkl_get_max_threads\(\) : (\d+)", torch.__config__.parallel_info())
    return int(found.group(1)) if found else None


def test_the_host_lane_runs_its_kernels_on_fewer_threads_than_the_loop():
    """The CUDA backend's host lane leaves a core to the loop thread, which polls events; the loop
    thread's own OpenMP count stays as it was, and so does MKL's, which some builds keep per process
    (the H100 machine's: a CPU step that ran after a CUDA test's host lane summed differently from
    eager's, bench/results/test_logs/cuda_tests_decf6b0.txt)."""
    before, mkl_before = torch.get_num_threads(), mkl_threads()
    lane = HostStream("test-host", threads=1)
    seen = []
    lane.submit(lambda: seen.append(torch.get_num_threads()))
    lane.synchronize()
    assert (torch.get_num_threads(), mkl_threads()) == (before, mkl_before)  # between jobs too
    lane.submit(lambda: seen.append(torch.get_num_threads()))
    lane.close()
    assert seen == [1, 1]
    assert (torch.get_num_threads(), mkl_threads()) == (before, mkl_before)
    assert host_threads() == max(1, before - 1)


def test_host_updates_without_fused_updates_are_refused_before_planning():
    """The CPU default is eager's single-tensor AdamW, which has no fused update to move."""
    model, loss_fn, batches = make_case("mlp")
    opt = torch.optim.AdamW(trainable(model), lr=1e-3)
    with pytest.raises(ValueError, match="fused_optimizer=True"):
        memgraph.compile(model, loss_fn, batches[0], optimizer=opt, budget=0.5, device="cpu", host_update="all",
                         cache=False, verbose=False)
    with pytest.raises(ValueError, match="host_update must be one of"):
        memgraph.compile(model, loss_fn, batches[0], optimizer=opt, budget=0.5, device="cpu", host_update="yes",
                         cache=False, verbose=False)


def test_the_host_lane_reports_each_unit_once_it_ran_with_its_error_and_start():
    """The books the CUDA backend keeps for its host lane (engine/completions.py), without a GPU: a
    host unit is reported only after it ran (no launch-ahead), in order, a failure as that unit's
    error, with the time the worker began it."""
    import time

    from turnip.engine.completions import EventCompletions, Lane
    from turnip.engine.host_lane import HostDone

    events = [HostDone(), HostDone()]
    stream = HostStream("test-host")
    lane = Lane(stream, compute=False, depth=4)
    assert lane.host and lane.depth == 0
    source = EventCompletions([(), ()], [False, False], {(0, 0): lane}, events)
    source.begin_step(True)
    release = HostDone()
    for unit, error in ((0, RuntimeError("update failed")), (1, None)):
        source.enqueued(lane, unit)

        def job(unit=unit, error=error):
            release.synchronize()
            lane.started[unit] = time.perf_counter()
            if error is not None:
                lane.errors[unit] = error
            events[unit].set()

        stream.submit(job)
    assert not source.poll() and not source.ready  # nothing has run: nothing is reported
    release.set()
    first, second = source.get(), source.get()
    stream.close()
    assert (first.vertex, second.vertex) == (0, 1)
    assert isinstance(first.error, RuntimeError) and second.error is None
    assert 0 < first.start <= first.end and 0 < second.start <= second.end


@pytest.mark.parametrize("devices", [2, 3])
def test_host_updates_of_a_step_over_devices_match_eager_data_parallel(devices):
    """Each parameter's update runs once, on the host lane (one for all devices: host vertices
    touch no GPU), from the gradient summed on its owner and sent down; bitwise against eager
    accumulating the devices' micro-batches with DDP's averaging, in every ordering."""
    from test_devices import eager_data_parallel, per_device

    model, loss_fn, batches = make_case("gpt")
    steps = per_device(batches, devices)
    want_state, want_losses = eager_data_parallel(model, loss_fn, steps, make_opt)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=make_opt(trainable(model)), budget=0.5,
                          device="cpu", devices=devices, fused_optimizer=True, host_update="all", cache=False,
                          verbose=False)
    host = [mv for mv in mg.vertices if mv.stream is Stream.HOST]
    assert host and len(mg.plan.host_update) == len(fused_updates(mg.taskgraph))
    assert {mg.taskgraph.vertices[mv.task_vertex].device for mv in host} == set(range(devices))  # every owner's
    assert verify(mg) == []
    for ordering, seed in [("deterministic", None), ("random", 1)]:
        mg.runtime = None
        losses = [engine.run(mg, step, ordering=ordering, seed=seed)["losses"] for step in steps]
        assert all(torch.equal(g, w) for g, w in zip(losses, want_losses, strict=True)), (ordering, losses)
        assert_same_state(mg.state_dict(), want_state)
