"""Several devices in one MemGraph (compile's devices=, trace/data_parallel.py) on the CPU backend's
virtual devices: bitwise equal to eager accumulating the devices' micro-batches in device order with
every gradient then divided by their count (DDP's averaging), for every ordering and budget."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from cases import bf16_autocast, make_case
from turnip.ir.batch import BatchError
from turnip.ir.errors import InfeasibleBudget
from turnip.ir.memgraph import Edge, Stream
from turnip.ir.optimizer import CompiledOptimizer
from turnip.ir.plan import Plan, Recompute
from turnip.ir.sizes import aligned
from turnip.ir.taskgraph import RECV
from turnip.memgraph import compiler
from turnip.memgraph.builder import build, build_walks
from turnip.memgraph.keep_transfers import keep_transfers
from turnip.memgraph.per_device import cast_again_at_the_source
from turnip.planners.costs import CostModel
from turnip.planners.driver import make_problem
from turnip.planners.model import RECOMPUTE, step_order
from turnip.trace.errors import UnsupportedFeature
from turnip.trace.ranks import sliced
from turnip.trace.tracer import trace_step

from turnip import engine, memgraph


def eager_data_parallel(model, loss_fn, steps: list[list], make_opt, max_grad_norm=None):
    """The reference: per step, each device's micro-batch forward and backward accumulated in
    device order, every gradient divided by the device count, clipping, one update."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses = []
    for micro_batches in steps:
        opt.zero_grad()
        step_losses = []
        for batch in micro_batches:
            loss = loss_fn(model, batch)
            loss.backward()
            step_losses.append(loss.detach())
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= len(micro_batches)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(torch.stack(step_losses))
    return model.state_dict(), losses


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def traced_on_devices(model, loss_fn, batch, optimizer, devices: int, casts_travel: bool = False):
    """The step traced on ``devices`` virtual CPU devices and priced by the analytic cost model:
    (TaskGraph, CostModel)."""
    tg = trace_step(model, loss_fn, batch, optimizer=optimizer, device="cpu", devices=devices).finished(
        casts_travel=casts_travel)
    costs = CostModel(device="cpu")
    costs.annotate(tg)
    return tg, costs


def per_device(batches: list, devices: int, steps: int = 2) -> list[list]:
    return [[batches[(s * devices + d) % len(batches)] for d in range(devices)] for s in range(steps)]


@pytest.fixture(scope="module")
def gpt_case():
    return make_case("gpt")


def compiled(case, devices: int, budget=None, max_grad_norm=None, **options):
    model, loss_fn, batches = case
    model = copy.deepcopy(model)
    return memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(model.parameters()), device="cpu",
                            devices=devices, budget=budget, max_grad_norm=max_grad_norm, verbose=False, **options)


def assert_matches_eager(mg, case, devices, ordering="nondeterministic", seed=None, max_grad_norm=None,
                         make_opt=adamw):
    model, loss_fn, batches = case
    steps = per_device(batches, devices)
    want_state, want_losses = eager_data_parallel(model, loss_fn, steps, make_opt, max_grad_norm)
    for micro_batches, want in zip(steps, want_losses):
        if devices == 1:  # the ordinary step: one batch, one loss
            assert torch.equal(engine.run(mg, micro_batches[0], ordering=ordering, seed=seed)["loss"], want[0])
            continue
        out = engine.run(mg, micro_batches, ordering=ordering, seed=seed)
        assert torch.equal(out["losses"], want)
        mean = want[0]
        for loss in want[1:]:
            mean = mean + loss
        assert torch.equal(out["loss"], mean / devices)
    got = mg.state_dict()
    for key, tensor in want_state.items():
        assert torch.equal(got[key], tensor), key
    mg.release(keep=False)


@pytest.mark.parametrize("devices", [1, 2, 3])
@pytest.mark.parametrize("ordering", ["deterministic", "nondeterministic", "random"])
def test_gpt_on_virtual_devices_is_eagers_averaged_accumulation_bitwise(gpt_case, devices, ordering):
    mg = compiled(gpt_case, devices)
    assert memgraph.verify(mg) == []
    assert mg.taskgraph.devices == devices
    assert_matches_eager(mg, gpt_case, devices, ordering, seed=7 if ordering == "random" else None)


@pytest.mark.parametrize("fraction", [0.85, 0.7])
def test_smaller_budgets_evict_per_device_and_stay_bitwise(gpt_case, fraction):
    whole = compiled(gpt_case, 2)
    peak = whole.stats["unplanned_peak"]
    mg = compiled(gpt_case, 2, budget=fraction)
    assert memgraph.verify(mg) == []
    assert mg.arena_bytes + mg.taskgraph.step_workspace() <= int(fraction * peak)
    assert mg.summary()["bytes_offloaded"] > 0  # the budget really bites
    for ordering in ("deterministic", "random"):
        assert_matches_eager(mg, gpt_case, 2, ordering, seed=3)


@pytest.mark.parametrize("planner, fraction", [("greedy", 0.5), ("ilp", 0.35)])
def test_planned_budgets_home_weights_on_the_host_and_stay_bitwise(gpt_case, planner, fraction):
    model, loss_fn, batches = gpt_case
    mine = copy.deepcopy(model)
    mg = memgraph.compile(mine, loss_fn, batches[0], optimizer=adamw(mine.parameters()), device="cpu", devices=2,
                          budget=fraction, planner=planner, verbose=False)
    assert memgraph.verify(mg) == []
    # the ILP returns greedy's plan when it finds none better in time; each device's share planned on its own
    assert mg.plan.planner in (planner, "greedy", "greedy/per-device")
    assert mg.arena_bytes + mg.taskgraph.step_workspace() <= mg.plan.gpu_budget  # each device within its budget
    for ordering in ("nondeterministic", "random"):
        assert_matches_eager(mg, gpt_case, 2, ordering, seed=5)


