"""Every torch.optim optimizer the compiled step runs (SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, NAdam,
RAdam, RMSprop, ASGD), with its main options, bitwise equal to eager PyTorch on the CPU backend: losses,
weights and the exported optimizer states, at three budgets and in both orderings, under LR schedulers,
continuing an optimizer that trained eagerly, exported back to eager and through save/load. LBFGS and
the options the update does not run are refused, saying why."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import assert_same_optimizer_state
from test_optimizer_export import eager_step, loss_fn
from turnip.bench.models.mlp import MLP
from turnip.trace.errors import UnsupportedFeature

from turnip import engine, memgraph

O = torch.optim
STEPS = 7  # RAdam rectifies its update from step 6 on (rho_t > 5); ASGD(t0=3) averages from step 5 on

OPTIMIZERS = {  # each optimizer with its main options; several cases where options exclude each other
    "sgd_nesterov_maximize": lambda ps: O.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01,
                                              maximize=True),
    "sgd_dampening": lambda ps: O.SGD(ps, lr=0.05, momentum=0.9, dampening=0.3),
    "adam_amsgrad_maximize": lambda ps: O.Adam(ps, lr=1e-2, weight_decay=0.01, amsgrad=True, maximize=True),
    "adamw_amsgrad": lambda ps: O.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adagrad": lambda ps: O.Adagrad(ps, lr=0.1, lr_decay=0.05, weight_decay=0.01, initial_accumulator_value=0.1,
                                    maximize=True),
    "adadelta": lambda ps: O.Adadelta(ps, lr=1.0, rho=0.8, weight_decay=0.01),
    "adamax": lambda ps: O.Adamax(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.01, maximize=True),
    "nadam": lambda ps: O.NAdam(ps, lr=1e-2, weight_decay=0.01, momentum_decay=0.01),
    "nadam_decoupled_two_groups": lambda ps: O.NAdam(
        [{"params": ps[:2], "betas": (0.8, 0.9)}, {"params": ps[2:], "weight_decay": 0.0}],
        lr=1e-2, weight_decay=0.05, decoupled_weight_decay=True, maximize=True),
    "radam": lambda ps: O.RAdam(ps, lr=1e-2, betas=(0.9, 0.9), weight_decay=0.01),
    "radam_decoupled": lambda ps: O.RAdam(ps, lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1,
                                          decoupled_weight_decay=True),
    "rmsprop": lambda ps: O.RMSprop(ps, lr=1e-2, weight_decay=0.01, maximize=True),
    "rmsprop_centered_momentum": lambda ps: O.RMSprop(ps, lr=1e-2, alpha=0.9, momentum=0.8, centered=True),
    "asgd": lambda ps: O.ASGD(ps, lr=1e-2, lambd=0.01, alpha=0.75, t0=3, weight_decay=0.01),
}
BUDGETS = [1.0, 0.6, 0.35]


def make(steps: int = STEPS):
    torch.manual_seed(0)
    model = MLP(8, 16, 4, depth=3)
    batches = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(steps)]
    return model, batches


def eager(model, make_opt, batches, make_sched=None):
    """(losses, weights, optimizer state dict) of eager PyTorch over a copy of `model`."""
    model = copy.deepcopy(model)
    opt = make_opt(list(model.parameters()))
    sched = make_sched(opt) if make_sched else None
    losses = []
    for b in batches:
        losses.append(eager_step(model, opt, b))
        if sched:
            sched.step()
    return losses, model.state_dict(), copy.deepcopy(opt.state_dict())


def assert_same(got_losses, mg, want):
    want_losses, want_weights, want_opt = want
    assert all(torch.equal(a, w) for a, w in zip(got_losses, want_losses, strict=True)), \
        f"losses {got_losses} != {want_losses}"
    weights = mg.state_dict()
    for key, tensor in want_weights.items():
        assert torch.equal(weights[key], tensor), f"{key}: max diff {(weights[key] - tensor).abs().max().item()}"
    assert_same_optimizer_state(mg.optimizer.state_dict(), want_opt)


@pytest.fixture(scope="module", params=sorted(OPTIMIZERS))
def case(request):
    model, batches = make()
    return request.param, model, batches, eager(model, OPTIMIZERS[request.param], batches)


@pytest.mark.parametrize("budget", BUDGETS)
def test_every_optimizer_matches_eager_bitwise_in_both_orderings(case, budget):
    name, model, batches, want = case
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS[name](list(model.parameters())),
                          budget=budget, device="cpu", verbose=False)
    if budget < 1.0:  # the plan moves memory, so the test covers a planned step
        moved = mg.summary()
        assert moved["bytes_offloaded"] + moved["bytes_reloaded"] > 0 or mg.plan.recompute, name
    for ordering in ("deterministic", "nondeterministic"):
        mg.runtime = None  # from the compiled weights and states again (and step 1's host states)
        got = [engine.run(mg, b, ordering=ordering)["loss"] for b in batches]
        assert_same(got, mg, want)


SCHEDULES = {  # per-step host quantities recomputed from the current hyperparameters each step
    "nadam_onecycle": (lambda ps: O.NAdam(ps, lr=1e-2),  # cycles betas[0]: NAdam's mu product follows it
                       lambda o: O.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=STEPS)),
    "asgd_step": (lambda ps: O.ASGD(ps, lr=1e-2, lambd=0.01, t0=3),  # eta is made from the previous step's lr
                  lambda o: O.lr_scheduler.StepLR(o, step_size=1, gamma=0.7)),
    "radam_cosine": (lambda ps: O.RAdam(ps, lr=1e-2, betas=(0.9, 0.9)),
                     lambda o: O.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS)),
    "adagrad_step": (lambda ps: O.Adagrad(ps, lr=0.1, lr_decay=0.05),
                     lambda o: O.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)),
    "adamax_exponential": (lambda ps: O.Adamax(ps, lr=1e-2), lambda o: O.lr_scheduler.ExponentialLR(o, 0.8)),
    "adadelta_step": (lambda ps: O.Adadelta(ps, lr=1.0), lambda o: O.lr_scheduler.StepLR(o, step_size=1, gamma=0.8)),
    "rmsprop_onecycle": (lambda ps: O.RMSprop(ps, lr=1e-2, momentum=0.9),  # cycles momentum
                         lambda o: O.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=STEPS)),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedulers_change_the_host_quantities_as_in_eager(name):
    make_opt, make_sched = SCHEDULES[name]
    model, batches = make()
    want = eager(model, make_opt, batches, make_sched)
    opt = make_opt(list(model.parameters()))
    sched = make_sched(opt)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=opt, budget=0.6, device="cpu", verbose=False)
    got = []
    for k, b in enumerate(batches):
        got.append(engine.run(mg, b, ordering="deterministic" if k % 2 else "nondeterministic")["loss"])
        sched.step()
    assert_same(got, mg, want)


CONTINUED = ["nadam", "asgd", "radam", "adagrad", "rmsprop_centered_momentum"]


@pytest.mark.parametrize("name", CONTINUED)
def test_compile_continues_an_optimizer_that_trained_eagerly(name):
    """The torch optimizer's states and step count (NAdam's mu product, ASGD's eta and mu included) are
    where the compiled step starts, each time it starts again from its compiled state."""
    model, batches = make()
    want = eager(model, OPTIMIZERS[name], batches)
    model = copy.deepcopy(model)
    opt = OPTIMIZERS[name](list(model.parameters()))
    first = [eager_step(model, opt, b) for b in batches[:3]]
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=opt, budget=0.6, device="cpu", verbose=False)
    for ordering in ("deterministic", "nondeterministic"):
        mg.runtime = None
        got = first + [engine.run(mg, b, ordering=ordering)["loss"] for b in batches[3:]]
        assert_same(got, mg, want)


@pytest.mark.parametrize("name", CONTINUED)
def test_exported_states_continue_in_eager(name):
    model, batches = make()
    want_losses, want_weights, _ = eager(model, OPTIMIZERS[name], batches)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS[name](list(model.parameters())),
                          budget=0.6, device="cpu", verbose=False)
    got = [engine.run(mg, b)["loss"] for b in batches[:4]]
    resumed = copy.deepcopy(model)
    resumed.load_state_dict(mg.state_dict())
    opt = OPTIMIZERS[name](list(resumed.parameters()))
    opt.load_state_dict(mg.optimizer.state_dict())
    got += [eager_step(resumed, opt, b) for b in batches[4:]]
    assert all(torch.equal(a, w) for a, w in zip(got, want_losses, strict=True)), f"{got} != {want_losses}"
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in want_weights.items())


@pytest.mark.parametrize("name", ["nadam_decoupled_two_groups", "asgd"])
def test_save_and_load_keep_the_host_states(name, tmp_path):
    """A loaded step continues from the saved host states, with the lr changed between every step."""
    model, batches = make()
    lrs = [1e-2 * 0.8**k for k in range(STEPS)]

    eager_model = copy.deepcopy(model)
    eager_opt = OPTIMIZERS[name](list(eager_model.parameters()))
    want_losses = []
    for lr, b in zip(lrs, batches):
        for group in eager_opt.param_groups:
            group["lr"] = lr
        want_losses.append(eager_step(eager_model, eager_opt, b))

    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS[name](list(model.parameters())),
                          budget=0.6, device="cpu", verbose=False)
    got = []
    for k, (lr, b) in enumerate(zip(lrs, batches)):
        if k == 3:
            mg.save(tmp_path / "step.mg")
            mg = memgraph.load(tmp_path / "step.mg")
        for group in mg.optimizer.param_groups:
            group["lr"] = lr
        got.append(engine.run(mg, b)["loss"])
    assert all(torch.equal(a, w) for a, w in zip(got, want_losses, strict=True)), f"{got} != {want_losses}"
    assert all(torch.equal(mg.state_dict()[k], v) for k, v in eager_model.state_dict().items())
    exported = mg.optimizer.state_dict()
    assert_same_optimizer_state(exported, eager_opt.state_dict(), groups=False)


def test_adam_with_amsgrad_takes_the_single_tensor_update_where_the_fused_one_was_asked_for():
    model, batches = make(3)
    make_opt = OPTIMIZERS["adam_amsgrad_maximize"]
    want = eager(model, make_opt, batches)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=make_opt(list(model.parameters())),
                          device="cpu", verbose=False, fused_optimizer=True)
    assert not any("fused" in v.op for v in mg.taskgraph.vertices)
    assert_same([engine.run(mg, b)["loss"] for b in batches], mg, want)


@pytest.mark.parametrize("make_opt, pattern", [
    (lambda ps: O.LBFGS(ps), r"optimizer LBFGS is not supported: its step\(\) calls a closure .* line search"),
    (lambda ps: O.Rprop(ps), r"optimizer Rprop is not supported \(supported: SGD, Adam, AdamW, Adagrad, .*, RMSprop and ASGD\)"),
    (lambda ps: O.RMSprop(ps, differentiable=True), "differentiable=True .* is not supported: it makes the update"),
    (lambda ps: O.Adagrad(ps, fused=True), "fused=True .* torch's fused Adagrad kernel rounds differently"),
    (lambda ps: O.NAdam(ps, lr=torch.tensor(0.01)), "lr given as a tensor"),
])
def test_what_the_update_cannot_run_is_refused_saying_why(make_opt, pattern):
    model, batches = make(1)
    with pytest.raises(UnsupportedFeature, match=pattern):
        memgraph.trace(model, loss_fn, batches[0], optimizer=make_opt(list(model.parameters())))


def test_a_switch_changed_after_compile_is_refused_and_a_hyperparameter_followed():
    model, batches = make(3)
    opt = O.RMSprop(model.parameters(), lr=1e-2, centered=True)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=opt, device="cpu", verbose=False)
    engine.run(mg, batches[0])
    opt.param_groups[0]["centered"] = False
    with pytest.raises(ValueError, match="centered changed from True to False since compile"):
        engine.run(mg, batches[1])
    opt.param_groups[0]["centered"] = True
    opt.param_groups[0]["alpha"] = 0.9  # a host scalar: followed
    engine.run(mg, batches[1])
    assert mg.taskgraph.optimizer.groups[0]["alpha"] == 0.9


def test_load_refuses_an_optimizer_whose_switches_differ(tmp_path):
    model, batches = make(1)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=O.NAdam(model.parameters()), device="cpu",
                          verbose=False)
    engine.run(mg, batches[0])
    mg.save(tmp_path / "step.mg")
    params = list(copy.deepcopy(model).parameters())
    with pytest.raises(ValueError, match=r"decoupled_weight_decay=True, which the compiled step does not run"):
        memgraph.load(tmp_path / "step.mg", optimizer=O.NAdam(params, decoupled_weight_decay=True))
    with pytest.raises(ValueError, match="runs nadam, not radam"):
        memgraph.load(tmp_path / "step.mg", optimizer=O.RAdam(params))
    loaded = memgraph.load(tmp_path / "step.mg", optimizer=O.NAdam(params, lr=5.0))
    assert loaded.optimizer.param_groups[0]["lr"] == 2e-3 and loaded.optimizer.steps_taken() == 1


def test_adagrad_states_are_there_before_the_first_update_as_in_torch():
    """Adagrad makes its states when it is made (step 0, sum filled with initial_accumulator_value)."""
    model, batches = make(1)
    make_opt = OPTIMIZERS["adagrad"]
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=make_opt(list(model.parameters())),
                          device="cpu", verbose=False)
    want = make_opt(list(copy.deepcopy(model).parameters())).state_dict()
    assert want["state"]  # torch's, before any step
    assert_same_optimizer_state(mg.optimizer.state_dict(), want)


@pytest.mark.parametrize("name", ["adamw_amsgrad", "sgd_dampening", "adadelta", "rmsprop_centered_momentum"])  # (Adagrad makes its own)
def test_fresh_states_take_no_memory_until_they_are_written_home(name):
    """A state torch would make on the first step is one element broadcast in the compiled step's
    initial state (the runtime writes it into its home), while its value keeps the layout and bytes
    of the parameter's; trained from there the step is still eager's (the cases above)."""
    model, batches = make(1)
    params = list(model.parameters())
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS[name](params), device="cpu")
    states = [v for v in mg.taskgraph.values if v.kind.value == "optimizer_state" and v.id in mg.initial_state]
    assert states
    for value in states:
        initial = mg.initial_state[value.id]
        assert initial.untyped_storage().nbytes() == initial.element_size(), value.name
        assert value.nbytes == initial.numel() * initial.element_size() and 0 not in value.stride
        assert tuple(initial.shape) == tuple(value.shape) and initial.dtype == value.dtype
