"""Nothing trained is lost: mg.release() keeps the weights, optimizer states and step count, and a saved
step resumes its LR schedule exactly (issue 30, items 2 and 3). On the CPU backend, bitwise against eager.

- release() copies the live state to host memory (mg.initial_state, stats["step"]) before freeing the
  buffers: state_dict(), save() and mg.optimizer give the trained state, and the next engine.run goes on
  from it as if never released. A runtime whose weights are mixed (a step failed midway) keeps nothing:
  release() starts again from the last consistent state (the compiled weights, or those of the last
  release() or file). release(keep=False) and ``mg.runtime = None`` start again without keeping.
- mg.save() stores mg.optimizer's current hyperparameters (a scheduler's step after the last run, and its
  initial_lr), not those the last step ran with; memgraph.load(path, optimizer=opt) gives them to a torch
  optimizer as opt.load_state_dict would, so a scheduler made on it first and restored with
  sched.load_state_dict(...) continues as eager's restored optimizer and scheduler do.
"""

from __future__ import annotations

import copy

import pytest
import torch
from cases import assert_same_optimizer_state, assert_same_state
from test_engine_faults import fail_at
from turnip.bench.models.mlp import MLP
from turnip.engine.errors import EngineError, VertexError
from turnip.ir.memgraph import Kind

from turnip import engine, memgraph

SAVED_AT, MORE = 3, 3  # steps before release / save, steps after


def loss_fn(m, b):
    return torch.nn.functional.mse_loss(m(b[0]), b[1])


def make_opt(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def setup(seed: int = 0):
    torch.manual_seed(seed)
    model = MLP(8, 32, 4, depth=4)
    batches = [(torch.randn(32, 8), torch.randn(32, 4)) for _ in range(SAVED_AT + MORE)]
    return model, batches


def eager_step(model, opt, batch) -> torch.Tensor:
    opt.zero_grad()
    loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    return loss.detach()


def eager_run(model, batches, make=make_opt):
    """(losses, model, optimizer) of eager training on a copy, with each step's state kept:
    states[k] is (model state_dict, optimizer state_dict) after k steps."""
    model = copy.deepcopy(model)
    opt = make(list(model.parameters()))
    losses, states = [], [(copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))]
    for b in batches:
        losses.append(eager_step(model, opt, b))
        states.append((copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())))
    return losses, states


def compiled(model, budget):
    mg = memgraph.compile(model, loss_fn, (torch.randn(32, 8), torch.randn(32, 4)),
                          optimizer=make_opt(list(model.parameters())), budget=budget, device="cpu", verbose=False)
    assert memgraph.verify(mg) == []
    return mg


def losses_of(mg, batches, ordering="nondeterministic"):
    return [engine.run(mg, b, ordering=ordering)["loss"] for b in batches]


# -- release() keeps what was trained ---------------------------------------------------------------------

@pytest.mark.parametrize("budget", [1.0, 0.5])
def test_release_keeps_the_trained_state_and_training_goes_on_as_if_never_released(budget):
    model, batches = setup()
    want, states = eager_run(model, batches)
    mg = compiled(model, budget)
    if budget < 1.0:
        moved = mg.summary()
        assert moved["bytes_offloaded"] + moved["bytes_reloaded"] > 0 or mg.plan.recompute or \
            any(p.where == "cpu" for p in mg.homes.values()), "the smaller budget should move something"
    compiled_weights = mg.state_dict()
    got = losses_of(mg, batches[:SAVED_AT])

    mg.release()
    assert mg.runtime is None
    assert_same_state(mg.state_dict(), states[SAVED_AT][0])  # the trained weights, not the compiled ones
    assert not all(torch.equal(compiled_weights[k], v) for k, v in mg.state_dict().items())
    assert mg.optimizer.steps_taken() == SAVED_AT
    assert_same_optimizer_state(mg.optimizer.state_dict(), states[SAVED_AT][1])

    # the next runs allocate the buffers again and go on from the kept state
    got += losses_of(mg, batches[SAVED_AT:SAVED_AT + 1], "deterministic")
    mg.release()
    mg.release()  # nothing left to release: a no-op
    got += losses_of(mg, batches[SAVED_AT + 1:])
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), f"{got} != {want}"
    assert_same_state(mg.state_dict(), states[-1][0])
    assert mg.optimizer.steps_taken() == len(batches) == mg.runtime.step
    assert_same_optimizer_state(mg.optimizer.state_dict(), states[-1][1])