def test_clipping_sees_the_averaged_gradient(gpt_case):
    mg = compiled(gpt_case, 2, max_grad_norm=0.05)
    assert_matches_eager(mg, gpt_case, 2, max_grad_norm=0.05)


def test_every_vertex_runs_where_its_values_live(gpt_case):
    mg = compiled(gpt_case, 3)
    tg = mg.taskgraph
    transfers = 0
    for v in tg.vertices:
        source = tg.transfer_source(v)
        transfers += source is not None
        for x in v.inputs():
            assert tg.values[x].device == v.device or x == source, (v.id, v.op, x)
    assert transfers > 0
    lanes = {(mv.stream, p.device) for mv in mg.vertices for p in mv.writes.values() if p.where == "gpu"}
    assert {d for s, d in lanes if s is Stream.COMPUTE} == {0, 1, 2}
    assert {s for s, d in lanes} >= {Stream.COMPUTE, Stream.D2D}


def test_updates_and_states_are_split_between_owners(gpt_case):
    mg = compiled(gpt_case, 2)
    tg = mg.taskgraph
    state_bytes = [0, 0]
    for v in tg.values:
        if v.kind.value == "optimizer_state" and v.shape:
            state_bytes[v.device] += v.nbytes
    assert min(state_bytes) > 0.3 * sum(state_bytes)  # each device holds a share, not a copy
    on = {v.device for v in tg.vertices if v.phase == "optimizer" and tg.transfer_source(v) is None}
    assert on == {0, 1}


def test_one_batch_with_twice_the_rows_is_split_between_the_devices(gpt_case):
    _, _, batches = gpt_case
    mg = compiled(gpt_case, 2)
    a, b = batches[0], batches[1]
    joined = torch.cat([a, b]) if isinstance(a, torch.Tensor) else type(a)(torch.cat(p) for p in zip(a, b))
    first = engine.run(mg, joined)["losses"]
    mg.release(keep=False)
    assert torch.equal(first, engine.run(mg, [a, b])["losses"])
    with pytest.raises(BatchError, match="2 x"):
        engine.run(mg, a)  # one device's rows only
    with pytest.raises(BatchError, match="device 1 of 2"):
        engine.run(mg, [a, a[:1] if isinstance(a, torch.Tensor) else type(a)(t[:1] for t in a)])


def test_saved_and_loaded_keeps_its_devices(gpt_case, tmp_path):
    mg = compiled(gpt_case, 2)
    _, _, batches = gpt_case
    engine.run(mg, [batches[0], batches[1]])
    mg.save(tmp_path / "two.mg")
    loaded = memgraph.load(tmp_path / "two.mg")
    assert loaded.taskgraph.devices == 2
    a = engine.run(mg, [batches[2], batches[0]])["loss"]
    b = engine.run(loaded, [batches[2], batches[0]])["loss"]
    assert torch.equal(a, b)


@pytest.mark.parametrize("devices, match", [(0, "positive"), ("two", "positive"), (["cpu", "cuda:0"], "kind")])
def test_bad_devices_are_refused_before_tracing(devices, match):
    model, loss_fn, batches = make_case("mlp")
    with pytest.raises(UnsupportedFeature, match=match):
        memgraph.compile(model, loss_fn, batches[0], device="cpu", devices=devices, verbose=False)


def test_devices_with_accumulation_is_refused_clearly():
    model, loss_fn, batches = make_case("mlp")
    with pytest.raises(UnsupportedFeature, match="accumulation_steps"):
        memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(model.parameters()), device="cpu", devices=2,
                         accumulation_steps=2, verbose=False)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() > 64, reason="needs a host without 65 GPUs")
def test_more_gpus_than_the_host_has_is_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, loss_fn, batches = make_case("mlp", device="cuda")
    with pytest.raises(UnsupportedFeature, match="GPUs were asked for"):
        memgraph.compile(model, loss_fn, batches[0], device="cuda", devices=65, verbose=False)


def test_segments_stay_on_one_device_and_launch_as_units(gpt_case):
    from turnip.memgraph.segments import find_segments, segment_problems

    mg = compiled(gpt_case, 2)
    segments = find_segments(mg)
    assert segments  # the devices interleave in the serial order: runs are kept per device
    for seg in segments:
        devices = {p.device for vid in seg for p in mg.vertices[vid].writes.values() if p.where == "gpu"}
        assert len(devices) == 1
    mg.segments = segments
    assert segment_problems(mg) == []
    assert memgraph.verify(mg) == []


def _batchnorm_case():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4))

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    return model, loss_fn, [(torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))) for _ in range(3)]


