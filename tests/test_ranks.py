"""Several ranks (processes, compile's process_group=, trace/ranks.py) through gloo on the CPU backend:
each rank's step is its share of one step over every rank's devices, bitwise equal to eager
accumulating every rank's micro-batches in rank order with DDP's averaging; a bad configuration is
refused on every rank naming what differs; a rank that dies or hangs fails the others, naming it."""

from __future__ import annotations

import copy
import datetime
import multiprocessing
import os
import re
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from cases import bf16_autocast, make_case
from test_devices import adamw, eager_data_parallel
from turnip.ir.memgraph import Edge, Stream
from turnip.ir.taskgraph import RECV, SEND
from turnip.memgraph.segments import find_segments
from turnip.planners.costs import CostModel
from turnip.planners.model import KEEP, OFFLOAD, RECOMPUTE, step_order
from turnip.planners.problem import build_problem
from turnip.trace.ranks import WEIGHTS_BEHIND, WIRE_DEVICE, message_order, rank_slice, sliced
from turnip.trace.tracer import trace_step

from turnip import engine, memgraph

STEPS = 2
TIMEOUT_S = 240  # a whole run of ranks; each compiles the step of every rank's devices on a 2-core machine


def run_ranks(target, ranks: int, tmp_path, *args, timeout: float = TIMEOUT_S, stop_after: int | None = None,
              backend: str = "gloo", gpus_per_rank: int = 1) -> list:
    """Run ``target(rank, ranks, *args)`` in ``ranks`` spawned processes sharing a process group of
    ``backend`` (NCCL: rank r's current GPU cuda:r x gpus_per_rank); return each rank's report (what it
    returned, or its traceback). stop_after: once that rank has reported, stop the others (a rank made to hang)."""
    ctx = multiprocessing.get_context("spawn")
    run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"  # a fresh store per run: gloo's file store is single-use
    run.mkdir()
    store = str(run / "store")
    reports = [str(run / f"rank{r}.txt") for r in range(ranks)]
    procs = [ctx.Process(target=_guarded, args=(target, backend, gpus_per_rank, r, ranks, store, reports[r], *args))
             for r in range(ranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs if stop_after is None else [procs[stop_after]]:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [open(path).read() if os.path.exists(path) else "no report" for path in reports]


def _guarded(target, backend, gpus_per_rank, rank, ranks, store, report, *args) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank * gpus_per_rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=20))
    try:
        text = target(rank, ranks, *args)
    except BaseException:  # noqa: BLE001 - the parent reads the failure from the report
        text = "raised: " + traceback.format_exc()
    with open(report, "w") as f:
        f.write(text or "ok")
    os._exit(0)  # not destroy_process_group: a peer may be gone, and its barrier would wait for it


def _matches_eager(rank: int, ranks: int, local: int, budgets: list, segmented: bool = False) -> str:
    model, loss_fn, batches = make_case("gpt")
    total = ranks * local
    steps = [[batches[(s * total + d) % len(batches)] for d in range(total)] for s in range(STEPS)]
    want_state, want_losses = eager_data_parallel(model, loss_fn, steps, adamw)
    facts = []
    for budget in budgets:
        mine = copy.deepcopy(model)
        mg = memgraph.compile(mine, loss_fn, batches[0], optimizer=adamw(mine.parameters()), device="cpu",
                              devices=local, budget=budget, verbose=False)
        if segmented:  # as on CUDA: runs of kernels launched as units, received buckets' readers among them
            mg.segments = find_segments(mg)
            received = {vid for vid, mv in enumerate(mg.vertices) if mg.taskgraph.vertices[mv.task_vertex].op == RECV}
            readers = {dst for src, dst, kind in mg.edges if src in received and kind is Edge.DATA}
            assert any(readers & set(seg[1:]) for seg in mg.segments), "no segment reads a message past its start"
        problems = memgraph.verify(mg)
        assert problems == [], problems[:3]
        assert (mg.taskgraph.rank, mg.taskgraph.ranks, mg.taskgraph.devices) == (rank, ranks, local)
        assert any(mv.stream is Stream.COMM for mv in mg.vertices)
        for ordering in ("deterministic", "random"):
            for micro, want in zip(steps, want_losses):
                mine_micro = micro[rank * local:(rank + 1) * local]
                out = engine.run(mg, mine_micro if local > 1 else mine_micro[0], ordering=ordering, seed=rank + 5)
                mean = want[0]
                for loss in want[1:]:
                    mean = mean + loss
                assert torch.equal(out["loss"], mean / total), (budget, ordering, out["loss"], mean / total)
                assert torch.equal(out["losses"], want)
            got = mg.state_dict()
            for key, tensor in got.items():
                assert torch.equal(tensor, want_state[key]), (budget, ordering, key)
            facts.append(f"{budget}/{ordering}: {len(got)} entries, {mg.summary()['bytes_offloaded']} B offloaded")
            mg.release(keep=False)
    return "ok " + "; ".join(facts)


