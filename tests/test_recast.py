"""memgraph/remake_offloaded.py: values the builder evicted, recomputed from GPU-homed weights instead of reloaded."""

from __future__ import annotations

import dataclasses

import torch
from cases import OPTIMIZERS, assert_same_state, bf16_autocast, eager_steps, make_case, trainable
from turnip.ir.memgraph import Kind
from turnip.ir.optimizer import CompiledOptimizer
from turnip.ir.taskgraph import ValueKind
from turnip.memgraph.builder import build
from turnip.memgraph.checker import verify
from turnip.memgraph.remake_offloaded import recompute_evicted
from turnip.planners.costs import default_costs

from turnip import engine, memgraph


def reloaded(mg) -> set[int]:
    return {mv.value for mv in mg.vertices if mv.kind is Kind.RELOAD}


def trains_as_eager(mg, tg, model, loss_fn, batches, make_opt) -> None:
    """Run a MemGraph built by hand (with what compile adds) for the batches: bitwise eager's steps."""
    mg.initial_state, mg.names, mg.device = dict(tg.initial_state), dict(tg.state_names), "cpu"
    mg.optimizer = CompiledOptimizer(mg, make_opt(trainable(model)))
    want_losses, want_state = eager_steps(model, loss_fn, batches, make_opt)
    torch.manual_seed(123)
    got = [engine.run(mg, b)["loss"] for b in batches]
    assert all(torch.equal(g, w) for g, w in zip(got, want_losses))
    assert_same_state(mg.state_dict(), want_state)


def evicting_build():
    """A step the builder alone fits into 90% of its peak (planner "none"): under bf16 autocast it
    evicts the bf16 copies of weights that the backward reads again."""
    model, loss_fn, batches = make_case("gpt")
    mixed = bf16_autocast(loss_fn)
    make_opt = OPTIMIZERS["adamw"]
    mg = memgraph.compile(model, mixed, batches[0], optimizer=make_opt(trainable(model)), budget=0.9, device="cpu",
                          planner="none", verbose=False)
    return model, mixed, batches, make_opt, mg


def test_evicted_weight_casts_are_recomputed_bitwise():
    model, mixed, batches, make_opt, mg = evicting_build()
    tg = mg.taskgraph  # the plan recomputes nothing: the built graph's TaskGraph is the traced one
    amended = recompute_evicted(tg, mg.plan, mg, default_costs(tg))
    assert amended is not None and amended.recompute and not mg.plan.recompute
    evicted = {mv.value for mv in mg.vertices if mv.kind is Kind.OFFLOAD}
    for rc in amended.recompute:
        vertex = tg.vertices[rc.vertex]
        assert vertex.phase == "forward" and vertex.outputs[0] in evicted
        assert all(tg.values[x].kind is ValueKind.PARAMETER for x in vertex.inputs())
    fixed = build(tg, amended, alignment=mg.alignment)
    verify(fixed)
    recast = {tg.vertices[rc.vertex].outputs[0] for rc in amended.recompute}
    assert recast <= reloaded(mg) and not recast & reloaded(fixed)  # made again, never fetched back
    trains_as_eager(fixed, tg, model, mixed, batches, make_opt)


def test_nothing_to_amend_without_evictions():
    model, loss_fn, batches = make_case("gpt")
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS["adamw"](trainable(model)), device="cpu",
                          verbose=False)  # no budget: everything kept
    assert recompute_evicted(mg.taskgraph, mg.plan, mg, default_costs(mg.taskgraph)) is None


class SlowLink:
    """Prices copies only: this tiny model's cast (4 KiB) beats a 1 MB/s link, not the analytic one."""

    def transfer_time(self, nbytes: int, direction: str) -> float:
        return nbytes / 1e6


def test_a_cast_the_plan_offloads_is_recomputed_instead():
    """A plan may offload a weight's bf16 copy itself (its model prices the copy as hidden): the
    amendment takes it out of plan.offload and recomputes it, bitwise."""
    model, loss_fn, batches = make_case("gpt")
    mixed, make_opt = bf16_autocast(loss_fn), OPTIMIZERS["adamw"]
    kept = memgraph.compile(model, mixed, batches[0], optimizer=make_opt(trainable(model)), device="cpu",
                            verbose=False)  # no budget: a plan that keeps everything
    tg = kept.taskgraph
    readers = tg.consumers()
    cast = next(v.outputs[0] for v in tg.vertices if v.op == "aten::_to_copy" and v.phase == "forward"
                and all(tg.values[x].kind is ValueKind.PARAMETER for x in v.inputs())
                and any(tg.vertices[r].phase == "backward" for r in readers[v.outputs[0]]))
    plan = dataclasses.replace(kept.plan, offload={cast}, gpu_budget=1 << 40)
    offloading = build(tg, plan, alignment=kept.alignment)
    assert cast in reloaded(offloading)
    amended = recompute_evicted(tg, plan, offloading, SlowLink())
    assert amended is not None and amended.offload == set()
    assert [tg.vertices[rc.vertex].outputs[0] for rc in amended.recompute] == [cast]
    fixed = build(tg, amended, alignment=kept.alignment)
    assert not any(mv.kind in (Kind.OFFLOAD, Kind.RELOAD) for mv in fixed.vertices)
    trains_as_eager(fixed, tg, model, mixed, batches, make_opt)


def test_a_runner_up_close_behind_is_amended_and_taken_where_it_then_runs_fastest(monkeypatch):
    """compile's pick among built candidates (build_candidates): the fastest is amended, and so is every
    candidate simulated within AMEND_WITHIN of it, since the builder's evictions alone may slow it; the
    fastest after amending wins. One further behind is not amended (a build and a simulation saved)."""
    from turnip.ir.plan import Plan
    from turnip.memgraph import compiler

    @dataclasses.dataclass(eq=False)
    class Candidate:  # what build_candidates reads of a MemGraph
        plan: Plan
        stats: dict

    def candidate(planner: str, seconds: float) -> Candidate:
        return Candidate(Plan(gpu_budget=1, planner=planner), {"simulated_step_s": seconds})

    fastest, close, far = candidate("ilp", 0.200), candidate("greedy", 0.208), candidate("greedy", 0.300)
    built = [compiler.Built(k, mg.plan, "ahead", mg) for k, mg in enumerate([fastest, close, far])]
    monkeypatch.setattr(compiler, "built_walks", lambda *args, **kwargs: (list(built), []))
    amended = {id(close): candidate("greedy", 0.195)}  # its eviction recomputed
    asked = []

    def amend(tg, mg, walk, alignment, costs, backend):
        asked.append(mg)
        found = amended.get(id(mg))
        if found is None:
            return mg
        found.stats["simulated_candidates"] = {"greedy+recomputed evictions": 0.195}
        return found

    monkeypatch.setattr(compiler, "amended_if_faster", amend)
    assert compiler.AMEND_WITHIN * 0.200 >= 0.208
    picked, walk, _ = compiler.build_candidates(None, [mg.plan for mg in (fastest, close, far)], 64, None, "cuda")
    assert picked is amended[id(close)] and walk == "ahead"
    assert asked == [fastest, close]  # the far one was never amended
    assert set(picked.stats["simulated_candidates"]) > {"greedy+recomputed evictions"}  # the others' times kept
