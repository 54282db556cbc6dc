"""Refusals that point at the user's code (issue 34, item 3): each names the op, the module path (with its
class) and the source line (file:line and the line's text) that ran it; the other messages say what is
wrong in the user's terms: a loss that is not a floating-point scalar, a batch on a device the step
cannot read, a clipping norm that is not a positive number, a dtype mismatch eager refuses too, no
third-party banner on stdout, and the op that sets the smallest budget."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from turnip.ir.errors import BatchError, InfeasibleBudget
from turnip.ir.sizes import aligned
from turnip.planners.driver import floor_vertex, run_plan, smallest_budget
from turnip.trace.errors import EagerRefusal, UnsupportedOp

from turnip import engine, memgraph

HERE = __file__


def line_of(fn, text: str) -> int:
    """The line number of the first line of `fn`'s source containing `text`."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def mse(m, b):
    return m(b).pow(2).mean()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


# -- 1. data-dependent ops name the op, the module and the line ------------------------------------

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 8)

    def forward(self, x):
        y = self.qkv(x)
        return y * y.max().item()  # host read of a value


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, x):
        return self.attn(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Identity(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y[y > 0].sum() * y  # boolean-mask indexing: a value-dependent shape


def item_in_loss(m, b):
    y = m(b)
    return y.mean() * y.max().item()


def ctc_in_loss(m, b):
    log_probs = m(b).log_softmax(-1).unsqueeze(1).expand(4, 3, 8).contiguous()
    targets = torch.tensor([[1, 2], [1, 1], [2, 3]])
    return F.ctc_loss(log_probs, targets, torch.full((3,), 4), torch.full((3,), 2))


def assert_points_at(err: UnsupportedOp, op: str, place: str, fn, text: str, file: str = HERE):
    msg = str(err)
    assert err.op == op and msg.startswith(f"op {op} in {place}, at "), msg
    line = line_of(fn, text)
    assert err.source is not None and (err.source.file, err.source.line) == (file, line), msg
    assert f"{file}:{line} `{text}" in msg, msg
    assert "depends on tensor values" in msg, msg


def test_item_in_a_nested_module_names_the_module_path_class_and_line():
    with pytest.raises(UnsupportedOp) as info:
        memgraph.trace(Model(), mse, torch.randn(2, 8))
    assert_points_at(info.value, "aten::_local_scalar_dense", "module 'blocks.1.attn' (Attention)",
                     Attention.forward, "return y * y.max().item()")
    assert info.value.module == "blocks.1.attn"


def test_item_in_loss_fn_names_loss_fn_and_its_line():
    with pytest.raises(UnsupportedOp) as info:
        memgraph.compile(nn.Linear(8, 8), item_in_loss, torch.randn(2, 8), device="cpu", verbose=False)
    assert_points_at(info.value, "aten::_local_scalar_dense", "loss_fn", item_in_loss,
                     "return y.mean() * y.max().item()")
    assert info.value.module is None


def test_a_value_dependent_shape_names_nonzero_module_and_line():
    with pytest.raises(UnsupportedOp) as info:
        memgraph.trace(nn.Sequential(nn.Linear(8, 8), Masked()), mse, torch.randn(2, 8))
    assert_points_at(info.value, "aten::nonzero", "module '1' (Masked)", Masked.forward,
                     "return y[y > 0].sum() * y")


def test_ctc_loss_is_refused_naming_op_and_line():
    with pytest.raises(UnsupportedOp) as info:
        memgraph.trace(nn.Linear(8, 8), ctc_in_loss, torch.randn(4, 8))
    assert_points_at(info.value, "aten::_ctc_loss.Tensor", "loss_fn", ctc_in_loss, "return F.ctc_loss(")
    assert "CTC loss" in str(info.value)


def test_transformers_labels_max_names_the_model_and_the_library_line():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2, vocab_size=12,
        num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, mask_time_prob=0.0, layerdrop=0.0)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(cfg)
    batch = (torch.randn(2, 400), torch.randint(1, 12, (2, 5)))
    with pytest.raises(UnsupportedOp) as info:
        memgraph.trace(model, lambda m, b: m(input_values=b[0], labels=b[1]).loss, batch)
    err, msg = info.value, str(info.value)
    assert err.op == "aten::_local_scalar_dense" and err.module == "", msg
    assert "in the model's own forward (Wav2Vec2ForCTC), at " in msg, msg
    assert err.source.file.endswith("modeling_wav2vec2.py") and "labels.max()" in err.source.text, msg
    assert f"{err.source.file}:{err.source.line} `" in msg


class ItemInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * grad.max().item()


class MutatesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        w.mul_(2)
        return grad * w, grad


class Custom(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        if self.function is ItemInBackward:
            return ItemInBackward.apply(self.lin(x))
        return MutatesInBackward.apply(self.lin(x), self.w)


def test_a_data_dependent_op_in_a_backward_names_the_forward_module_and_the_backward_line():
    model = nn.Sequential(nn.Identity(), Custom(ItemInBackward))
    with pytest.raises(UnsupportedOp) as info:
        memgraph.trace(model, mse, torch.randn(2, 4))
    err, msg = info.value, str(info.value)
    assert err.phase == "backward" and err.module == "1", msg
    assert msg.startswith("op aten::_local_scalar_dense in the backward pass of module '1' (Custom), at "), msg
    assert f"{HERE}:{line_of(ItemInBackward.backward, '.item()')} `return grad * grad.max().item()`" in msg


def test_a_refused_backward_op_names_the_forward_call_it_differentiates():
    model = nn.Sequential(nn.Identity(), Custom(MutatesInBackward))
    with pytest.raises(UnsupportedOp) as info:
        memgraph.trace(model, mse, torch.randn(2, 4))
    err, msg = info.value, str(info.value)
    assert err.op == "aten::mul_.Tensor" and err.phase == "backward" and err.module == "1", msg
    line = line_of(MutatesInBackward.forward, "return x * w")
    assert f"in the backward pass of module '1' (Custom), differentiating {HERE}:{line} `return x * w`" in msg, msg
    assert "mutates parameter input 'param:1.w' in place" in msg


@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # oneDNN's, on turning it on
def test_the_fused_lstm_refusal_points_at_the_line_calling_it():
    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(8, 16, batch_first=True)

        def forward(self, x):
            out, _ = self.rnn(x)
            return out

    with torch.backends.mkldnn.flags(enabled=True), pytest.raises(UnsupportedOp) as info:
        memgraph.trace(Recurrent(), mse, torch.randn(2, 3, 8))
    msg = str(info.value)
    assert info.value.op == "aten::mkldnn_rnn_layer" and info.value.module == "rnn", msg
    assert f"in module 'rnn' (LSTM), at {HERE}:{line_of(Recurrent.forward, 'self.rnn(x)')} `out, _ = self.rnn(x)`" in msg


# -- 2. a loss that is not a floating-point scalar -----------------------------------------------

@pytest.mark.parametrize("loss_fn, says", [
    (lambda m, b: m(b).argmax(), ("loss_fn returned a tensor of dtype torch.int64, shape (): it must return a "
                                  "floating-point scalar; an integer tensor has no gradient")),
    (lambda m, b: m(b), ("loss_fn returned a tensor of dtype torch.float32, shape (2, 8): it must return a "
                         "floating-point scalar; reduce it to one number")),
    (lambda m, b: None, "loss_fn returned a NoneType: it must return a floating-point scalar tensor"),
])
def test_a_loss_that_is_not_a_floating_point_scalar_says_what_it_is(loss_fn, says):
    with pytest.raises(memgraph.UnsupportedFeature) as info:
        memgraph.compile(nn.Linear(8, 8), loss_fn, torch.randn(2, 8), device="cpu", verbose=False)
    assert says in str(info.value) and "FakeTensor" not in str(info.value), str(info.value)


# -- 3. a batch on a device the step cannot read --------------------------------------------------

def test_a_batch_on_another_device_is_a_batch_error_naming_input_and_devices():
    model = nn.Linear(8, 1)
    mg = memgraph.compile(model, lambda m, b: m(b["x"]).pow(2).mean(), {"x": torch.randn(2, 8)}, optimizer=sgd(model),
                          device="cpu", verbose=False)
    with pytest.raises(BatchError) as info:
        engine.run(mg, {"x": torch.randn(2, 8, device="meta")})
    msg = str(info.value)
    assert "batch input '['x']' (leaf 0) is on device 'meta', and this MemGraph runs on 'cpu'" in msg, msg
    assert engine.run(mg, {"x": torch.randn(2, 8)})["loss"].dtype == torch.float32  # the engine is still usable


# -- 4. a clipping norm that is not a positive finite number --------------------------------------

def never_called(m, b):
    raise AssertionError("the norm is refused before tracing")


@pytest.mark.parametrize("norm, effect", [(-1, "flip the sign"), (0, "zero every gradient"), (0.0, "zero"),
                                          (float("nan"), ""), (float("inf"), "clips nothing"), (True, ""),
                                          ("1.0", "")])
@pytest.mark.parametrize("entry", ["compile", "trace"])
def test_a_clipping_norm_that_is_not_a_positive_number_is_refused(norm, effect, entry):
    model = nn.Linear(8, 1)
    call = memgraph.compile if entry == "compile" else memgraph.trace
    kwargs = {"verbose": False, "device": "cpu"} if entry == "compile" else {}
    with pytest.raises(ValueError) as info:
        call(model, never_called, torch.randn(2, 8), optimizer=sgd(model), max_grad_norm=norm, **kwargs)
    msg = str(info.value)
    assert msg.startswith(f"max_grad_norm={norm!r}: it must be a positive finite number"), msg
    assert effect in msg, msg


# -- 5. a dtype mismatch behaves as eager: refused with eager's error -----------------------------

@pytest.mark.parametrize("first", [nn.Linear(4, 4), nn.LayerNorm(4)], ids=["linear", "layer_norm"])
def test_a_float64_model_given_a_float32_batch_is_refused_as_eager_refuses_it(first):
    model = nn.Sequential(first, nn.Linear(4, 1)).double()
    batch = torch.randn(2, 4)
    with pytest.raises(RuntimeError) as eager:
        mse(model, batch)
    with pytest.raises(RuntimeError) as info:
        memgraph.compile(model, mse, batch, optimizer=sgd(model), device="cpu", verbose=False)
    err, msg = info.value, str(info.value)
    assert isinstance(err, EagerRefusal) and isinstance(err, memgraph.UnsupportedOp), msg
    assert str(eager.value) in msg, msg
    assert err.module == "0" and f"in module '0' ({type(first).__name__}), at {HERE}:" in msg, msg
    assert type(err.__cause__) is type(eager.value)


def test_one_dtype_throughout_and_promoting_ops_still_compile_as_eager():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4).double()
            self.register_buffer("scale", torch.full((4,), 0.5))  # float32

        def forward(self, x):
            return self.lin(x) * self.scale  # eager promotes float64 * float32

    torch.manual_seed(0)
    model = Mixed()
    batch = torch.randn(2, 4, dtype=torch.float64)
    want = mse(model, batch)
    mg = memgraph.compile(model, mse, batch, device="cpu", verbose=False)
    assert torch.equal(engine.run(mg, batch)["loss"], want)


# -- 6. no third-party banner on stdout -----------------------------------------------------------

def test_a_compile_running_the_ilp_prints_nothing_to_stdout():
    """In a fresh process: HiGHS prints its banner once per process, at the first Highs object."""
    pytest.importorskip("highspy")
    script = textwrap.dedent("""
        import sys, torch
        from torch import nn
        from turnip import memgraph
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)], nn.Linear(64, 1))
        mg = memgraph.compile(m, lambda m, b: m(b).pow(2).mean(), torch.randn(256, 64),
                              optimizer=torch.optim.Adam(m.parameters()), budget=0.4, device="cpu",
                              planner="ilp", verbose=False, cache=False)
        print("solver:", mg.plan.stats.get("solver"), file=sys.stderr)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "solver: HiGHS" in done.stderr, done.stderr[-3000:]  # the ILP ran, on HiGHS
    assert done.stdout == "", done.stdout


# -- 7. an infeasible budget names the op that sets the floor -------------------------------------

def test_an_infeasible_budget_names_the_vertex_setting_the_smallest_budget():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 1))
    tg = memgraph.trace(model, mse, torch.randn(8, 16), optimizer=sgd(model))
    alignment = 64

    def io_bytes(v) -> int:  # as smallest_budget counts them: an in-place update's new version is its old one
        size = lambda vid: aligned(tg.values[vid].nbytes, alignment)
        in_place = {new for old, new in v.copy_in if size(old) == size(new)}
        return sum(size(o) for o in v.outputs if o >= 0 and o not in in_place) + sum(size(x) for x in v.inputs())

    floor, vertex, needed_io = floor_vertex(tg, alignment)
    assert floor == smallest_budget(tg, alignment) == needed_io + tg.step_workspace()
    assert io_bytes(tg.vertices[vertex]) == needed_io == max(io_bytes(v) for v in tg.vertices)
    with pytest.raises(InfeasibleBudget) as info:
        run_plan(tg, floor - 1, alignment=alignment, method="greedy")
    err, msg = info.value, str(info.value)
    assert err.vertex == vertex and err.minimum == floor, msg
    v = tg.vertices[vertex]
    assert f"the floor is set by vertex {vertex} ({v.op}, module '{v.module}')" in msg, msg


def test_compile_below_the_floor_names_the_vertex_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 1))
    with pytest.raises(InfeasibleBudget) as info:
        memgraph.compile(model, mse, torch.randn(8, 16), optimizer=sgd(model), budget="4KiB", device="cpu",
                         verbose=False, cache=False)
    assert info.value.vertex >= 0 and "the floor is set by vertex" in str(info.value), str(info.value)
