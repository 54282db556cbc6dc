"""Concatenations written in place (trace/cat_in_place.py): a cat's part made just before it by an
elementwise op is written straight into its slice of the result, bitwise as eager computes it."""

from __future__ import annotations

import pytest
import torch
from cases import OPTIMIZERS, assert_same_state, eager_steps, trainable
from turnip.ir.plan import Plan
from turnip.ir.taskgraph import TaskGraph, ValueKind
from turnip.memgraph.builder import build
from turnip.trace import passes as trace_passes
from turnip.trace.cat_in_place import NEAR, write_concats_in_place
from turnip.trace.tracer import trace

from turnip import engine, memgraph


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # Llama's rotary embedding


class Rotary(torch.nn.Module):
    """Two layers of q * cos + rotate_half(q) * sin between linear maps: the pattern of Llama's
    attention, trained end to end."""

    def __init__(self, width: int = 32, layers: int = 2):
        super().__init__()
        self.maps = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        angles = torch.arange(width, dtype=torch.float32) / width
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x):
        for lin in self.maps:
            q = lin(x)
            x = q * self.cos + rotate_half(q) * self.sin
        return x


def loss_fn(model, batch):
    return model(batch).square().mean()


def batches(count: int = 3):
    gens = [torch.Generator().manual_seed(i) for i in range(count)]
    return [torch.randn(8, 32, generator=g) for g in gens]


def _trace(model, rewrite: bool, monkeypatch, backward: bool = True) -> TaskGraph:
    if not rewrite:
        monkeypatch.setattr(trace_passes, "CAT_IN_PLACE", trace_passes.Pass("off", lambda tg: tg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if backward else None
    return trace(model, loss_fn, batches(1)[0], optimizer=opt, device=torch.device("cpu"),
                              backward=backward) if backward else trace(
        model, lambda m, b: m(b), batches(1)[0], device=torch.device("cpu"), backward=False)


def test_each_rotary_cat_loses_its_negated_part(monkeypatch):
    plain = _trace(Rotary(), False, monkeypatch)
    monkeypatch.undo()
    rewritten = _trace(Rotary(), True, monkeypatch)
    forward_cats = [v for v in plain.vertices if v.op == "aten::cat" and v.phase == "forward"]
    assert len(forward_cats) == 2
    neg_out = [v for v in rewritten.vertices if v.op == "aten::neg.out"]
    assert len(neg_out) == 2
    for v in neg_out:
        (old, new), = v.copy_in
        out = v.kwargs["out"]
        result = rewritten.values[new]
        assert out.value == new and out.size[-1] * 2 == result.shape[-1] and out.storage_offset == 0
        assert rewritten.vertices[rewritten.values[old].producer].op == "aten::empty_strided"
        copy = [u for u in rewritten.vertices if u.copy_in and u.copy_in[0][0] == new]
        assert [u.op for u in copy] == ["aten::copy_"]  # the other half, where the cat was
        assert copy[0].args[0].storage_offset == out.size[-1]
    assert sum(v.op == "aten::cat" and v.phase == "forward" for v in rewritten.vertices) == 0
    # the negated halves are gone: every intermediate has a producer, and there are fewer values to place
    assert all(v.producer >= 0 for v in rewritten.values if v.kind is ValueKind.INTERMEDIATE)
    keep_all = {name: build(tg, Plan(gpu_budget=1 << 62, planner="none"), alignment=64, compact=True)
                for name, tg in (("plain", plain), ("rewritten", rewritten))}
    assert keep_all["rewritten"].arena_bytes <= keep_all["plain"].arena_bytes


def test_a_part_made_far_before_the_cat_or_read_elsewhere_is_left_alone(monkeypatch):
    class Far(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            a = -self.lin(x)
            h = x
            for _ in range(NEAR + 1):
                h = torch.tanh(h)  # ops between a's maker and the cat: a would hold the result's bytes too long
            b = x * 2.0
            return torch.cat((a, x), -1).sum() + h.sum() + torch.cat((b, x), -1).sum() + b.sum()  # b read twice

    tg = trace(Far(), lambda m, b: m(b), torch.randn(4, 16), device=torch.device("cpu"), backward=False,
                            donate=False)
    assert not any(v.op == "aten::empty_strided" or v.op.endswith(".out") for v in tg.vertices)
    assert sum(v.op == "aten::cat" for v in tg.vertices) == 2
    assert write_concats_in_place(tg) is tg


@pytest.mark.parametrize("budget", [None, 0.6, 0.35])
def test_training_through_rewritten_cats_is_bitwise_like_eager(budget):
    torch.manual_seed(0)
    model = Rotary()
    data = batches()
    want_losses, want_state = eager_steps(model, loss_fn, data, OPTIMIZERS["adamw"])
    mg = memgraph.compile(model, loss_fn, data[0], optimizer=OPTIMIZERS["adamw"](trainable(model)), budget=budget,
                          device="cpu")
    assert any(v.op == "aten::neg.out" for v in mg.taskgraph.vertices)
    assert memgraph.verify(mg) == []
    for ordering, seed in [("deterministic", None), ("nondeterministic", None), ("random", 4)]:
        mg.runtime = None
        torch.manual_seed(123)
        losses = [engine.run(mg, b, ordering=ordering, seed=seed)["loss"] for b in data]
        assert [x.item() for x in losses] == [x.item() for x in want_losses], (budget, ordering)
        assert_same_state(mg.state_dict(), want_state)


@pytest.mark.parametrize("budget", [None, 0.5])
def test_a_forward_through_rewritten_cats_is_bitwise_like_eager(budget):
    torch.manual_seed(0)
    model = Rotary(layers=3)
    x = batches(1)[0]
    with torch.no_grad():
        want = model(x)
    mg = memgraph.compile(model, lambda m, b: m(b), x, backward=False, budget=budget, device="cpu")
    assert sum(v.op == "aten::neg.out" for v in mg.taskgraph.vertices) == 3
    got = engine.run(mg, x)["output"]
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("budget", [None, 0.6])
def test_training_through_rewritten_cats_on_cuda_matches_eager(budget):
    torch.manual_seed(0)
    model = Rotary(width=2048, layers=3).cuda()  # large enough that 60% is above the streams' own workspace
    data = [b.repeat(16, 64).cuda() for b in batches()]
    want_losses, want_state = eager_steps(model, loss_fn, data, OPTIMIZERS["adamw"])
    mg = memgraph.compile(model, loss_fn, data[0], optimizer=OPTIMIZERS["adamw"](trainable(model)), budget=budget,
                          device="cuda", cache=False)
    assert any(v.op == "aten::neg.out" for v in mg.taskgraph.vertices)
    torch.manual_seed(123)
    losses = [engine.run(mg, b)["loss"] for b in data]
    torch.testing.assert_close(torch.stack(losses).cpu(), torch.stack(want_losses).cpu(), rtol=1e-5, atol=1e-6)
    assert_same_state(mg.state_dict(), want_state, exact=False)
