"""Models with in-place activations (nn.ReLU(inplace=True)) compile and train like eager, bitwise on the CPU."""

from __future__ import annotations

import pytest
import torch
from cases import assert_same_state, eager_steps
from torch import nn

from turnip import engine, memgraph

STEPS = 3


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


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

    want, want_state = eager_steps(model, loss_fn, batches, sgd)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=sgd(model.parameters()), budget=budget,
                          device="cpu")
    assert memgraph.verify(mg) == []
    assert any(v.op == "aten::relu_" for v in mg.taskgraph.vertices)
    got = [engine.run(mg, b, ordering="deterministic" if k % 2 else "nondeterministic")["loss"]
           for k, b in enumerate(batches)]
    assert all(torch.equal(a, w) for a, w in zip(got, want)), f"{got} != {want}"
    assert_same_state(mg.state_dict(), want_state)


@pytest.mark.parametrize("budget", [1.0, 0.5])
def test_t5_with_its_in_place_position_bias_trains_like_eager(budget):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, dropout_rate=0.0, relative_attention_num_buckets=8,
                                decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    batches = [(torch.randint(1, 64, (2, 12)), torch.randint(1, 64, (2, 8))) for _ in range(STEPS)]

    def loss_fn(m, b):
        return m(input_ids=b[0], labels=b[1]).loss

    want, _ = eager_steps(model, loss_fn, batches, adamw)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(model.parameters()), budget=budget,
                          device="cpu")
    got = [engine.run(mg, b)["loss"] for b in batches]
    assert all(torch.equal(a, w) for a, w in zip(got, want)), f"{got} != {want}"