@pytest.mark.parametrize("ranks, local", [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_ranks_are_eagers_accumulation_over_every_rank_bitwise(tmp_path, ranks, local):
    reports = run_ranks(_matches_eager, ranks, tmp_path, local, [None, 0.6])
    for rank, text in enumerate(reports):
        assert text.startswith("ok"), f"rank {rank}: {text}"
    offloaded = [int(re.findall(r"(\d+) B offloaded", text)[-1]) for text in reports]
    assert min(offloaded) > 0, offloaded  # 60% really offloads, on every rank


def test_ranks_launching_segments_as_units_stay_bitwise_and_never_wait_on_each_other(tmp_path):
    """Segments (CUDA graphs on CUDA) take in the readers of a received message and the makers of a
    sent one, as they do copies between a process's devices: a rank's messages run one at a time in
    the shared tag order, and no segment may wait for a message that waits for it (a hang, caught by
    the group's timeout). Without it a rank of gpt1.3b launched 531 units a step against 162."""
    reports = run_ranks(_matches_eager, 2, tmp_path, 2, [None, 0.6], True)
    for rank, text in enumerate(reports):
        assert text.startswith("ok"), f"rank {rank}: {text}"


def _compiles_with(rank: int, ranks: int, budgets: list, widths: list) -> str:
    model, loss_fn, batches = make_case("mlp")
    if widths[rank] != widths[0]:
        model.out = torch.nn.Linear(model.out.in_features, widths[rank])
    memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(model.parameters()), device="cpu",
                     budget=budgets[rank], verbose=False)
    return "compiled"


def test_ranks_compiling_differently_are_refused_naming_what_differs(tmp_path):
    reports = run_ranks(_compiles_with, 2, tmp_path, [None, 0.5], [10, 10])
    for text in reports:
        assert "UnsupportedFeature" in text and "differ in 'budget'" in text and "rank 1 has" in text, text
    reports = run_ranks(_compiles_with, 2, tmp_path, [None, None], [10, 12])
    for text in reports:
        assert "differ in 'model parameters'" in text, text


def _one_fails(rank: int, ranks: int, how: str) -> str:
    model, loss_fn, batches = make_case("mlp")
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(model.parameters()), device="cpu",
                          verbose=False)
    engine.run(mg, batches[rank])  # a whole step on every rank first
    if rank == 1:
        if how == "dies":
            os._exit(3)
        time.sleep(120)  # hangs: the parent stops it once rank 0 has reported
    started = time.monotonic()
    try:
        engine.run(mg, batches[rank])
    except Exception as err:  # noqa: BLE001 - what the user sees is the point
        return f"failed after {time.monotonic() - started:.1f}s: {type(err).__name__}: {err}"
    return "ran"


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_rank_that_dies_or_hangs_fails_the_others_naming_it(tmp_path, how):
    rank0 = run_ranks(_one_fails, 2, tmp_path, how, stop_after=0)[0]
    assert rank0.startswith("failed after"), rank0
    assert "rank 1" in rank0, rank0
    seconds = float(rank0.split()[2].rstrip("s:"))
    assert seconds < 60, rank0  # the group's timeout is 20 s


