"""Gradient accumulation: compile(..., accumulation_steps=k) and engine.run(mg, [b1, ..., bk]), bitwise
against eager's ``opt.zero_grad(); for b in micro: loss_fn(model, b).backward(); opt.step()``."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import OPTIMIZERS, assert_same_state, eager_steps, make_case, trainable
from turnip.bench.models import mlp
from turnip.engine import BatchError

from turnip import engine, gpt, memgraph

K = 4  # micro-batches per step
STEPS = 3
SEED = 123  # the global generator before the first step, eager and compiled alike (dropout)


def micro_batches(name: str, model) -> list[list]:
    """STEPS lists of K micro-batches, each like the case's example."""
    seeds = [[100 + K * s + i for i in range(K)] for s in range(STEPS)]
    if name == "mlp":
        return [[mlp.example_batch(batch=16, seed=i) for i in step] for step in seeds]
    return [[gpt.example_batch(model.cfg, seed=i) for i in step] for step in seeds]


def per_micro_batch(loss_fn):
    """The loss as users write it for accumulation: divided by the number of micro-batches."""
    def loss(model, batch):
        return loss_fn(model, batch) / K

    return loss


def eager_accumulated(model, loss_fn, steps, make_opt, max_grad_norm=None):
    """Eager's accumulation loop on a deep copy: (each step's K losses, final state_dict, clip norms)."""
    model = copy.deepcopy(model)
    opt = make_opt(trainable(model))
    torch.manual_seed(SEED)
    losses, norms = [], []
    for micro in steps:
        opt.zero_grad()
        step_losses = []
        for b in micro:
            loss = loss_fn(model, b)
            loss.backward()
            step_losses.append(loss.detach())
        if max_grad_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(trainable(model), max_grad_norm))
        opt.step()
        losses.append(step_losses)
    return losses, model.state_dict(), norms


def summed(losses: list[torch.Tensor]) -> torch.Tensor:
    """A training loop's `total = total + loss` over the micro-batches."""
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total


def run_compiled(mg, steps, ordering="nondeterministic") -> list[dict]:
    mg.release(keep=False)  # start again from the compiled weights
    torch.manual_seed(SEED)
    return [engine.run(mg, micro, ordering=ordering) for micro in steps]


def assert_same_losses(outs: list[dict], want: list[list[torch.Tensor]]) -> None:
    assert len(outs) == len(want)
    for step, (out, losses) in enumerate(zip(outs, want)):
        assert torch.equal(out["losses"], torch.stack(losses)), f"step {step}: {out['losses']} != {losses}"
        assert torch.equal(out["loss"], summed(losses)), f"step {step}: {out['loss']} != {summed(losses)}"


@pytest.fixture(scope="module")
def compiled():
    """(MemGraph, micro-batches, eager's losses and state) per model, optimizer and budget, compiled once."""
    cache = {}

    def get(name: str, opt: str, budget):
        if (name, opt, budget) not in cache:
            model, loss_fn, _ = make_case(name, dropout=0.1)
            loss_fn = per_micro_batch(loss_fn)
            steps = micro_batches(name, model)
            want_losses, want_state, _ = eager_accumulated(model, loss_fn, steps, OPTIMIZERS[opt])
            mg = memgraph.compile(model, loss_fn, steps[0][0], optimizer=OPTIMIZERS[opt](trainable(model)),
                                  budget=budget, device="cpu", accumulation_steps=K, verbose=False)
            cache[name, opt, budget] = mg, steps, want_losses, want_state
        return cache[name, opt, budget]

    return get


