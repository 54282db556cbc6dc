"""Moving training back to eager: mg.optimizer.state_dict() holds the compiled step's current optimizer
states in torch's format, so a fresh torch optimizer loads it and continues bitwise like eager."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import assert_same_optimizer_state
from turnip.bench.models.mlp import MLP
from turnip.ir.optimizer import CompiledOptimizer

from turnip import engine, memgraph

TURNIP_STEPS, EAGER_STEPS = 3, 2

OPTIMIZERS = {
    "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01), {}),
    "sgd_nesterov": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True), {}),
    "sgd_plain": (lambda ps: torch.optim.SGD(ps, lr=0.1), {}),  # no state at all
    "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01), {}),
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), {}),
    "adamw_two_groups": (lambda ps: torch.optim.AdamW(
        [{"params": ps[:3], "lr": 1e-2}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0}]), {}),
    "adamw_fused": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
                    {"fused_optimizer": True}),
}


def loss_fn(m, b):
    return torch.nn.functional.mse_loss(m(b[0]), b[1])


def eager_step(model, opt, batch):
    opt.zero_grad()
    loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("budget", [1.0, 0.5])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_exported_state_continues_in_eager_bitwise(name, budget):
    make_opt, options = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = MLP(8, 32, 4, depth=6)
    batches = [(torch.randn(32, 8), torch.randn(32, 4)) for _ in range(TURNIP_STEPS + EAGER_STEPS)]

    eager_model = copy.deepcopy(model)  # the oracle: every step eager
    eager_opt = make_opt(list(eager_model.parameters()))
    want = [eager_step(eager_model, eager_opt, b) for b in batches[:TURNIP_STEPS]]
    want_exported = copy.deepcopy(eager_opt.state_dict())  # its tensors are the live states
    want += [eager_step(eager_model, eager_opt, b) for b in batches[TURNIP_STEPS:]]

    opt = make_opt(list(model.parameters()))
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=opt, budget=budget, device="cpu", **options)
    mg.optimizer = CompiledOptimizer(mg, opt)  # what compile sets mg.optimizer to (see the report)
    assert mg.optimizer.state_dict()["state"] == {}  # no update taken yet: torch holds no state either
    got = [engine.run(mg, b, ordering="deterministic" if k % 2 else "nondeterministic")["loss"]
           for k, b in enumerate(batches[:TURNIP_STEPS])]
    exported = mg.optimizer.state_dict()
    assert_same_optimizer_state(exported, want_exported)

    # back to eager: a fresh model and optimizer take the compiled step's weights and states
    resumed = copy.deepcopy(model)
    resumed.load_state_dict(mg.state_dict())
    resumed_opt = make_opt(list(resumed.parameters()))
    resumed_opt.load_state_dict(exported)
    got += [eager_step(resumed, resumed_opt, b) for b in batches[TURNIP_STEPS:]]
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), f"{got} != {want}"
    state = resumed.state_dict()
    assert all(torch.equal(state[k], v) for k, v in eager_model.state_dict().items())


def test_state_is_keyed_by_the_optimizers_parameters_and_the_step_only_runs_in_the_engine():
    torch.manual_seed(0)
    model = MLP(8, 16, 4, depth=2)
    batch = (torch.randn(8, 8), torch.randn(8, 4))
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=1e-2)
    eager_step(eager_model, eager_opt, batch)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mg = memgraph.compile(model, loss_fn, batch, optimizer=opt, device="cpu")
    compiled = CompiledOptimizer(mg, opt)
    engine.run(mg, batch)
    assert compiled.steps_taken() == 1
    want = {id(p): st for p, st in zip(eager_model.parameters(), eager_opt.state.values())}
    got = compiled.state
    assert [id(p) for p in got] == [id(p) for p in model.parameters()]
    for (p, st), want_st in zip(got.items(), want.values()):
        assert all(torch.equal(st[k], want_st[k]) for k in want_st)
    assert compiled.param_groups is opt.param_groups  # schedulers on either reach the step
    with pytest.raises(RuntimeError, match="engine.run"):
        compiled.step()
    with pytest.raises(NotImplementedError, match="compile with it"):
        compiled.load_state_dict(eager_opt.state_dict())


@pytest.mark.filterwarnings("error")  # no scheduler warning either: engine.run marks the loaded optimizer
def test_a_loaded_memgraph_exports_its_optimizer_and_follows_a_scheduler(tmp_path):
    """memgraph.load gives mg.optimizer: the same state_dict() as the saved step's, and param groups
    an LR scheduler drives, bitwise like eager continuing with the same schedule."""
    torch.manual_seed(0)
    model = MLP(8, 32, 4, depth=4)
    batches = [(torch.randn(32, 8), torch.randn(32, 4)) for _ in range(4)]
    make_opt = OPTIMIZERS["adamw"][0]
    factor = lambda step: 0.1 / (1 + step)  # a schedule far from the saved lr

    eager_model = copy.deepcopy(model)
    eager_opt = make_opt(list(eager_model.parameters()))
    want = [eager_step(eager_model, eager_opt, b) for b in batches[:2]]
    eager_sched = torch.optim.lr_scheduler.LambdaLR(eager_opt, factor)
    for b in batches[2:]:
        want.append(eager_step(eager_model, eager_opt, b))
        eager_sched.step()

    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=make_opt(list(model.parameters())), device="cpu",
                          verbose=False)
    got = [engine.run(mg, b)["loss"] for b in batches[:2]]
    mg.save(tmp_path / "step.mg")
    loaded = memgraph.load(tmp_path / "step.mg")
    assert isinstance(loaded.optimizer, CompiledOptimizer) and loaded.optimizer.steps_taken() == 2
    exported = loaded.optimizer.state_dict()
    assert_same_optimizer_state(exported, mg.optimizer.state_dict())  # param groups included

    # the export goes back to eager: a fresh torch optimizer loads it and steps like the saved one's
    resumed = copy.deepcopy(model)
    resumed.load_state_dict(loaded.state_dict())
    resumed_opt = make_opt(list(resumed.parameters()))
    resumed_opt.load_state_dict(exported)
    assert_same_optimizer_state(resumed_opt.state_dict(), exported)

    sched = torch.optim.lr_scheduler.LambdaLR(loaded.optimizer, factor)
    lrs = []
    for b in batches[2:]:
        got.append(engine.run(loaded, b)["loss"])
        lrs.append(loaded.taskgraph.optimizer.groups[0]["lr"])
        sched.step()
    assert lrs == [1e-2 * factor(0), 1e-2 * factor(1)]  # each run used the scheduler's lr, not the saved 1e-2
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), f"{got} != {want}"
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in eager_model.state_dict().items())
    assert loaded.optimizer.state_dict()["param_groups"][0]["lr"] == eager_opt.param_groups[0]["lr"]
