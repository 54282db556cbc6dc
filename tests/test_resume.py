"""Resuming: compile a step from a model and optimizer that already trained eagerly.

A user trains K steps with torch.optim, then hands the stepped model and the
stepped optimizer to memgraph.compile. The compiled step must continue from
step K+1 with the optimizer's existing state (Adam's bias corrections depend on
the step count, SGD's first-step momentum rule on whether a buffer exists):
losses and weights bitwise equal to eager running all the steps.
"""

import copy

import pytest
import torch
from cases import OPTIMIZERS, assert_same_state, eager_steps, make_case, trainable
from turnip.bench.models import mlp

from turnip import engine, memgraph

# No torch.set_num_threads(1) here (unlike test_peers): it sets the caller's intra-op threads only, the
# engine's worker threads keep the default, and matmuls split differently are no longer bitwise equal.
EAGER_STEPS = 2  # taken eagerly before compiling
TURNIP_STEPS = 2  # then taken by the compiled step

CASES = {  # name -> (optimizer factory, fused_optimizer)
    "sgd": (OPTIMIZERS["sgd"], None),  # momentum 0.9 with dampening: the first-step rule differs from later steps
    "adam": (OPTIMIZERS["adam"], None),
    "adamw": (OPTIMIZERS["adamw"], None),
    # the fused kernels read the step count from a device tensor (trace/optimizer_update.py, _step_counter), not the host scalars
    "adamw_fused": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True), True),
}


@pytest.fixture(scope="module")
def case():
    model, loss_fn, batches = make_case("mlp")  # no dropout: the RNG plays no part
    batches = batches + [mlp.example_batch(batch=64, seed=len(batches))]
    assert len(batches) == EAGER_STEPS + TURNIP_STEPS
    return model, loss_fn, batches


def _optimizer_state(opt) -> list[dict]:
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
            for g in opt.param_groups for p in g["params"]]


def resumed_steps(model, loss_fn, batches, make_opt, budget, ordering, fused_optimizer):
    """EAGER_STEPS eager steps on a copy, then compile from that state and take the rest with turnip."""
    model = copy.deepcopy(model)
    opt = make_opt(trainable(model))
    losses = []
    torch.manual_seed(123)  # as eager_steps does
    for batch in batches[:EAGER_STEPS]:
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    states = _optimizer_state(opt)
    for state in states:  # the setup really is a resume
        if "step" in state:
            assert int(state["step"]) == EAGER_STEPS
            assert state["exp_avg"].abs().sum() > 0 and state["exp_avg_sq"].abs().sum() > 0
        else:
            assert state["momentum_buffer"].abs().sum() > 0
    mg = memgraph.compile(model, loss_fn, batches[EAGER_STEPS], optimizer=opt, budget=budget, device="cpu",
                          fused_optimizer=fused_optimizer)
    assert memgraph.verify(mg) == []
    for batch in batches[EAGER_STEPS:]:
        losses.append(engine.run(mg, batch, ordering=ordering)["loss"].detach().clone())
    # the compiled step trains its own copy of the state: the user's optimizer is left as it was
    for got, want in zip(_optimizer_state(opt), states):
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(torch.as_tensor(got[k]), torch.as_tensor(want[k])), k
    return losses, mg.state_dict(), mg


@pytest.mark.parametrize("budget,ordering", [(1.0, "nondeterministic"), (0.5, "deterministic"),
                                             (0.5, "nondeterministic")])
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_step_resumes_an_eagerly_stepped_optimizer(case, name, budget, ordering):
    model, loss_fn, batches = case
    make_opt, fused = CASES[name]
    want_losses, want_state = eager_steps(model, loss_fn, batches, make_opt)
    losses, state, mg = resumed_steps(model, loss_fn, batches, make_opt, budget, ordering, fused)
    if budget < 1.0:
        moved = mg.summary()
        assert moved["bytes_offloaded"] + moved["bytes_reloaded"] > 0 or mg.plan.recompute, \
            "a smaller budget should exercise offloading or recomputation"
    assert len(losses) == len(want_losses)
    for i, (got, want) in enumerate(zip(losses, want_losses)):
        assert torch.equal(got, want), f"{name} step {i + 1}: loss {got.item()!r} != eager {want.item()!r}"
    assert_same_state(state, want_state)