@pytest.mark.parametrize("ordering", ["deterministic", "nondeterministic"])
@pytest.mark.parametrize("budget", [None, 0.5])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_accumulated_steps_match_eager_bitwise(compiled, name, opt, budget, ordering):
    mg, steps, want_losses, want_state = compiled(name, opt, budget)
    assert memgraph.verify(mg) == []
    assert mg.arena_bytes <= mg.plan.gpu_budget
    outs = run_compiled(mg, steps, ordering)
    assert_same_losses(outs, want_losses)
    assert_same_state(mg.state_dict(), want_state)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_memory_holds_one_micro_batch_of_activations(name):
    """K forward passes are traced, yet with everything kept the step needs one micro-batch's
    activations at a time: beyond a single step's peak only the accumulated gradients and the
    other micro-batches' inputs."""
    model, loss_fn, _ = make_case(name)
    example = micro_batches(name, model)[0][0]
    tgs = {k: memgraph.trace(model, loss_fn, example, optimizer=OPTIMIZERS["adamw"](trainable(model)),
                             device="cpu", accumulation_steps=k) for k in (1, K)}
    saved = tgs[1].summary()["bytes_saved_for_backward"]
    assert tgs[K].summary()["bytes_saved_for_backward"] >= K * saved > 0
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable(model))
    batch_bytes = sum(tgs[1].values[v].nbytes for v in tgs[1].batch_inputs)
    # holding every micro-batch's activations would take (K - 1) * saved more, above this bound
    assert (K - 1) * saved > grad_bytes + (K - 1) * batch_bytes
    assert tgs[K].live_peak() <= tgs[1].live_peak() + grad_bytes + (K - 1) * batch_bytes


def clipped_loss(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1]) * 100.0 / K  # large gradients: clipping clips


def regression_steps(seed: int = 0) -> list[list]:
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(K)]
            for _ in range(STEPS)]


@pytest.mark.parametrize("budget", [None, 0.5])
def test_clipping_applies_to_the_accumulated_gradient(budget):
    torch.manual_seed(0)
    model = mlp.MLP(8, 32, 4, depth=6)
    steps = regression_steps()
    make_opt = OPTIMIZERS["adamw"]
    want_losses, want_state, norms = eager_accumulated(model, clipped_loss, steps, make_opt, max_grad_norm=1.0)
    assert all(n > 1.0 for n in norms)  # every step was clipped
    mg = memgraph.compile(model, clipped_loss, steps[0][0], optimizer=make_opt(trainable(model)), budget=budget,
                          device="cpu", max_grad_norm=1.0, accumulation_steps=K, verbose=False)
    for ordering in ("deterministic", "nondeterministic"):
        assert_same_losses(run_compiled(mg, steps, ordering), want_losses)
        assert_same_state(mg.state_dict(), want_state)


