"""Buffer donation (trace/donate.py): an op writes its result over an input that dies there."""

from __future__ import annotations

import pytest
import torch
from cases import bf16_autocast
from turnip.bench.models import mlp
from turnip.ir.plan import Plan
from turnip.kernels.ops import out_variant, resolve_op
from turnip.memgraph.builder import build
from turnip.planners.memory import Decisions, evaluate
from turnip.planners.problem import build_problem
from turnip.trace.donate import ALIASABLE, donate_dying_inputs
from turnip.trace.tracer import trace

from turnip import gpt

aten = torch.ops.aten


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _inputs(op: str, slot: int, device: str, columns: int):
    """Arguments for op (positional, keyword) with the tensor at `slot` fresh, so it can be overwritten."""
    g = torch.Generator().manual_seed(len(op) + slot)
    a, b = (torch.randn(16, columns, generator=g).to(device) for _ in range(2))
    if op in ("aten::_log_softmax", "aten::_softmax"):
        return [a, 1, False], {}
    if op == "aten::_log_softmax_backward_data":
        return [a, aten._log_softmax(b, 1, False), 1, torch.float32], {}
    if op == "aten::_softmax_backward_data":
        return [a, aten._softmax(b, 1, False), 1, torch.float32], {}
    if op in ("aten::pow.Tensor_Scalar", "aten::mul.Scalar", "aten::add.Scalar", "aten::div.Scalar"):
        return [a, 3.0 if op != "aten::pow.Tensor_Scalar" else 2.0], {}
    if op == "aten::rsqrt":
        return [a.abs() + 0.1], {}
    if op in ("aten::gelu", "aten::silu", "aten::relu", "aten::neg", "aten::exp", "aten::sigmoid", "aten::tanh"):
        return [a], ({"approximate": "tanh"} if op == "aten::gelu" else {})
    if op == "aten::gelu_backward":
        return [a, b], {"approximate": "tanh"}
    if op == "aten::threshold_backward":
        return [a, b, 0.0], {}
    if op in ("aten::tanh_backward", "aten::sigmoid_backward"):
        return [a, torch.sigmoid(b)], {}
    return [a, b], {}  # binary elementwise


# 300 columns: CUDA's one-warp-per-row softmax kernels; 5000: its block-per-row ones
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("columns", [300, 5000])
@pytest.mark.parametrize("op,slot", [(op, s) for op, slots in sorted(ALIASABLE.items()) for s in slots])
def test_each_aliasable_kernel_gives_its_own_result_over_its_input(op, slot, columns, device):
    args, kwargs = _inputs(op, slot, device, columns)
    expected = resolve_op(op)(*args, **kwargs)
    variant = out_variant(op)  # the overload the rewrite uses
    assert variant is not None and len(variant[1]) == 1, f"{op} has no out= overload"
    out_op, (out_name,) = variant
    target = args[slot].clone()
    args[slot] = target
    out_op(*args, **kwargs, **{out_name: target})
    assert torch.equal(target, expected), f"{op} written over argument {slot} differs from its own result"