@pytest.mark.parametrize("name", ["dropout", "batchnorm"])
@pytest.mark.parametrize("devices", [2, 3])
def test_dropout_and_batchnorm_statistics_follow_eagers_device_order(name, devices):
    """Eager's loop draws device 0's dropout masks, then device 1's, ..., from one generator, and
    updates BatchNorm's running statistics with each micro-batch in turn: so does the step."""
    case = make_case("gpt", dropout=0.1) if name == "dropout" else _batchnorm_case()
    model, loss_fn, batches = case
    mine = copy.deepcopy(model)
    mg = memgraph.compile(mine, loss_fn, batches[0], optimizer=adamw(mine.parameters()), device="cpu",
                          devices=devices, verbose=False)
    steps = per_device(batches, devices)
    torch.manual_seed(11)
    want, want_losses = eager_data_parallel(model, loss_fn, steps, adamw)
    torch.manual_seed(11)
    for micro_batches, losses in zip(steps, want_losses):
        assert torch.equal(engine.run(mg, micro_batches, ordering="random", seed=2)["losses"], losses)
    got = mg.state_dict()
    for key, tensor in want.items():  # running_mean / running_var / num_batches_tracked included
        assert torch.equal(got[key], tensor), key


def _transfers(tg) -> list:
    return [v for v in tg.vertices if tg.transfer_source(v) is not None]


@pytest.mark.parametrize("bucket_bytes", [1, 1 << 40])
def test_gradients_and_weights_move_in_buckets_and_stay_bitwise(gpt_case, monkeypatch, bucket_bytes):
    """One transfer per bucket of gradients (device to owner) and per bucket of updated weights (owner
    to device), the sums reading their views of it: bitwise whether each gradient has a bucket of its
    own (1 byte) or the model's share caps them (BUCKETS_PER_OWNER)."""
    from turnip.trace import data_parallel

    monkeypatch.setattr(data_parallel, "BUCKET_BYTES", bucket_bytes)
    mg = compiled(gpt_case, 2)
    tg = mg.taskgraph
    params = [v for v in tg.values if v.kind.value == "parameter"]
    moved = [tg.values[tg.transfer_source(v)] for v in _transfers(tg)]
    buckets = [val for val in moved if val.name in ("bucket", "weights")]
    sent = sum(1 for vertex in tg.vertices if vertex.op == "aten::cat" and tg.values[vertex.outputs[0]].name == "bucket")
    if bucket_bytes == 1:  # on two devices each gradient is sent once (to its owner), each weight refreshed once
        assert sent == len(params) and len(buckets) == 2 * len(params)
    else:  # capped at the model's share: each bucket within the cap, or a larger value alone
        cap = sum(p.nbytes for p in params) // (2 * data_parallel.BUCKETS_PER_OWNER)
        joined = [vertex for vertex in tg.vertices if vertex.op == "aten::cat" and
                  tg.values[vertex.outputs[0]].name in ("bucket", "weights")]
        assert all(tg.values[v.outputs[0]].nbytes <= cap or len(v.args[0]) == 1 for v in joined)
        assert len(buckets) < len(params)  # against 2 * len(params) transfers without buckets
    assert len(buckets) >= 2  # gradients one way, weights the other
    assert_matches_eager(mg, gpt_case, 2, ordering="random", seed=3)


def test_a_plan_a_device_cannot_hold_is_made_again_for_less():
    """built_on_every_device: a plan whose share on one device needs more than its budget is made
    again for budget / need of the budget (and for at least 5% less), until it builds; one device, or
    the last plan, raises the builder's refusal as it was."""

    scales = []

    def build_plans(plans):
        if plans[0] > 0.7:  # this plan leaves a device short: it needs 1250 of its 1000
            raise InfeasibleBudget("short", minimum=1250)
        return f"built {plans[0]:.2f}", None

    def replan(scale):
        scales.append(scale)
        return [scale]

    assert compiler.built_on_every_device([1.0], build_plans, replan, 1000, 2) == "built 0.64"
    assert scales == [0.8, 0.8 * 0.8]
    with pytest.raises(InfeasibleBudget):  # on one device the refusal stands
        compiler.built_on_every_device([1.0], build_plans, replan, 1000, 1)

    scales.clear()  # a device a hair short: each plan again for 5% less, not for 99.6%

    def hair_short(plans):
        if plans[0] > 0.92:
            raise InfeasibleBudget("short", minimum=1004)
        return f"built {plans[0]:.4f}", None

    assert compiler.built_on_every_device([1.0], hair_short, replan, 1000, 2) == "built 0.9025"
    assert scales == [0.95, 0.95 * 0.95]

    def never(plans):
        raise InfeasibleBudget("short", minimum=1100)

    with pytest.raises(InfeasibleBudget):
        compiler.built_on_every_device([1.0], never, lambda scale: [scale], 1000, 2)


@pytest.fixture(scope="module")
def autocast_case():
    model, loss_fn, batches = make_case("gpt")
    return model, bf16_autocast(loss_fn), batches


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("budget", [0.45, 0.35])
def test_weights_cast_for_autocast_are_cast_once_on_their_owner_and_stay_bitwise(autocast_case, devices, budget):
    """Under bf16 autocast, weight_layout "casts": each Linear weight is cast on its owner, once
    for every device, and the devices receive the cast: no replica of it anywhere, and eager's
    numbers bit for bit."""
    mg = compiled(autocast_case, devices, budget=budget, weight_layout="casts")
    assert memgraph.verify(mg) == []
    tg = mg.taskgraph
    weight_casts = [v for v in tg.vertices if v.op == "aten::_to_copy" and v.phase == "forward"
                    and tg.values[next(iter(v.inputs()))].kind.value == "parameter"]
    assert weight_casts and all(tg.values[next(iter(v.inputs()))].device == v.device for v in weight_casts)
    cast_weights = [next(iter(v.inputs())) for v in weight_casts]
    assert len(cast_weights) == len(set(cast_weights))  # once, not once per micro-batch
    produced = {o for v in tg.vertices for o in v.outputs}
    assert all(v.id in produced for v in tg.values if v.kind.value == "intermediate")  # the casts not made
    replicas = {v.name.split(":", 1)[1] for v in tg.values if v.name.startswith("replica")}
    read_uncast = {tg.values[x].name for v in tg.vertices if v not in weight_casts and v.phase == "forward"
                   for x in v.inputs()}  # the tied embedding's weight: the lookup reads it in fp32
    assert replicas and replicas & {tg.values[w].name for w in cast_weights} <= read_uncast
    assert len(read_uncast & {tg.values[w].name for w in cast_weights}) < len(cast_weights) // 2
    for ordering in ("deterministic", "random"):
        assert_matches_eager(mg, autocast_case, devices, ordering, seed=5)


