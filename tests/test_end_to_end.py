"""memgraph.compile + engine.run on the CPU backend, bitwise against eager PyTorch.

Every model trains 3 steps at 100%, 50% and 25% of its unplanned peak, in the
deterministic, nondeterministic and 20 seeded random orders (which are fuzzed
further by randomized worker delays on the CPU backend).
"""

import pytest
import torch
from cases import OPTIMIZERS, assert_same_state, bf16_autocast, eager_steps, make_case, trainable

from turnip import engine, memgraph

BUDGETS = [1.0, 0.5, 0.25]
RANDOM_ORDERS = 20


def run_steps(mg, batches, ordering="nondeterministic", seed=None, rng_seed=123):
    mg.runtime = None  # start again from the compiled weights
    torch.manual_seed(rng_seed)
    losses = [engine.run(mg, b, ordering=ordering, seed=seed)["loss"].item() for b in batches]
    return losses, mg.state_dict()


@pytest.fixture(scope="module", params=["mlp", pytest.param("gpt", marks=pytest.mark.slow), "hf_gpt2"])  # gpt: 25-30 s
def case(request):
    model, loss_fn, batches = make_case(request.param, dropout=0.1)
    want_losses, want_state = eager_steps(model, loss_fn, batches, OPTIMIZERS["adamw"])
    return request.param, model, loss_fn, batches, [x.item() for x in want_losses], want_state


@pytest.mark.parametrize("budget", BUDGETS)
def test_compiled_step_matches_eager_in_every_order(case, budget):
    name, model, loss_fn, batches, want_losses, want_state = case
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS["adamw"](trainable(model)),
                          budget=budget, device="cpu")
    assert memgraph.verify(mg) == []
    assert mg.arena_bytes <= mg.plan.gpu_budget
    orders = [("deterministic", None), ("nondeterministic", None)]
    orders += [("random", seed) for seed in range(RANDOM_ORDERS if budget != 1.0 else 3)]
    launch_orders = set()
    for ordering, seed in orders:
        losses, state = run_steps(mg, batches, ordering, seed)
        assert losses == want_losses, f"{name} at {budget}: {ordering} (seed {seed})"
        assert_same_state(state, want_state)
        launch_orders.add(tuple(mg.runtime.last_launch_order))
    assert len(launch_orders) > 1  # the random orders really differed


def test_small_budget_offloads_and_still_matches(case):
    name, model, loss_fn, batches, want_losses, want_state = case
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS["adamw"](trainable(model)),
                          budget=0.25, device="cpu")
    moved = mg.summary()
    assert moved["bytes_offloaded"] + moved["bytes_reloaded"] > 0 or mg.plan.recompute, \
        f"{name}: a 25% budget should need offloading or recomputation"


def test_autocast_step_through_the_engine_is_bitwise():
    model, loss_fn, batches = make_case("gpt", dropout=0.1)
    mixed_loss = bf16_autocast(loss_fn)
    want_losses, want_state = eager_steps(model, mixed_loss, batches, OPTIMIZERS["adamw"])
    mg = memgraph.compile(model, mixed_loss, batches[0], optimizer=OPTIMIZERS["adamw"](trainable(model)),
                          budget=0.5, device="cpu")
    for ordering, seed in [("nondeterministic", None), ("random", 1)]:
        losses, state = run_steps(mg, batches, ordering, seed)
        assert losses == [x.item() for x in want_losses]
        assert_same_state(state, want_state)


def test_fused_optimizer_through_the_engine():
    model, loss_fn, batches = make_case("gpt", dropout=0.1)

    def make_opt(params):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)

    want_losses, want_state = eager_steps(model, loss_fn, batches, make_opt)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=make_opt(trainable(model)), budget=0.5,
                          device="cpu", fused_optimizer=True)
    losses, state = run_steps(mg, batches, "random", 3)
    assert losses == [x.item() for x in want_losses]
    assert_same_state(state, want_state)


def test_release_frees_the_runtime_and_a_later_run_starts_over():
    model, loss_fn, batches = make_case("mlp")
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS["sgd"](trainable(model)), device="cpu")
    first = engine.run(mg, batches[0])["loss"].item()
    mg.release(keep=False)
    assert mg.runtime is None
    assert engine.run(mg, batches[0])["loss"].item() == first  # from the compiled weights again


def test_save_load_continues_training(tmp_path):
    model, loss_fn, batches = make_case("gpt", dropout=0.1)
    want_losses, want_state = eager_steps(model, loss_fn, batches, OPTIMIZERS["adam"])
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS["adam"](trainable(model)),
                          budget=0.5, device="cpu")
    torch.manual_seed(123)
    first = engine.run(mg, batches[0])["loss"].item()
    mg.save(tmp_path / "step.mg")
    loaded = memgraph.load(tmp_path / "step.mg")
    rest = [engine.run(loaded, b)["loss"].item() for b in batches[1:]]
    assert [first] + rest == [x.item() for x in want_losses]
    assert_same_state(loaded.state_dict(), want_state)


def test_state_dict_loads_into_the_model():
    model, loss_fn, batches = make_case("gpt")
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS["sgd"](trainable(model)), device="cpu")
    engine.run(mg, batches[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(mg.state_dict())  # strict: every key present, shapes right
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