def test_save_after_release_holds_the_trained_state(tmp_path):
    model, batches = setup(1)
    want, states = eager_run(model, batches)
    mg = compiled(model, 1.0)
    got = losses_of(mg, batches[:SAVED_AT])
    mg.release()
    mg.save(tmp_path / "released.mg")
    loaded = memgraph.load(tmp_path / "released.mg")
    assert loaded.stats["step"] == SAVED_AT
    assert_same_state(loaded.state_dict(), states[SAVED_AT][0])
    assert_same_optimizer_state(loaded.optimizer.state_dict(), states[SAVED_AT][1])
    got += losses_of(loaded, batches[SAVED_AT:])
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), f"{got} != {want}"
    assert_same_state(loaded.state_dict(), states[-1][0])
    assert_same_optimizer_state(loaded.optimizer.state_dict(), states[-1][1])


def last_home_writer(mg) -> int:
    """The last compute vertex in serial order that updates a weight or state in its home."""
    homes = set(mg.homes.values())
    writers = [v for v in mg.serial if mg.vertices[v].kind is Kind.COMPUTE
               and any(p in homes for p in mg.vertices[v].writes.values())]
    assert len(writers) > 1
    return writers[-1]


@pytest.mark.parametrize("released_before", [False, True])
def test_release_of_mixed_weights_starts_again_from_the_last_consistent_state(monkeypatch, released_before):
    """A step failing after some in-place updates leaves the weights a mix of two steps: release() must not
    keep them as if trained, but go back to the compiled weights, or to those of the last release()."""
    model, batches = setup(2)
    want, states = eager_run(model, batches)
    mg = compiled(model, 1.0)
    armed = fail_at(monkeypatch, last_home_writer(mg))  # before any runtime binds the backend's hooks
    armed["on"] = False
    consistent = 0
    losses_of(mg, batches[:2])
    if released_before:
        mg.release()  # keeps 2 steps: the last consistent state from now on
        consistent = 2
    losses_of(mg, batches[2:3])  # a third step, after the last consistent state
    armed["on"] = True
    with pytest.raises(VertexError, match="injected fault"):
        engine.run(mg, batches[3], ordering="deterministic")
    assert mg.runtime.mixed is not None
    with pytest.raises(EngineError, match="mix steps 3 and 4"):
        mg.state_dict()
    armed["on"] = False

    mg.release()
    assert mg.runtime is None
    assert mg.optimizer.steps_taken() == consistent
    assert_same_state(mg.state_dict(), states[consistent][0])
    if consistent:
        assert_same_optimizer_state(mg.optimizer.state_dict(), states[consistent][1])
    else:
        assert mg.optimizer.state_dict()["state"] == {}
    again = losses_of(mg, batches[consistent:])  # the steps since the consistent state, taken again
    assert all(torch.equal(a, w) for a, w in zip(again, want[consistent:], strict=True))
    assert_same_state(mg.state_dict(), states[-1][0])
    assert_same_optimizer_state(mg.optimizer.state_dict(), states[-1][1])


def test_release_without_keeping_and_a_dropped_runtime_start_again():
    model, batches = setup(3)
    want, states = eager_run(model, batches[:2])
    mg = compiled(model, 1.0)
    losses_of(mg, batches[:2])
    mg.release(keep=False)  # for benchmarks and tests that start over: no copy
    assert mg.runtime is None and mg.optimizer.steps_taken() == 0
    assert_same_state(mg.state_dict(), states[0][0])
    assert torch.equal(losses_of(mg, batches[:1])[0], want[0])
    mg.release()  # keeps 1 step
    losses_of(mg, batches[1:2])
    mg.runtime = None  # what the tests do to start over: back to the last kept state (1 step)
    assert mg.optimizer.steps_taken() == 1
    assert_same_state(mg.state_dict(), states[1][0])
    assert torch.equal(losses_of(mg, batches[1:2])[0], want[1])
    assert_same_state(mg.state_dict(), states[2][0])


# -- resuming a saved step with its LR schedule ----------------------------------------------------------

SCHEDULES = {
    # a linear warm-up: LambdaLR sets the lr when made, so it must be made before the optimizer's state is
    # loaded (as torch asks of any optimizer): memgraph.load(path, optimizer=opt)
    "lambda_warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5)),
    # the lr halves after the step saved: the next lr (5e-4) is not the one the last step ran with (1e-3)
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=SAVED_AT, gamma=0.5),
}


def eager_resumed(model, batches, schedule):
    """Eager training saved after SAVED_AT steps and restored as torch asks (model, optimizer and scheduler
    made, then the optimizer's and the scheduler's state dicts loaded): losses, final model and optimizer."""
    model = copy.deepcopy(model)
    opt = make_opt(list(model.parameters()))
    sched = SCHEDULES[schedule](opt)
    losses = []
    for b in batches[:SAVED_AT]:
        losses.append(eager_step(model, opt, b))
        sched.step()
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))
    model = copy.deepcopy(model)
    opt = make_opt(list(model.parameters()))
    sched = SCHEDULES[schedule](opt)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    sched.load_state_dict(saved[2])
    lrs = []
    for b in batches[SAVED_AT:]:
        lrs.append(opt.param_groups[0]["lr"])
        losses.append(eager_step(model, opt, b))
        sched.step()
    return losses, lrs, model.state_dict(), opt.state_dict()