def replica_casts(mg) -> list:
    tg = mg.taskgraph
    return [v for v in tg.vertices if v.op == "aten::_to_copy" and v.phase == "forward"
            and tg.values[next(iter(v.inputs()))].name.startswith("replica1:param:blocks.0.")]


def test_with_replicas_every_device_keeps_a_replica_and_casts_it(autocast_case):
    """weight_layout "replicas": the weights stay replicated, each device casts its own replica."""
    mg = compiled(autocast_case, 2, budget=0.45, weight_layout="replicas")
    casts = replica_casts(mg)
    assert casts and all(v.device == 1 for v in casts)
    assert "weight_layouts_simulated_s" not in mg.stats
    assert_matches_eager(mg, autocast_case, 2, "random", seed=5)


def test_auto_plans_both_layouts_below_the_peak_and_keeps_the_faster(autocast_case):
    """weight_layout "auto" (the default): below the unplanned peak both layouts are planned and
    built, and the one the simulator runs faster is the MemGraph; at the peak, replicas alone."""
    mg = compiled(autocast_case, 2, budget=0.45)
    times = mg.stats["weight_layouts_simulated_s"]
    assert set(times) == {"replicas", "casts"}
    kept = "replicas" if replica_casts(mg) else "casts"
    assert times[kept] == min(times.values()) == mg.stats["simulated_step_s"]
    assert_matches_eager(mg, autocast_case, 2, "nondeterministic", seed=3)
    whole = compiled(autocast_case, 2)
    assert replica_casts(whole) and "weight_layouts_simulated_s" not in whole.stats


def test_an_unknown_weight_layout_is_refused_before_tracing(autocast_case):
    with pytest.raises(ValueError, match="weight_layout must be one of 'auto', 'replicas', 'casts'"):
        compiled(autocast_case, 2, budget=0.45, weight_layout="sharded")


def test_fastest_layout_keeps_the_faster_and_lets_a_layout_that_does_not_fit_give_way():
    """compiler.fastest_layout: the layout the simulator runs faster; one that does not build gives
    way to the other; where none builds, the first one's refusal."""
    from types import SimpleNamespace

    layouts = [compiler.Layout(None, None, 0, casts_travel=False), compiler.Layout(None, None, 0, casts_travel=True)]
    speeds = {False: 0.2, True: 0.1}

    def built(layout):
        return SimpleNamespace(stats={"simulated_step_s": speeds[layout.casts_travel]})

    layout, mg = compiler.fastest_layout(layouts, built, None, "cpu")
    assert layout.name == "casts" and mg.stats["weight_layouts_simulated_s"] == {"replicas": 0.2, "casts": 0.1}
    speeds[False] = 0.05
    assert compiler.fastest_layout(layouts, built, None, "cpu")[0].name == "replicas"

    def casts_short(layout):
        if layout.casts_travel:
            raise InfeasibleBudget("casts short", minimum=10)
        return built(layout)

    assert compiler.fastest_layout(list(reversed(layouts)), casts_short, None, "cpu")[0].name == "replicas"

    def none_fit(layout):
        raise InfeasibleBudget(f"{layout.name} short", minimum=10)

    with pytest.raises(InfeasibleBudget, match="replicas short"):
        compiler.fastest_layout(layouts, none_fit, None, "cpu")


def test_a_layout_whose_greedy_plans_lag_far_behind_is_not_planned_further():
    """compiler.fastest_layout with screened_layout: a deferred layout is built from its greedy plans
    first, and planned in full only if those simulate within PLANNER_GAIN_AT_MOST of the fastest
    layout built before it; one whose greedy plans do not build is planned in full."""
    from types import SimpleNamespace

    casts = compiler.Layout(None, None, 0, casts_travel=True)
    replicas = compiler.Layout(None, None, 0, casts_travel=False, deferred=True)
    full = {"casts": 0.100, "replicas": 0.090}
    greedy = {"replicas": 0.100 * (1 + compiler.PLANNER_GAIN_AT_MOST) + 0.001}
    planned = []

    def built(layout):
        planned.append(layout.name)
        return SimpleNamespace(stats={"simulated_step_s": full[layout.name]})

    def screened(layout):
        if greedy[layout.name] is None:
            raise InfeasibleBudget("greedy short", minimum=10)
        return SimpleNamespace(stats={"simulated_step_s": greedy[layout.name]})

    layout, mg = compiler.fastest_layout([casts, replicas], built, None, "cpu", screened_layout=screened)
    assert layout.name == "casts" and planned == ["casts"]
    assert mg.stats["weight_layouts_simulated_s"] == {"casts": 0.100}
    assert mg.stats["weight_layouts_screened_s"] == {"replicas": greedy["replicas"]}
    for near in (0.100 * (1 + compiler.PLANNER_GAIN_AT_MOST) - 0.001, None):  # near enough, or greedy short
        greedy["replicas"], planned[:] = near, []
        layout, mg = compiler.fastest_layout([casts, replicas], built, None, "cpu", screened_layout=screened)
        assert layout.name == "replicas" and planned == ["casts", "replicas"]
        assert "weight_layouts_screened_s" not in mg.stats


