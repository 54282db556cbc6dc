"""Gradient clipping traced into the step: the numbers of eager's clip_grad_norm_ before optimizer.step()."""

from __future__ import annotations

import copy

import pytest
import torch
from turnip.bench.models.mlp import MLP

from turnip import engine, memgraph

STEPS = 3


def loss_fn(m, b):
    return torch.nn.functional.mse_loss(m(b[0]), b[1]) * 100.0  # large gradients: the clip really clips


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("budget", [1.0, 0.5, 0.25])
def test_clipped_steps_match_eager_bitwise(budget, norm_type):
    torch.manual_seed(0)
    model = MLP(8, 32, 4, depth=8)
    batches = [(torch.randn(32, 8), torch.randn(32, 4)) for _ in range(STEPS)]
    eager_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-2, weight_decay=0.1)
    want, norms = [], []
    for b in batches:
        opt.zero_grad()
        loss = loss_fn(eager_model, b)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(eager_model.parameters(), 1.0, norm_type))
        opt.step()
        want.append(loss.detach())
    assert all(n > 1.0 for n in norms)  # every step was clipped

    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2,
                          weight_decay=0.1), budget=budget, device="cpu", max_grad_norm=1.0, norm_type=norm_type)
    got = [engine.run(mg, b, ordering="deterministic" if k % 2 else "nondeterministic")["loss"]
           for k, b in enumerate(batches)]
    assert all(torch.equal(a, w) for a, w in zip(got, want)), f"{got} != {want}"
    state = mg.state_dict()
    assert all(torch.equal(state[k], v) for k, v in eager_model.state_dict().items())
