"""Batches as data loaders give them: dict keys in any order, lists for tuples, non-tensor leaves as
compile-time constants, and one clear line for a batch that does not fit the compiled step."""

from __future__ import annotations

import copy

import pytest
import torch
from turnip.bench.models.mlp import MLP
from turnip.engine import BatchError

from turnip import engine, memgraph

STEPS = 3


def loss_fn(m, b):
    """Reads a float and a str from the batch: both are constants of the compiled step."""
    x, mask = b["inputs"]
    out = m(x * mask)
    return torch.nn.functional.mse_loss(out, b["target"], reduction=b["reduction"]) * b["scale"]


def make_batches(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [{"target": torch.randn(64, 4, generator=g), "scale": 0.5, "reduction": "sum",
             "inputs": (torch.randn(64, 8, generator=g), (torch.rand(64, 8, generator=g) > 0.2).float())}
            for _ in range(STEPS)]


def as_loader_gives_it(batch: dict, k: int) -> dict:
    """The same batch with its keys in another order (each step another) and lists for tuples."""
    keys = sorted(batch, reverse=bool(k % 2)) if k else list(reversed(list(batch)))
    return {key: list(batch[key]) if isinstance(batch[key], tuple) else batch[key] for key in keys}


def compiled(budget=1.0):
    torch.manual_seed(0)
    model = MLP(8, 32, 4, depth=4)
    batches = make_batches()
    eager_model = copy.deepcopy(model)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                          budget=budget, device="cpu")
    return mg, eager_model, batches


@pytest.mark.parametrize("budget", [1.0, 0.6, 0.4])
def test_batches_in_another_key_order_and_as_lists_train_like_eager(budget):
    mg, eager_model, batches = compiled(budget)
    opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-2)
    want = []
    for b in batches:
        opt.zero_grad()
        loss = loss_fn(eager_model, b)
        loss.backward()
        opt.step()
        want.append(loss.detach())
    assert set(mg.taskgraph.batch_constants.values()) == {0.5, "sum"}
    moved = mg.summary()
    assert budget == 1.0 or moved["bytes_offloaded"] + moved["bytes_reloaded"] > 0 or mg.plan.recompute
    got = [engine.run(mg, as_loader_gives_it(b, k), ordering="deterministic" if k % 2 else "nondeterministic")["loss"]
           for k, b in enumerate(batches)]
    assert all(torch.equal(a, w) for a, w in zip(got, want)), f"{got} != {want}"
    state = mg.state_dict()
    assert all(torch.equal(state[k], v) for k, v in eager_model.state_dict().items())


def test_the_reference_executor_reads_batches_as_the_engine_does():
    mg, _, batches = compiled()
    reference = memgraph.ReferenceExecutor(mg.taskgraph)
    want = engine.run(mg, batches[0])["loss"]
    assert torch.equal(reference.run(as_loader_gives_it(batches[0], 1))["loss"], want)


@pytest.mark.parametrize("key,value,traced", [("scale", 0.25, "0.5 (float)"), ("scale", 1, "0.5 (float)"),
                                              ("reduction", "mean", "'sum' (str)")])
def test_a_different_constant_is_refused_naming_the_leaf(key, value, traced):
    mg, _, batches = compiled()
    bad = dict(batches[0], **{key: value})
    with pytest.raises(BatchError) as info:
        engine.run(mg, bad)
    msg = str(info.value)
    assert f"batch input '['{key}']'" in msg and f"traced with {traced}, got {value!r}" in msg, msg
    assert mg.runtime is None  # refused before anything was allocated or ran


def test_a_batch_of_another_size_gets_one_line_naming_the_input():
    mg, _, batches = compiled()
    short = {**batches[0], "target": batches[0]["target"][:5],
             "inputs": [t[:5] for t in batches[0]["inputs"]]}
    with pytest.raises(BatchError) as info:
        engine.run(mg, short)
    msg = str(info.value)
    assert "\n" not in msg
    assert "['inputs'][0]" in msg and "expected shape (64, 8) float32, got (5, 8) float32" in msg, msg
    assert "drop_last=True" in msg
    longer = {**batches[0], "target": torch.cat([batches[0]["target"]] * 2)}
    with pytest.raises(BatchError) as info:
        engine.run(mg, longer)
    assert "\n" not in str(info.value) and "['target']" in str(info.value) and "(128, 4)" in str(info.value)


def test_another_structure_is_one_line_naming_the_leaves():
    mg, _, batches = compiled()
    renamed = {("labels" if k == "target" else k): v for k, v in batches[0].items()}
    with pytest.raises(BatchError) as info:
        engine.run(mg, renamed)
    msg = str(info.value)
    assert "\n" not in msg and "['labels']" in msg and "['target']" in msg, msg
    with pytest.raises(BatchError, match="the traced example had 5"):
        engine.run(mg, {**batches[0], "extra": 1.0})