def _trace_tiny_gpt(donate: bool, monkeypatch):
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(vocab=512, seq=32, d_model=32, n_layers=2, n_heads=2)
    model = gpt.GPT(cfg)
    batch = gpt.example_batch(cfg, batch=4, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return trace(model, bf16_autocast(gpt.lm_loss), batch, optimizer=opt, device=torch.device("cpu"), donate=donate)


def test_the_loss_softmax_and_its_backward_take_the_bytes_of_what_they_read(monkeypatch):
    tg = _trace_tiny_gpt(True, monkeypatch)
    rewritten = {v.op for v in tg.vertices if v.copy_in and v.phase != "optimizer"}
    assert "aten::_log_softmax.out" in rewritten
    assert "aten::_log_softmax_backward_data.out" in rewritten
    for v in tg.vertices:
        if v.op == "aten::_log_softmax.out":
            (old, new), = v.copy_in
            readers = [u.id for u in tg.vertices if old in u.inputs()]
            assert readers[-1] == v.id  # only a dying input is donated
            assert v.kwargs["out"].value == new


def test_donation_lowers_the_unplanned_peak_in_builder_and_planner_alike(monkeypatch):
    with_donation = _trace_tiny_gpt(True, monkeypatch)
    without = _trace_tiny_gpt(False, monkeypatch)
    logits = 4 * 32 * 512 * 4  # the fp32 logits of one batch, the largest donated value
    arena = {k: build(tg, Plan(gpu_budget=1 << 62, planner="none"), alignment=64, compact=True).arena_bytes
             for k, tg in (("on", with_donation), ("off", without))}
    assert arena["off"] - arena["on"] >= 0.9 * logits  # packing moves a few aligned bytes around
    planned = {}
    for k, tg in (("on", with_donation), ("off", without)):
        problem = build_problem(tg, 1 << 40, bw_h2d=1e10, bw_d2h=1e10, alignment=64)
        planned[k] = evaluate(problem, Decisions.keep_all(problem)).peak
    assert planned["off"] - planned["on"] >= 0.9 * logits


def test_an_input_read_after_the_op_is_not_donated():
    class SoftmaxTwice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return torch.softmax(h, -1).sum() + h.square().sum()  # h is read after the softmax

    tg = trace(SoftmaxTwice(), lambda m, b: m(b), torch.randn(4, 8), device=torch.device("cpu"))
    softmax = [v for v in tg.vertices if v.op.startswith("aten::_softmax") and v.phase == "forward"]
    assert softmax and not softmax[0].copy_in
    assert donate_dying_inputs(tg) == 0  # a second pass finds nothing new either


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", [0, 1, 2])  # none, mean, sum
@pytest.mark.parametrize("weighted", [False, True])
def test_nll_loss_backward_never_reads_the_values_of_self(device, reduction, weighted):
    g = torch.Generator().manual_seed(reduction)
    lsm = torch.randn(64, 1000, generator=g).log_softmax(1).to(device)
    target = torch.randint(0, 1000, (64,), generator=g).to(device)
    target[3] = -100  # ignored
    weight = torch.rand(1000, generator=g).to(device) if weighted else None
    grad = torch.randn(64 if reduction == 0 else (), generator=g).to(device)
    _, total_weight = aten.nll_loss_forward(lsm, target, weight, reduction, -100)
    expected = aten.nll_loss_backward(grad, lsm, target, weight, reduction, -100, total_weight)
    own = torch.full_like(lsm, float("nan"))  # what an arena buffer may hold before the op writes it
    aten.nll_loss_backward.grad_input(grad, own, target, weight, reduction, -100, total_weight, grad_input=own)
    assert torch.equal(own, expected)


def test_nll_loss_backward_reads_its_own_buffer_instead_of_the_log_softmax(monkeypatch):
    tg = _trace_tiny_gpt(True, monkeypatch)
    (nll_bwd,) = [v for v in tg.vertices if v.op == "aten::nll_loss_backward"]
    (nll_fwd,) = [v for v in tg.vertices if v.op == "aten::nll_loss_forward"]
    assert nll_bwd.args[1].value == nll_bwd.outputs[0]  # self: the op's own buffer
    lsm = nll_fwd.args[0].value
    assert lsm not in nll_bwd.inputs()


def test_the_planner_counts_an_in_place_update_once():
    """A fused update writes each parameter and state over its old version: the planner's
    keep-everything peak is the builder's, not a block of weights and states higher."""
    torch.manual_seed(0)
    model = mlp.MLP(depth=10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tg = trace(model, mlp.mlp_loss, mlp.example_batch(batch=2, seed=0), optimizer=opt,
                            device=torch.device("cpu"), fused_optimizer=True)
    arena = build(tg, Plan(gpu_budget=1 << 62, planner="none"), alignment=64, compact=True).arena_bytes
    problem = build_problem(tg, 1 << 40, bw_h2d=1e10, bw_d2h=1e10, alignment=64)
    assert evaluate(problem, Decisions.keep_all(problem)).peak <= arena + 64
