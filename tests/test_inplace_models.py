"""Models with in-place activations (nn.ReLU(inplace=True)) compile and train like eager, bitwise on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from turnip import engine, memgraph

STEPS = 3


def mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(inplace=True), nn.Linear(32, 32), nn.ReLU(inplace=True),
                         nn.Linear(32, 4)), (16, 8), (16, 4)


def convnet():
    """A torchvision-style stem and two conv blocks (no BatchNorm: train-mode BN is not supported yet)."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4)), (4, 3, 16, 16), (4, 4)


@pytest.mark.parametrize("make,budget", [(mlp, 1.0), (mlp, 0.5), (convnet, 1.0), (convnet, 0.8)],
                         ids=["mlp-1.0", "mlp-0.5", "convnet-1.0", "convnet-0.8"])
def test_in_place_relu_trains_like_eager(make, budget):
    torch.manual_seed(0)
    model, x_shape, y_shape = make()
    batches = [(torch.randn(x_shape), torch.randn(y_shape)) for _ in range(STEPS)]

    def loss_fn(m, b):
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    eager_model = copy.deepcopy(model)
    opt = torch.optim.SGD(eager_model.parameters(), lr=0.1, momentum=0.9)
    want = []
    for b in batches:
        opt.zero_grad()
        loss = loss_fn(eager_model, b)
        loss.backward()
        opt.step()
        want.append(loss.detach())
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=torch.optim.SGD(model.parameters(), lr=0.1,
                          momentum=0.9), budget=budget, device="cpu")
    assert memgraph.verify(mg) == []
    assert any(v.op == "aten::relu_" for v in mg.taskgraph.vertices)
    got = [engine.run(mg, b, ordering="deterministic" if k % 2 else "nondeterministic")["loss"]
           for k, b in enumerate(batches)]
    assert all(torch.equal(a, w) for a, w in zip(got, want)), f"{got} != {want}"
    state = mg.state_dict()
    assert all(torch.equal(state[k], v) for k, v in eager_model.state_dict().items())