def test_a_traced_step_is_placed_in_either_layout_without_tracing_again(autocast_case):
    """TracedStep.finished places a copy: the replicated layout, then the travelling casts, then the
    replicated one again, the first and the last alike."""
    from turnip.trace.tracer import trace_step

    model, loss_fn, batches = autocast_case
    model = copy.deepcopy(model)
    step = trace_step(model, loss_fn, batches[0], optimizer=adamw(model.parameters()), device="cpu", devices=2)
    assert step.casts_weights()
    first = step.finished()
    travelling = step.finished(casts_travel=True)
    again = step.finished()
    assert len(travelling.vertices) < len(first.vertices)  # the casts made once, no refreshes
    assert [(v.op, v.device, v.args) for v in again.vertices] == [(v.op, v.device, v.args) for v in first.vertices]


def test_a_step_without_autocast_casts_no_weights(gpt_case):
    """In fp32 nothing casts a weight: compile has no casts to send, whatever the budget."""
    from turnip.trace.tracer import trace_step

    model, loss_fn, batches = gpt_case
    model = copy.deepcopy(model)
    assert not trace_step(model, loss_fn, batches[0], optimizer=adamw(model.parameters()), device="cpu",
                          devices=2).casts_weights()


def test_where_the_planners_favourite_leaves_a_device_short_it_is_made_again_beside_what_built():
    """Some candidates build, but the one the planner predicted fastest left a device short: the
    plans are made again for less, and the faster of the two builds is kept (a build that is
    slower than the first, or none at all, leaves the first)."""
    from turnip.ir.errors import InfeasibleBudget
    from turnip.memgraph import compiler

    def build_plans(plans):  # (seconds of the best that built, the favourite's refusal or None)
        return (0.728, InfeasibleBudget("short", minimum=1040)) if plans[0] == 1.0 else (0.432, None)

    replans = []

    def replan(scale):
        replans.append(scale)
        return [scale]

    def run(build):
        return compiler.built_on_every_device([1.0], build, replan, 1000, 2, faster=min)

    assert run(build_plans) == 0.432 and replans == [0.95]
    assert run(lambda plans: (0.9, None) if plans[0] < 1 else build_plans(plans)) == 0.728

    def none_again(plans):
        if plans[0] < 1:
            raise InfeasibleBudget("short", minimum=1100)
        return build_plans(plans)

    assert run(none_again) == 0.728
    # one device, or no faster build asked for: the first build stands
    assert compiler.built_on_every_device([1.0], build_plans, replan, 1000, 1, faster=min) == 0.728
    assert compiler.built_on_every_device([1.0], build_plans, replan, 1000, 2) == 0.728


@pytest.mark.parametrize("devices, fraction", [(2, 0.45), (3, 0.4)])
def test_each_devices_share_planned_on_its_own_is_a_candidate_and_stays_bitwise(gpt_case, monkeypatch, devices,
                                                                                 fraction):
    """planners/per_device.py: below the peak, compile also plans each device's share on its own budget
    and puts the plans together; taken (the simulator made to pick it here), every device stays within
    its budget and the step stays eager's averaged accumulation bitwise, in any order."""
    picked = []

    def per_device_only(candidates, costs, backend):
        mine = [mg for mg in candidates if mg.plan.planner.endswith("/per-device")]
        picked.append(len(mine))
        return fastest_simulated(mine or candidates, costs, backend)

    fastest_simulated = compiler.fastest_simulated
    monkeypatch.setattr(compiler, "fastest_simulated", per_device_only)
    mg = compiled(gpt_case, devices, budget=fraction)
    assert picked and picked[0] > 0, picked
    assert mg.plan.planner.endswith("/per-device")
    assert memgraph.verify(mg) == []
    assert mg.arena_bytes + mg.taskgraph.step_workspace() <= mg.plan.gpu_budget
    assert mg.summary()["bytes_offloaded"] > 0 or mg.plan.recompute  # the budget bites
    for ordering in ("deterministic", "random"):
        assert_matches_eager(mg, gpt_case, devices, ordering, seed=7)


def test_a_per_device_plan_that_built_leaves_the_planned_as_one_to_be_made_again_for_less(gpt_case):
    """favourite_refused compares the planners' predictions, and a planned-as-one prediction prices the N
    devices' work on one device: the per-device plan (memgraph/per_device.py) carries none (its shares'
    are in its stats), so a planned-as-one candidate that left a device short is still made again for
    less beside it."""
    from turnip.memgraph.per_device import per_device_plans

    model, loss_fn, batches = gpt_case
    mine = copy.deepcopy(model)
    tg, costs = traced_on_devices(mine, loss_fn, batches[0], adamw(mine.parameters()), 2)
    budget = compiler.everything_kept(tg, 64)[1] // 2
    [per_device] = per_device_plans(tg, budget, None, costs, 64)  # greedy shares: one plan
    assert per_device.planner == "greedy/per-device"
    assert per_device.predicted_time is None and len(per_device.stats["per_device_predicted_s"]) == 2
    as_one = compiler.make_plan(tg, compiler.planning_budget(tg, budget), None, "greedy", costs=costs, alignment=64)
    short = InfeasibleBudget("short", minimum=budget + 1)
    assert compiler.favourite_refused([(as_one, short)], [per_device]) is short