def saved_step(model, batches, schedule, path):
    """The compiled step trained SAVED_AT steps with the schedule, saved to path; the scheduler's state."""
    mg = compiled(model, 1.0)
    sched = SCHEDULES[schedule](mg.optimizer)
    losses = []
    for b in batches[:SAVED_AT]:
        losses.append(engine.run(mg, b)["loss"])
        sched.step()
    next_lr = mg.optimizer.param_groups[0]["lr"]
    assert next_lr != mg.taskgraph.optimizer.groups[0]["lr"], "the next lr should differ from the last step's"
    mg.save(path)
    return losses, copy.deepcopy(sched.state_dict()), next_lr


@pytest.mark.filterwarnings("error")  # no scheduler warning either
@pytest.mark.parametrize("schedule,on", [("lambda_warmup", "torch optimizer"), ("step", "torch optimizer"),
                                         # LambdaLR made on the loaded mg.optimizer would set the lr to its
                                         # first step's, as on a torch optimizer whose state was loaded first
                                         ("step", "mg.optimizer")])
def test_a_loaded_step_continues_its_schedule_like_eager_restored(tmp_path, schedule, on):
    model, batches = setup(4)
    want, want_lrs, want_state, want_opt = eager_resumed(model, batches, schedule)
    got, sched_state, next_lr = saved_step(model, batches, schedule, tmp_path / "step.mg")

    if on == "torch optimizer":  # as torch asks: optimizer and scheduler made, then their states loaded
        resumed = copy.deepcopy(model)
        opt = make_opt(list(resumed.parameters()))
        sched = SCHEDULES[schedule](opt)
        mg = memgraph.load(tmp_path / "step.mg", optimizer=opt)
        assert mg.optimizer.param_groups is opt.param_groups
    else:  # a scheduler that leaves the lr when made (StepLR) may be made on the loaded mg.optimizer
        mg = memgraph.load(tmp_path / "step.mg")
        sched = SCHEDULES[schedule](mg.optimizer)
    assert mg.optimizer.param_groups[0]["initial_lr"] == 1e-3
    sched.load_state_dict(sched_state)
    assert mg.optimizer.param_groups[0]["lr"] == next_lr == want_lrs[0]
    lrs = []
    for b in batches[SAVED_AT:]:
        lrs.append(mg.optimizer.param_groups[0]["lr"])
        got.append(engine.run(mg, b)["loss"])
        sched.step()
    assert lrs == want_lrs
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), f"{got} != {want}"
    assert_same_state(mg.state_dict(), want_state)
    assert_same_optimizer_state(mg.optimizer.state_dict(), want_opt)  # param groups (lr, initial_lr) included


def test_save_stores_the_next_steps_hyperparameters(tmp_path):
    """The reported bug: a scheduler stepped after the last run changed mg.optimizer's lr, and the file
    held the lr that run used."""
    model, batches = setup(5)
    _, sched_state, next_lr = saved_step(model, batches, "lambda_warmup", tmp_path / "step.mg")
    assert next_lr == pytest.approx(1e-3 * (SAVED_AT + 1) / 5)
    loaded = memgraph.load(tmp_path / "step.mg")
    assert loaded.optimizer.param_groups[0]["lr"] == next_lr
    assert loaded.taskgraph.optimizer.groups[0]["lr"] == next_lr
    assert loaded.optimizer.state_dict()["param_groups"][0]["initial_lr"] == 1e-3
    assert sched_state["_last_lr"] == [next_lr]


def test_load_refuses_an_optimizer_the_saved_step_does_not_run(tmp_path):
    model, batches = setup(6)
    mg = compiled(model, 1.0)
    engine.run(mg, batches[0])
    mg.save(tmp_path / "step.mg")
    params = list(copy.deepcopy(model).parameters())
    refused = {
        "runs adamw, not sgd": torch.optim.SGD(params, lr=0.1),
        "runs adamw, not adam": torch.optim.Adam(params, lr=1e-3),
        "amsgrad=True": torch.optim.AdamW(params, amsgrad=True),
        r"hold \[4\] parameters": torch.optim.AdamW(params[:4]),
    }
    for message, opt in refused.items():
        lr = opt.param_groups[0]["lr"]
        with pytest.raises(ValueError, match=message):
            memgraph.load(tmp_path / "step.mg", optimizer=opt)
        assert opt.param_groups[0]["lr"] == lr  # refused before anything was written
    # an Adam with decoupled weight decay runs the AdamW update: accepted, as compile accepts it
    opt = torch.optim.Adam(params, lr=5.0, decoupled_weight_decay=True)
    loaded = memgraph.load(tmp_path / "step.mg", optimizer=opt)
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["weight_decay"] == 0.1
    assert loaded.optimizer.steps_taken() == 1