def test_a_received_value_is_never_made_again_nor_read_by_a_recomputation():
    """A rank's planner sees receives like any forward op making a value, and an autocast cast
    received from its owner (casts travel) is the kind of value plans recompute: a second receive
    would wait for a send its peer never posts. No option of the planner's problem runs one again."""
    model, loss_fn, batches = make_case("gpt")
    mine = copy.deepcopy(model)
    step = trace_step(mine, bf16_autocast(loss_fn), batches[0], optimizer=adamw(mine.parameters()), device="cpu",
                      devices=2)
    graph = step.finished(casts_travel=True)
    for rank in (0, 1):
        tg = rank_slice(graph, rank, 2, order=step_order(graph))
        CostModel(device="cpu").annotate(tg)
        problem = build_problem(tg, 1 << 40, bw_h2d=1e10, bw_d2h=1e10, alignment=64)
        received = {v.id for v in tg.vertices if v.op == RECV}
        assert any(g.vertex in received for g in problem.groups)  # received casts are saved for the backward
        for g in problem.groups:
            if g.vertex in received or received & set(g.chain):
                assert {o.kind for o in g.options} <= {KEEP, OFFLOAD}, (rank, g.vertex, g.chain)
        assert any(o.kind == RECOMPUTE for g in problem.groups for o in g.options)  # others still may


def test_a_rank_of_several_devices_sends_and_receives_on_its_first_device_only():
    """NCCL binds a rank's end of a link to one GPU: every message of a rank with two devices is on its
    wire device, and a value living on the other device crosses it by a copy before its send or after
    its receive (the gradient buckets do, in both directions)."""
    model, loss_fn, batches = make_case("gpt")
    mine = copy.deepcopy(model)
    step = trace_step(mine, loss_fn, batches[0], optimizer=adamw(mine.parameters()), device="cpu", devices=4)
    graph = step.finished()
    for rank in (0, 1):
        tg = rank_slice(graph, rank, 2, order=step_order(graph))
        messages = [v for v in tg.vertices if v.op in (SEND, RECV)]
        assert messages and all(v.device == WIRE_DEVICE for v in messages)
        made_by = {x: v for v in tg.vertices for x in v.outputs}
        copies = [v for v in tg.vertices if v.op == "aten::_to_copy"]
        staged_sends = [v for v in messages if v.op == SEND and v.args[0].value in made_by
                        and made_by[v.args[0].value] in copies
                        and tg.values[made_by[v.args[0].value].args[0].value].device != WIRE_DEVICE]
        received = {x for v in messages if v.op == RECV for x in v.outputs}
        staged_receives = [v for v in copies if v.args[0].value in received and v.device != WIRE_DEVICE]
        assert staged_sends and staged_receives, rank


def test_a_value_several_devices_of_a_rank_read_crosses_to_it_once():
    """The owner's updated weights go to every other device; two devices of one rank get them in one
    message to its wire device, the other copying them on from there (the bytes between ranks of the
    test gpt over 2 ranks x 2 devices: 2.6 MB a step, where a message per device moved 3.5)."""
    model, loss_fn, batches = make_case("gpt")
    mine = copy.deepcopy(model)
    step = trace_step(mine, loss_fn, batches[0], optimizer=adamw(mine.parameters()), device="cpu", devices=4)
    graph = step.finished()
    order = message_order(graph, step_order(graph), 2)
    for rank in (0, 1):
        part = sliced(graph, rank, 2, order=order)
        carried = [graph.transfer_source(graph.vertices[part.vertices[v.id]]) for v in part.taskgraph.vertices
                   if v.op == RECV and part.vertices[v.id] >= 0]  # not the losses every rank is sent
        assert carried and len(carried) == len(set(carried)), rank
        optimizer_phase = [v for v in part.taskgraph.vertices if v.op == RECV and v.phase == "optimizer"]
        assert optimizer_phase, rank  # the weights are among them