def _two_device_step(gpt_case):
    model, loss_fn, batches = gpt_case
    mine = copy.deepcopy(model)
    tg, costs = traced_on_devices(mine, loss_fn, batches[0], adamw(mine.parameters()), 2)
    return tg, costs, compiler.everything_kept(tg, 64)[1] // 2


def test_each_share_is_planned_as_the_whole_step_on_cuda_with_auto_and_greedily_elsewhere(gpt_case, monkeypatch):
    """plan_step asks per_device_plans for the ILP's shares where compile plans every candidate (CUDA,
    planner "auto"), and for greedy ones elsewhere (the CPU backend, another planner)."""
    import types

    tg, costs, budget = _two_device_step(gpt_case)
    methods = []

    def recorded(tg, gpu_budget, cpu_budget, costs, alignment, method="greedy", **options):
        methods.append(method)
        return []

    monkeypatch.setattr(compiler, "per_device_plans", recorded)
    progress = types.SimpleNamespace(describe=lambda *args: None)
    for device, planner in (("cuda", "auto"), ("cpu", "auto"), ("cuda", "greedy")):
        compiler.plan_step(tg, budget, None, planner, torch.device(device), costs, 64, progress, {})
    assert methods == ["auto", "greedy", "greedy"]


def test_the_ilp_plans_each_share_when_asked(gpt_case):
    """per_device_plans(method="auto"): each share planned by the driver's auto method (greedy, then
    the ILP), side by side on threads, and merged on the whole step; where the ILP won a share, the
    greedy plans it started from merged too, a second candidate."""
    from turnip.memgraph.per_device import per_device_plans

    tg, costs, budget = _two_device_step(gpt_case)
    plans = per_device_plans(tg, budget, None, costs, 64, method="auto")
    assert [share["method"] for share in plans[0].stats["per_device"]] == ["auto", "auto"]
    assert all("time_limit" in share or "reason" in share for share in plans[0].stats["per_device"])
    [greedy_plan] = per_device_plans(tg, budget, None, costs, 64)
    assert [share["method"] for share in greedy_plan.stats["per_device"]] == ["greedy", "greedy"]
    ilp_won = any("improvement_over_greedy" in share for share in plans[0].stats["per_device"])
    assert len(plans) == (2 if ilp_won else 1)
    if ilp_won:  # the second is the greedy shares' plan
        assert (plans[1].recompute, plans[1].offload, plans[1].home) == \
            (greedy_plan.recompute, greedy_plan.offload, greedy_plan.home)


def test_a_share_without_a_plan_leaves_the_planned_as_one_candidates(gpt_case, monkeypatch):
    """Where a device's share has no plan in the budget (the planner's refusal), compile goes on with
    the planned-as-one candidates, as before there was a per-device one, and stays bitwise."""
    def refused(*args, **kwargs):
        raise InfeasibleBudget("a share needs more", minimum=1 << 40)

    monkeypatch.setattr(compiler, "per_device_plans", refused)
    mg = compiled(gpt_case, 2, budget=0.45)
    assert not mg.plan.planner.endswith("/per-device")
    assert not any("per-device" in name for name in mg.stats.get("simulated_candidates", {}))
    assert_matches_eager(mg, gpt_case, 2, "random", seed=11)


def _waits_on_crossing_bytes(mg) -> int:
    """Memory edges that make a kernel wait for the last reader of bytes a transfer between devices
    sent or received: the kernel overwrites those bytes."""
    crossing = {x for mv in mg.vertices if mv.stream is Stream.D2D for x in (*mv.reads, *mv.writes)}
    waits = 0
    for src, dst, kind in mg.edges:
        if kind is not Edge.MEMORY or mg.vertices[dst].stream is not Stream.COMPUTE:
            continue
        written = mg.vertices[dst].writes.values()
        waits += any(x in crossing and any(q.device == p.device and q.where == p.where and q.offset < p.end
                                           and p.offset < q.end for q in written)
                     for x, p in mg.vertices[src].reads.items())
    return waits


def test_the_apart_walk_reuses_the_bytes_of_transfers_last_and_stays_bitwise(gpt_case):
    """build_walks' "apart" walk (several devices only) takes bytes a transfer between devices sent
    or received only after bytes freed by a device's own work: fewer kernels wait for the readers
    of such bytes (whose ends hang on another device) than in the allocate-ahead walk, at a budget
    with room to choose; the step stays eager's, bitwise."""
    whole = compiled(gpt_case, 3)
    tg = whole.taskgraph
    compact = build_walks(tg, Plan(gpu_budget=1 << 40, planner="none"), alignment=64, walks=("compact",))["compact"].arena_bytes
    walks = build_walks(tg, Plan(gpu_budget=2 * compact + tg.step_workspace(), planner="none"), alignment=64,
                        walks=("ahead", "apart", "compact"))
    assert list(walks) == ["ahead", "apart", "compact"]
    ahead, apart = walks["ahead"], walks["apart"]
    assert _waits_on_crossing_bytes(apart) < 0.8 * _waits_on_crossing_bytes(ahead)
    assert memgraph.verify(apart) == []
    apart.initial_state, apart.names, apart.device = dict(whole.initial_state), dict(whole.names), whole.device
    apart.optimizer = whole.optimizer
    assert_matches_eager(apart, gpt_case, 3)


