"""A loss_fn that needs gradients to exist (clip_grad_norm_, .grad, backward) is refused at compile, naming
what it did and pointing at compile(..., max_grad_norm=...), instead of silently doing nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_value_

from turnip import memgraph


def mse(m, b):
    return nn.functional.mse_loss(m(b[0]), b[1])


def clips_by_norm(m, b):
    loss = mse(m, b)
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    return loss


def clips_by_value(m, b):  # imported by name: caught all the same
    loss = mse(m, b)
    clip_grad_value_(m.parameters(), 0.5)
    return loss


def clips_by_hand(m, b):
    loss = mse(m, b)
    for p in m.parameters():
        if p.grad is not None:
            p.grad.clamp_(-1, 1)
    return loss


def zeroes_gradients(m, b):
    m.zero_grad()
    return mse(m, b)


def calls_backward(m, b):
    loss = mse(m, b)
    loss.backward()
    return loss


def model_and_batch():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), (torch.randn(3, 4), torch.randn(3, 2))


@pytest.mark.parametrize("loss_fn,names", [
    (clips_by_norm, ["clip_grad_norm_", ".grad of parameter '0.weight'", "max_grad_norm"]),
    (clips_by_value, ["clip_grad_value_", ".grad of parameter '0.weight'", "max_grad_norm"]),
    (clips_by_hand, ["in clips_by_hand", ".grad of parameter '0.weight'", "max_grad_norm"]),
    (zeroes_gradients, ["zero_grad", ".grad of parameter"]),
    (calls_backward, ["calls backward()", "in torch._tensor.Tensor.backward"]),
])
def test_loss_fn_needing_gradients_is_refused_at_compile(loss_fn, names):
    model, batch = model_and_batch()
    with pytest.raises(memgraph.UnsupportedFeature) as info:
        memgraph.compile(model, loss_fn, batch, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    msg = str(info.value)
    assert all(name in msg for name in names), msg
    assert f"{__file__}:" in msg  # the user's line that led there


def test_the_same_loss_without_gradient_code_compiles_and_the_guard_is_gone():
    model, batch = model_and_batch()
    tg = memgraph.trace(model, mse, batch, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert "loss" in tg.outputs
    # after compile, gradient code outside loss_fn works as in eager: the guard only watches the trace
    loss = mse(model, batch)
    loss.backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) > 0