@pytest.mark.parametrize("behind", [3, WEIGHTS_BEHIND])
def test_weights_sent_after_their_update_go_out_some_buckets_later(behind):
    """message_order: a rank's messages run one at a time in the shared order, so an updated weight
    that crosses ranks goes out ``behind`` messages after its update's place (with step_order alone
    each followed its bucket, and the owner's update sat inside the next bucket's wait); by default
    after every bucket. The order stays topological."""
    model, loss_fn, batches = make_case("gpt")
    mine = copy.deepcopy(model)
    step = trace_step(mine, loss_fn, batches[0], optimizer=adamw(mine.parameters()), device="cpu", devices=2)
    graph = step.finished()
    before = step_order(graph)
    order = message_order(graph, before, 2, behind=behind)
    assert sorted(order) == list(range(len(graph.vertices)))
    position = {vid: i for i, vid in enumerate(order)}
    for vertex in graph.vertices:
        for value in vertex.inputs():
            producer = graph.values[value].producer
            assert producer < 0 or position[producer] < position[vertex.id], (producer, vertex.id)
    crossing = [v.id for v in graph.vertices if graph.transfer_source(v) is not None
                and graph.values[graph.transfer_source(v)].device != v.device]
    weights = [vid for vid in crossing if graph.vertices[vid].phase == "optimizer"]
    buckets = [vid for vid in crossing if graph.vertices[vid].phase != "optimizer"]
    assert weights and buckets
    old = {vid: i for i, vid in enumerate(before)}
    for w in weights:  # the buckets that came after it in step_order and now come before it
        passed = sum(old[b] > old[w] and position[b] < position[w] for b in buckets)
        later = sum(old[b] > old[w] for b in buckets)
        assert passed >= (later if behind is None else min(behind, later)), (w, passed, later)
    for rank in (0, 1):
        phases = [v.phase for v in rank_slice(graph, rank, 2, order=order).vertices if v.op in (SEND, RECV)]
        last_bucket = len(phases) - 1 - phases[::-1].index("backward")
        assert ("optimizer" in phases[:last_bucket]) == (behind is not None), (rank, phases)


def data_parallel_steps(batches: list, ranks: int) -> list[list]:
    """Per step, every rank's micro-batch in rank order."""
    return [[batches[(s * ranks + r) % len(batches)] for r in range(ranks)] for s in range(STEPS)]


def eager_step(model, opt, loss_fn, micro_batches: list) -> None:
    """One eager step as DDP makes it: every micro-batch accumulated in order, then averaged."""
    opt.zero_grad()
    for batch in micro_batches:
        loss_fn(model, batch).backward()
    for p in model.parameters():
        p.grad /= len(micro_batches)
    opt.step()


def _saves_resumes_and_gathers(rank: int, ranks: int, folder: str) -> str:
    model, loss_fn, batches = make_case("gpt")
    steps = data_parallel_steps(batches, ranks)
    eager = copy.deepcopy(model)
    eager_opt = adamw(eager.parameters())
    for micro in steps:  # eager_data_parallel's loop, keeping the optimizer
        eager_step(eager, eager_opt, loss_fn, micro)
    mine = copy.deepcopy(model)
    opt = adamw(mine.parameters())
    mg = memgraph.compile(mine, loss_fn, batches[0], optimizer=opt, device="cpu", budget=0.6, verbose=False)
    engine.run(mg, steps[0][rank])
    path = os.path.join(folder, f"rank{rank}.mg")
    mg.save(path)
    mg.release(keep=False)
    resumed = memgraph.load(path, optimizer=opt)  # as a new process would, after its own compile's opt
    resumed.process_group = dist.group.WORLD
    engine.run(resumed, steps[1][rank])
    state = memgraph.gather_state_dict(resumed)
    optimizer = memgraph.gather_optimizer_state_dict(resumed)
    if rank != 0:
        assert state is None and optimizer is None
        return "ok"
    want = eager.state_dict()
    assert sorted(state) == sorted(want)
    for key, tensor in want.items():
        assert torch.equal(state[key], tensor), key
    want_opt = eager_opt.state_dict()
    assert sorted(optimizer["state"]) == sorted(want_opt["state"])
    for index, entry in want_opt["state"].items():
        for key, value in entry.items():
            assert torch.equal(optimizer["state"][index][key].to(value.dtype), value), (index, key)
    return "ok"


def test_a_rank_saved_and_loaded_goes_on_bitwise_and_its_state_gathers_whole(tmp_path):
    reports = run_ranks(_saves_resumes_and_gathers, 2, tmp_path, str(tmp_path))
    for rank, text in enumerate(reports):
        assert text.startswith("ok"), f"rank {rank}: {text}"