def test_a_plan_keeps_the_copies_between_devices_it_made_again_and_stays_bitwise(autocast_case):
    """memgraph/keep_transfers.py: under bf16 autocast with the weights' casts travelling, a plan at
    30% makes some received casts again for the backward (each a copy that waits for its owner);
    amended, it keeps every first copy instead, changes nothing else, and the step is eager's."""
    model, loss_fn, batches = autocast_case
    mine = copy.deepcopy(model)
    optimizer = adamw(mine.parameters())
    tg, costs = traced_on_devices(mine, loss_fn, batches[0], optimizer, 2, casts_travel=True)
    plan = compiler.make_plan(tg, int(0.3 * compiler.everything_kept(tg, 64)[1]), None, "greedy", costs=costs,
                              alignment=64)
    again = [r for r in plan.recompute if tg.transfer_source(tg.vertices[r.vertex]) is not None]
    assert again  # the planner makes copies between devices again
    kept = keep_transfers(tg, plan)
    assert kept.recompute == [r for r in plan.recompute if r not in again]
    assert (kept.order, kept.offload, kept.home, kept.gpu_budget) == (plan.order, plan.offload, plan.home, plan.gpu_budget)
    assert keep_transfers(tg, kept) is None
    for amended in (kept, plan):  # and the plan as made, its copies received again
        mg = build(tg, amended, alignment=64)
        assert memgraph.verify(mg) == []
        mg.optimizer = CompiledOptimizer(mg, optimizer)
        mg.initial_state, mg.names, mg.device = dict(tg.initial_state), dict(tg.state_names), "cpu"
        assert_matches_eager(mg, autocast_case, 2, "random", seed=4)


def test_a_devices_share_may_receive_a_cast_again_where_a_ranks_may_not(autocast_case):
    """memgraph/per_device.py plans each device's share with replay_receives: a weight's cast
    received from its owner, and what reads it, may be recomputed by receiving it again (the whole
    step's copy runs again); a rank's share (the default) receives each message once."""
    model, loss_fn, batches = autocast_case
    mine = copy.deepcopy(model)
    tg, costs = traced_on_devices(mine, loss_fn, batches[0], adamw(mine.parameters()), 2, casts_travel=True)
    share = sliced(tg, 1, 2, order=step_order(tg)).taskgraph
    costs.annotate(share)
    budget = int(0.3 * compiler.everything_kept(share, 64)[1])

    def recomputable(problem, op=None):
        return {problem.groups[gi].vertex for gi, g in enumerate(problem.groups)
                if any(o.kind == RECOMPUTE for o in g.options) and (op is None or share.vertices[g.vertex].op == op)}

    once = make_problem(share, budget, None, costs, alignment=64)
    replayed = make_problem(share, budget, None, costs, alignment=64, replay_receives=True)
    received = {g.vertex for g in once.groups if g.forward and share.vertices[g.vertex].op == RECV}
    assert received and not recomputable(once, RECV)
    assert recomputable(replayed, RECV) == received
    assert recomputable(once) < recomputable(replayed)  # the matmuls reading a received cast too


def test_the_cast_of_a_layer_norms_output_is_recomputed_by_running_the_norm_again(autocast_case):
    """Under bf16 autocast a Linear reads the bf16 cast of a layer norm's output, which nothing
    else reads, while the norm's own group saves its mean and rstd. The cast may be recomputed: its
    chain runs the norm again, and the norm's copies of mean and rstd, which replace the originals
    for the backward (ir/plan.py), are counted from there to their last use. Run that way, on one
    device and on two, the step is eager's bit for bit."""
    model, loss_fn, batches = autocast_case
    for devices in (1, 2):
        mine = copy.deepcopy(model)
        optimizer = adamw(mine.parameters())
        tg, costs = traced_on_devices(mine, loss_fn, batches[0], optimizer, devices)
        problem = make_problem(tg, 1 << 40, None, costs, alignment=64)
        group_at = {g.vertex: g for g in problem.groups}
        casts = [g for g in problem.groups if tg.vertices[g.vertex].op == "aten::_to_copy"
                 and any(tg.vertices[h].op == "aten::native_layer_norm" and h in group_at for h in g.chain)]
        assert casts and all(any(o.kind == RECOMPUTE for o in g.options) for g in casts)
        for g in casts:
            norm = group_at[next(h for h in g.chain if h in group_at)]
            for option in (o for o in g.options if o.kind == RECOMPUTE):
                remade = option.intervals[-len(norm.saved):]  # after the cast's own
                assert [(first, b) for first, _, b in remade] == \
                    [(option.at, aligned(tg.values[o].nbytes, 64)) for o in norm.saved]
        # every such cast recomputed just before its first use in the backward
        copies = sorted({(g.n0, v) for g in casts for v in (*g.chain, g.vertex)})
        plan = Plan(gpu_budget=1 << 40, order=list(problem.order), planner="by hand",
                    recompute=[Recompute(v, problem.order[n0]) for n0, v in copies])
        mg = build(tg, plan, alignment=64)
        assert memgraph.verify(mg) == []
        assert sum(v.recompute_of >= 0 and tg.vertices[v.recompute_of].op == "aten::native_layer_norm"
                   for v in mg.taskgraph.vertices) >= len(casts)
        mg.optimizer = CompiledOptimizer(mg, optimizer)
        mg.initial_state, mg.names, mg.device = dict(tg.initial_state), dict(tg.state_names), "cpu"
        assert_matches_eager(mg, autocast_case, devices, "random", seed=6)


