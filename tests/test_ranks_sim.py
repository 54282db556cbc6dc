"""engine.simulate_ranks: every rank's MemGraph of one step on one virtual clock, a message moving only
once both of its ranks have posted it (engine/ranks_sim.py)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from cases import make_case
from test_devices import adamw
from turnip.engine.timing_sim import nominal_durations
from turnip.ir.memgraph import Kind, Stream
from turnip.ir.plan import Plan
from turnip.memgraph.builder import build
from turnip.memgraph.segments import find_segments
from turnip.planners.costs import CostModel
from turnip.planners.model import step_order
from turnip.trace.ranks import message_order, rank_slice
from turnip.trace.tracer import trace_step

from turnip import engine


@pytest.fixture(scope="module")
def two_ranks():
    """The MemGraphs of 2 ranks x 2 devices of the test gpt, everything kept, segments as on CUDA."""
    model, loss_fn, batches = make_case("gpt")
    mine = copy.deepcopy(model)
    step = trace_step(mine, loss_fn, batches[0], optimizer=adamw(mine.parameters()), device="cpu", devices=4)
    graph = step.finished()
    order = message_order(graph, step_order(graph), 2)
    costs = CostModel(device="cpu")
    mgs = []
    for rank in (0, 1):
        tg = rank_slice(graph, rank, 2, order=order)
        costs.annotate(tg)
        mg = build(tg, Plan(gpu_budget=1 << 40, planner="none"), alignment=64, compact=True)
        mg.segments = find_segments(mg)
        mgs.append(mg)
    return mgs, costs


def _messages(mg, result) -> dict[tuple[int, int], tuple[float, float]]:
    """(sender, tag) -> (start, end) of each message unit of ``mg`` in ``result``."""
    out = {}
    for span in result.timeline:
        mv = mg.vertices[span.vertex]
        if mv.stream is Stream.COMM:
            task = mg.taskgraph.vertices[mv.task_vertex]
            sender = mg.taskgraph.rank if task.op.endswith("send") else int(task.kwargs["peer"])
            out[(sender, int(task.kwargs["tag"]))] = (span.start, span.end)
    return out


def test_both_ends_of_a_message_end_together_and_waiting_makes_no_step_shorter(two_ranks):
    mgs, costs = two_ranks
    joint = engine.simulate_ranks(mgs, costs)
    solo = [engine.simulate(mg, costs) for mg in mgs]
    ends = [_messages(mg, res) for mg, res in zip(mgs, joint)]
    assert ends[0] and set(ends[0]) == set(ends[1])
    for key, (_, end) in ends[0].items():
        assert end == pytest.approx(ends[1][key][1], abs=1e-12), key
    assert max(r.step_time for r in joint) >= max(r.step_time for r in solo) - 1e-12
    # alone, each rank's messages never wait, so some of the joint ones must have (the ranks differ)
    assert max(r.step_time for r in joint) > max(r.step_time for r in solo) * 1.01


def test_a_slow_rank_holds_up_its_peer_through_their_messages(two_ranks):
    """Rank 1's kernels three times as long: rank 0's own work is unchanged, so alone it simulates
    the same step, while beside rank 1 it waits for rank 1's messages and ends later."""
    mgs, costs = two_ranks
    nominal = [nominal_durations(mg, costs) for mg in mgs]
    as_given = [dict(enumerate(seconds)) for seconds in nominal]
    slow = {vid: t * (3 if mgs[1].vertices[vid].kind is Kind.COMPUTE else 1) for vid, t in enumerate(nominal[1])}
    before = engine.simulate_ranks(mgs, as_given)
    after = engine.simulate_ranks(mgs, [as_given[0], slow])
    assert after[1].step_time > 2 * before[1].step_time
    assert after[0].step_time > 1.5 * before[0].step_time


def test_the_memgraphs_of_one_step_in_rank_order_are_required(two_ranks):
    mgs, costs = two_ranks
    with pytest.raises(ValueError, match="rank order"):
        engine.simulate_ranks(list(reversed(mgs)), costs)
    with pytest.raises(ValueError, match="rank order"):
        engine.simulate_ranks(mgs[:1], costs)


def test_a_message_on_a_device_slows_its_compute(two_ranks):
    """NCCL's kernel holds SMs while a message is on the GPU, moving or spinning for its peer: with
    compute at half speed beside a message, a rank's kernels take longer in all, by at most the time
    messages are on its device (each second of overlap at half speed costs at most one more)."""
    mgs, costs = two_ranks
    assert costs.compute_beside_messages == 1.0  # the CPU backend: gloo's messages run on threads of their own

    def on_cuda(share):
        return CostModel(device="cuda", measure=False, spec=dataclasses.replace(costs.spec, compute_beside_messages=share))

    before = engine.simulate_ranks(mgs, on_cuda(1.0))
    after = engine.simulate_ranks(mgs, on_cuda(0.5))
    for mg, b, a in zip(mgs, before, after):
        messages_on = sum(s.end - s.start for s in a.timeline if mg.vertices[s.vertex].stream is Stream.COMM)
        assert b.compute_busy < a.compute_busy <= b.compute_busy + messages_on + 1e-12
    assert max(r.step_time for r in after) > max(r.step_time for r in before)