def test_batchnorm_and_inplace_relu_accumulate_like_eager():
    """Running statistics are updated by every micro-batch's forward, as in eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(inplace=True),
                                torch.nn.Linear(16, 4))
    steps = regression_steps(1)
    make_opt = OPTIMIZERS["sgd"]
    want_losses, want_state, _ = eager_accumulated(model, clipped_loss, steps, make_opt)
    mg = memgraph.compile(model, clipped_loss, steps[0][0], optimizer=make_opt(trainable(model)), device="cpu",
                          accumulation_steps=K, verbose=False)
    assert_same_losses(run_compiled(mg, steps), want_losses)
    assert_same_state(mg.state_dict(), want_state)


def test_gradients_without_optimizer_are_eagers_accumulated_grads():
    """Traced without an optimizer, the step's outputs are the accumulated gradients: eager's .grad
    after the K backward passes (the reference executor runs the TaskGraph op by op)."""
    model, loss_fn, _ = make_case("gpt")
    loss_fn = per_micro_batch(loss_fn)
    micro = micro_batches("gpt", model)[0]
    eager = copy.deepcopy(model)
    for b in micro:
        loss_fn(eager, b).backward()
    tg = memgraph.trace(model, loss_fn, micro[0], device="cpu", accumulation_steps=K)
    out = memgraph.ReferenceExecutor(tg).run(micro)
    grads = {name: p.grad for name, p in eager.named_parameters() if p.grad is not None}
    assert grads and {f"grad:{name}" for name in grads} == {k for k in out if k.startswith("grad:")}
    for name, grad in grads.items():
        assert torch.equal(out[f"grad:{name}"], grad), name


def test_wrong_number_of_micro_batches_is_refused_clearly():
    torch.manual_seed(0)
    model = mlp.MLP(8, 32, 4, depth=3)
    steps = regression_steps(2)
    make_opt = OPTIMIZERS["adamw"]
    want_losses, want_state, _ = eager_accumulated(model, clipped_loss, steps, make_opt)
    mg = memgraph.compile(model, clipped_loss, steps[0][0], optimizer=make_opt(trainable(model)), device="cpu",
                          accumulation_steps=K, verbose=False)
    micro = steps[0]
    for batch, got in [(micro[:3], "a list of 3"), (micro + micro[:1], "a list of 5"),
                       (tuple(micro[:2]), "a tuple of 2"), (micro[0], "a tuple of 2"), ({"x": micro[0][0]}, "a dict")]:
        with pytest.raises(BatchError, match=rf"accumulation_steps={K}\): engine.run takes a list of {K} batches, "
                                             rf"each like the example batch, got {got}$"):
            engine.run(mg, batch)
    wrong = [*micro[:2], (micro[2][0][:8], micro[2][1][:8]), micro[3]]
    with pytest.raises(BatchError, match=r"micro-batch 2 of 4: batch input '\[2\]\[0\]' \(leaf 0\): "
                                         r"expected shape \(16, 8\) float32, got \(8, 8\) float32"):
        engine.run(mg, wrong)
    with pytest.raises(BatchError, match=r"micro-batch 1 of 4: batch has 1 leaves, the traced example had 2"):
        engine.run(mg, [micro[0], micro[1][0], *micro[2:]])
    # nothing ran: the steps still train exactly like eager's
    torch.manual_seed(SEED)
    assert_same_losses([engine.run(mg, [list(b) for b in s]) for s in steps], want_losses)  # lists for tuples
    assert_same_state(mg.state_dict(), want_state)


def test_saved_and_loaded_memgraph_keeps_accumulating(tmp_path):
    torch.manual_seed(0)
    model = mlp.MLP(8, 32, 4, depth=3)
    steps = regression_steps(3)
    make_opt = OPTIMIZERS["sgd"]
    want_losses, want_state, _ = eager_accumulated(model, clipped_loss, steps, make_opt)
    mg = memgraph.compile(model, clipped_loss, steps[0][0], optimizer=make_opt(trainable(model)), device="cpu",
                          accumulation_steps=K, verbose=False)
    mg.save(tmp_path / "step.mg")
    loaded = memgraph.load(tmp_path / "step.mg")
    assert loaded.taskgraph.accumulation_steps == K
    with pytest.raises(BatchError, match=f"list of {K} batches"):
        engine.run(loaded, steps[0][:2])
    assert_same_losses(run_compiled(loaded, steps), want_losses)
    assert_same_state(loaded.state_dict(), want_state)


def test_one_accumulation_step_is_the_ordinary_step():
    model, loss_fn, batches = make_case("mlp")
    make_opt = OPTIMIZERS["adamw"]
    plain = memgraph.trace(model, loss_fn, batches[0], optimizer=make_opt(trainable(model)), device="cpu")
    one = memgraph.trace(model, loss_fn, batches[0], optimizer=make_opt(trainable(model)), device="cpu",
                         accumulation_steps=1)
    assert one.accumulation_steps == 1 and set(one.outputs) == set(plain.outputs) == {"loss"}
    assert [(v.op, v.args, v.kwargs, v.outputs, v.phase, v.module, v.copy_in) for v in one.vertices] == \
        [(v.op, v.args, v.kwargs, v.outputs, v.phase, v.module, v.copy_in) for v in plain.vertices]
    assert [(v.name, v.kind, v.shape) for v in one.values] == [(v.name, v.kind, v.shape) for v in plain.values]
    want_losses, want_state = eager_steps(model, loss_fn, batches, make_opt)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=make_opt(trainable(model)), budget=0.5,
                          device="cpu", accumulation_steps=1, verbose=False)
    torch.manual_seed(123)
    got = [engine.run(mg, b)["loss"] for b in batches]
    assert all(torch.equal(a, w) for a, w in zip(got, want_losses))
    assert_same_state(mg.state_dict(), want_state)
    with pytest.raises(BatchError, match="structure differs"):  # a list of batches is not a batch
        engine.run(mg, [batches[0]])


@pytest.mark.parametrize("steps", [0, -2, 2.0, True, "4"])
def test_accumulation_steps_must_be_a_positive_int(steps):
    model, loss_fn, batches = make_case("mlp")
    with pytest.raises(memgraph.UnsupportedFeature,
                       match=rf"accumulation_steps must be a positive int .*got {steps!r}"):
        memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS["sgd"](trainable(model)), device="cpu",
                         accumulation_steps=steps, verbose=False)