@pytest.mark.parametrize("devices", [2, 3])
def test_a_cast_received_again_is_cast_again_on_its_owner_and_stays_bitwise(autocast_case, devices):
    """memgraph/per_device.py cast_again_at_the_source: where a plan has a device receive a
    weight's bf16 cast again, its owner casts the weight again just before, so the copy reads the
    new cast and the owner need not hold the first from the forward to the receiver's backward."""
    model, loss_fn, batches = autocast_case

    def adam(params):  # no decoupled decay: AdamW's p.mul_ needs no gradient, and runs right after a
        return torch.optim.Adam(params, lr=1e-3)  # weight's last forward reader, before any cast again

    for make_opt in (adamw, adam):
        mine = copy.deepcopy(model)
        optimizer = make_opt(mine.parameters())
        tg, costs = traced_on_devices(mine, loss_fn, batches[0], optimizer, devices, casts_travel=True)
        fraction = 0.3 if make_opt is adamw else 0.25  # where the greedy plan receives some casts again
        plan = compiler.make_plan(tg, int(fraction * compiler.everything_kept(tg, 64)[1]), None, "greedy",
                                  costs=costs, alignment=64)
        received_again = [r for r in plan.recompute if tg.transfer_source(tg.vertices[r.vertex]) is not None]
        assert received_again and cast_again_at_the_source(tg, plan) is plan  # its weights are homed on the CPU
        # with every weight on the GPU (and room for them) each of those casts is made again, but not
        # after AdamW's decay
        plan = dataclasses.replace(plan, home={}, release_after={},
                                   gpu_budget=2 * compiler.everything_kept(tg, 64)[1])
        if make_opt is adamw:
            assert cast_again_at_the_source(tg, plan) is plan
    amended = cast_again_at_the_source(tg, plan)
    assert amended.stats["cast_again_at_the_source"] == len(received_again)
    added = [r for r in amended.recompute if r not in plan.recompute]
    assert [r for r in amended.recompute if r in plan.recompute] == plan.recompute
    for r in added:  # each the weight's cast, on its owner, right before the copy that reads it
        after = amended.recompute[amended.recompute.index(r) + 1]
        assert after.before == r.before and tg.transfer_source(tg.vertices[after.vertex]) in tg.vertices[r.vertex].outputs
        assert all(tg.values[x].kind.is_persistent for x in tg.vertices[r.vertex].inputs())
    mg = build(tg, amended, alignment=64)
    assert memgraph.verify(mg) == []
    built = mg.taskgraph
    copies = [v for v in built.vertices if v.recompute_of >= 0 and built.transfer_source(v) is not None]
    casts = {r.vertex for r in added}
    assert sum(built.vertices[built.values[built.transfer_source(v)].producer].recompute_of in casts
               for v in copies) == len(added)  # the copies read the casts made again
    mg.optimizer = CompiledOptimizer(mg, optimizer)
    mg.initial_state, mg.names, mg.device = dict(tg.initial_state), dict(tg.state_names), "cpu"
    assert_matches_eager(mg, autocast_case, devices, "random", seed=8, make_opt=adam)


def test_where_the_ilp_won_a_share_the_greedy_shares_are_a_second_candidate(gpt_case, monkeypatch):
    """A share's model does not see the other devices' waits, so where the ILP's plan of a share
    beat its greedy plan, per_device_plans merges the greedy plans too (the ILP's first) and the
    simulator picks between them."""
    from turnip.memgraph import per_device

    tg, costs, budget = _two_device_step(gpt_case)
    real = per_device.plan_and_start

    def ilp_won_the_first(share_tg, *args, **kwargs):  # the shares are planned on threads: by rank, not by turn
        [greedy] = real(share_tg, *args, **{**kwargs, "method": "greedy"})
        if share_tg.rank != 0 or kwargs["method"] != "auto":
            return [greedy]
        won = dataclasses.replace(greedy, planner="ilp", offload=set(), recompute=[], home={})  # stands in for the ILP's
        return [won, greedy]

    monkeypatch.setattr(per_device, "plan_and_start", ilp_won_the_first)
    first, second = per_device.per_device_plans(tg, budget, None, costs, 64, method="auto")
    assert first.planner == "ilp/per-device" and second.planner == "greedy/per-device"
    [greedy_shares] = per_device.per_device_plans(tg, budget, None, costs, 64)
    assert (second.recompute, second.offload, second.home) == \
        (greedy_shares.recompute, greedy_shares.offload, greedy_shares.home)
    assert (first.offload, first.home) != (second.offload, second.home)


def test_a_devices_share_finds_its_repeated_blocks_whatever_its_messages_tags():
    """A share receives each layer's weights in messages whose tags (their places among the step's
    messages) differ from layer to layer; the blocks are found in it as in the whole step, so the
    ILP ties them (planners/blocks.py)."""
    from turnip.planners.blocks import find_blocks

    from turnip import gpt

    torch.manual_seed(0)
    cfg = gpt.GPTConfig(n_layers=8)  # deep enough that a share holds layers alike (4 layers: the ends differ)
    model = gpt.GPT(cfg)
    tg, costs = traced_on_devices(model, bf16_autocast(gpt.lm_loss), gpt.example_batch(cfg), adamw(model.parameters()),
                                  2, casts_travel=True)
    share = sliced(tg, 1, 2, order=step_order(tg)).taskgraph
    costs.annotate(share)
    assert any(v.op == RECV for v in share.vertices)
    problem = make_problem(share, compiler.everything_kept(share, 64)[1] // 3, None, costs, alignment=64,
                           replay_receives=True)
    found = find_blocks(problem)
    assert found and sum(len(block.instances) for block in found) >= 2
