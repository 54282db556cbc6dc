"""LR schedulers act on a compiled step as on eager: engine.run reads the optimizer's hyperparameters each step."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from turnip.bench.models.mlp import MLP

from turnip import engine, memgraph

STEPS = 5


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = MLP(8, 32, 4, depth=6)
    batches = [(torch.randn(32, 8), torch.randn(32, 4)) for _ in range(STEPS)]
    return model, batches


def loss_fn(m, b):
    return torch.nn.functional.mse_loss(m(b[0]), b[1])


SCHEDULES = {
    "adamw_cosine": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
                     lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS)),
    "adamw_cosine_warmup": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
                            lambda o: torch.optim.lr_scheduler.SequentialLR(o, [
                                torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=2),
                                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS - 2)], milestones=[2])),
    "sgd_step": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                 lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)),
    "adam_onecycle": (lambda p: torch.optim.Adam(p, lr=1e-2),  # cycles betas[0] as well as lr
                      lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=STEPS)),
}


@pytest.mark.parametrize("budget", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_scheduler_steps_match_eager_bitwise(name, budget):
    make_opt, make_sched = SCHEDULES[name]
    model, batches = make()
    eager_model = copy.deepcopy(model)
    opt = make_opt(eager_model.parameters())
    sched = make_sched(opt)
    want = []
    for b in batches:
        opt.zero_grad()
        loss = loss_fn(eager_model, b)
        loss.backward()
        opt.step()
        sched.step()
        want.append(loss.detach())

    opt = make_opt(model.parameters())
    sched = make_sched(opt)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=opt, budget=budget, device="cpu")
    got = []
    for k, b in enumerate(batches):
        got.append(engine.run(mg, b, ordering="deterministic" if k % 2 else "nondeterministic")["loss"])
        sched.step()
    assert all(torch.equal(a, w) for a, w in zip(got, want)), f"{got} != {want}"
    state = mg.state_dict()
    assert all(torch.equal(state[k], v) for k, v in eager_model.state_dict().items())


def test_a_change_the_traced_update_cannot_follow_is_refused():
    model, batches = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=opt, device="cpu")
    engine.run(mg, batches[0])
    opt.param_groups[0]["weight_decay"] = 0.0  # AdamW traced the decay multiply: it cannot vanish
    with pytest.raises(ValueError, match="weight_decay changed from 0.1 to 0.0"):
        engine.run(mg, batches[1])
    opt.param_groups[0]["weight_decay"] = 0.05  # non-zero to non-zero is a scalar: followed
    engine.run(mg, batches[1])


SCHEDULER_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("on", ["torch optimizer", "mg.optimizer"])
def test_a_scheduler_stepped_after_each_run_does_not_warn(on):
    """engine.run applies the update without calling optimizer.step(): it marks the optimizers as
    step() would, so torch's check ("lr_scheduler.step() before optimizer.step()") stays silent,
    for a scheduler on the user's optimizer or on mg.optimizer, made before or after compile."""
    model, batches = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    early = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)) if on == "torch optimizer" else None
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=opt, device="cpu", verbose=False)
    sched = early or torch.optim.lr_scheduler.LambdaLR(mg.optimizer, lambda step: 1.0 / (1 + step))
    lrs = []
    for b in batches:
        engine.run(mg, b)
        sched.step()  # a warning is an error here
        lrs.append(mg.taskgraph.optimizer.groups[0]["lr"])
    assert lrs == [1e-2 * (1.0 / (1 + k)) for k in range(STEPS)]  # each run used the lr the scheduler had set


def test_without_a_run_the_scheduler_still_warns():
    """The check above is torch's own: stepping the scheduler before any engine.run warns as in eager."""
    model, batches = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=opt, device="cpu", verbose=False)
    sched = torch.optim.lr_scheduler.LambdaLR(mg.optimizer, lambda step: 1.0 / (1 + step))
    with pytest.warns(UserWarning, match=re.escape(SCHEDULER_WARNING)):
        sched.step()
