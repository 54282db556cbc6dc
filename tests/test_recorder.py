"""The recording of a step's ATen ops (trace/recorder.py) records what eager runs: a gradient
accumulated in place is taken, not copied; a constant made in the forward is copied before it is
written; a higher-order operator is refused where it was called."""

import pytest
import torch
from cases import eager_steps
from torch import nn
from turnip.memgraph import ReferenceExecutor
from turnip.trace.errors import UnsupportedOp
from turnip.trace.recorder import Recorder, recording

from turnip import memgraph


def _mse(model, batch):
    return ((model(batch[0]) - batch[1]) ** 2).mean()


def test_an_accumulated_gradient_is_taken_by_autograd_not_copied():
    """AccumulateGrad takes the first micro-batch's gradient as .grad when nothing else holds it
    and copies it otherwise: a recording that held the ops' results would add a clone per
    parameter to the step, which eager does not run."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    batch = (torch.randn(4, 8), torch.randn(4, 2))
    tg = memgraph.trace(model, _mse, batch, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        device="cpu", accumulation_steps=2)
    assert not [v.op for v in tg.vertices if v.op in ("aten::clone", "aten::copy_")]
    adds = [v for v in tg.vertices if v.op == "aten::add_.Tensor" and v.phase == "backward"]
    assert len(adds) == 4  # the second micro-batch's gradient of each parameter, added in place


class _Scaled(nn.Module):
    """Makes a small constant in its forward and writes into it, as code building a scale does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        scale = torch.tensor([0.5, 2.0, 1.0, 3.0])
        scale.mul_(2.0)
        return self.lin(x) * scale


def test_a_constant_made_in_the_forward_is_copied_before_it_is_written():
    """torch.tensor(...) reaches the dispatcher as a lift of a fresh tensor, recorded as a copy: the
    write into it writes the copy, and every step starts from the constant again, as eager's does."""
    torch.manual_seed(0)
    model = _Scaled()
    batches = [(torch.randn(3, 4), torch.randn(3, 4)) for _ in range(3)]
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1)
    want_losses, want_state = eager_steps(model, _mse, batches, make_opt)
    tg = memgraph.trace(model, _mse, batches[0], optimizer=make_opt(model.parameters()), device="cpu")
    assert [v.op for v in tg.vertices if v.op.startswith("aten::lift")] == ["aten::lift_fresh_copy"]
    runner = ReferenceExecutor(tg)
    losses = [runner.run(b)["loss"].clone() for b in batches]
    assert [x.item() for x in losses] == [x.item() for x in want_losses]
    state = runner.state_dict()
    for key, value in want_state.items():
        assert torch.equal(state[key], value), key


class _Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda y: self.lin(y).relu(), lambda y: self.lin(y), (x,))


def test_a_higher_order_operator_is_refused_naming_the_module_and_line():
    with pytest.raises(UnsupportedOp, match=r"op cond in the model's own forward \(_Branching\), at .*test_recorder"
                                             r"\.py:\d+ `return torch\.cond.*is not an ATen op"):
        memgraph.trace(_Branching(), _mse, (torch.randn(2, 4), torch.randn(2, 4)), device="cpu")


def test_the_recording_keeps_each_argument_as_the_op_saw_it():
    """An in-place change of a tensor's layout after an op ran does not change what the op read."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode()
    with fake_mode:
        x = torch.empty(2, 3)
    recorder = Recorder()
    recorder.add_input(x)
    with fake_mode, recording(recorder):
        y = x.clone()
        torch.neg(y)
        y.t_()
        torch.neg(y)
    negs = [n for n in recorder.nodes if n.kind == "op" and n.target is torch.ops.aten.neg.default]
    assert [(a.seen.shape, a.seen.stride) for n in negs for a in n.arguments()] == [((2, 3), (3, 1)),
                                                                                     ((3, 2), (1, 3))]
    made_by = {n.target: i for i, n in enumerate(recorder.nodes) if n.kind == "op"}
    # the first neg read the clone's result, the second the same tensor as t_ returned it
    assert [a.node for n in negs for a in n.arguments()] == [made_by[torch.ops.aten.clone.default],
                                                             made_by[torch.ops.aten.t_.default]]



@pytest.mark.parametrize("name", ["gpt", "hf_gpt2"])
def test_the_recording_holds_the_ops_make_fx_records(name):
    """The recorder stands in for make_fx: on the same forward and backward over the same fake
    tensors, it records the same ATen ops in the same order (a torch whose make_fx records more or
    other ops than the recorder would trace another step than the one eager runs)."""
    from cases import make_case
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    model, loss_fn, batches = make_case(name)
    names = [n for n, _ in model.named_parameters()]

    def step(params, batch):
        loss = loss_fn(_Bound(model, dict(zip(names, params))), batch)
        return torch.autograd.grad(loss, params)

    fake_mode = FakeTensorMode()
    params = [fake_mode.from_tensor(p).requires_grad_() for p in model.parameters()]
    batch = [fake_mode.from_tensor(b) if isinstance(b, torch.Tensor) else b for b in batches[0]] \
        if isinstance(batches[0], (list, tuple)) else fake_mode.from_tensor(batches[0])
    graph = make_fx(step, tracing_mode="fake")(params, batch)
    by_make_fx = [str(n.target) for n in graph.graph.nodes
                  if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    recorder = Recorder()
    with fake_mode, recording(recorder):
        step(params, batch)
    recorded = [str(n.target) for n in recorder.nodes if n.kind == "op"]
    assert recorded == by_make_fx
    assert len(recorded) > 100


class _Bound(nn.Module):
    """The model called with other parameters (torch.func.functional_call), as the tracer binds its
    fake parameters."""

    def __init__(self, model, params):
        super().__init__()
        self.model, self.params = model, params

    def forward(self, *args, **kwargs):
        from torch.func import functional_call

        return functional_call(self.model, self.params, args, kwargs)
