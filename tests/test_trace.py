"""Tracing + reference executor against eager PyTorch (bitwise on CPU, fp32)."""

import pytest
import torch
from cases import OPTIMIZERS, assert_same_state, bf16_autocast, eager_steps, make_case, trainable
from torch import nn
from turnip.bench.models.mlp import MLP
from turnip.ir.taskgraph import ValueKind
from turnip.memgraph import ReferenceExecutor, UnsupportedFeature

from turnip import memgraph


def reference_steps(model, loss_fn, batches, make_opt, seed: int = 123):
    tg = memgraph.trace(model, loss_fn, batches[0], optimizer=make_opt(trainable(model)), device="cpu")
    runner = ReferenceExecutor(tg)
    torch.manual_seed(seed)
    losses = [runner.run(b)["loss"].clone() for b in batches]
    return tg, losses, runner.state_dict()


@pytest.mark.parametrize("model_name", ["mlp", "gpt", "hf_gpt2"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
def test_reference_matches_eager_bitwise(model_name, opt_name):
    model, loss_fn, batches = make_case(model_name)
    want_losses, want_state = eager_steps(model, loss_fn, batches, OPTIMIZERS[opt_name])
    _, losses, state = reference_steps(model, loss_fn, batches, OPTIMIZERS[opt_name])
    assert [x.item() for x in losses] == [x.item() for x in want_losses]
    assert_same_state(state, want_state)
    # the trained weights really moved (a no-op optimizer would pass the equality above too)
    assert any(not torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("model_name", ["mlp", "gpt", "hf_gpt2"])
def test_dropout_masks_match_eager(model_name):
    model, loss_fn, batches = make_case(model_name, dropout=0.2)
    want_losses, want_state = eager_steps(model, loss_fn, batches, OPTIMIZERS["adamw"])
    tg, losses, state = reference_steps(model, loss_fn, batches, OPTIMIZERS["adamw"])
    assert any(v.random for v in tg.vertices)
    assert [x.item() for x in losses] == [x.item() for x in want_losses]
    assert_same_state(state, want_state)


def test_lora_frozen_parameters_get_no_gradient_or_state():
    model, loss_fn, batches = make_case("gpt_lora", dropout=0.1)
    for opt_name in ("sgd_nesterov", "adam"):
        want_losses, want_state = eager_steps(model, loss_fn, batches, OPTIMIZERS[opt_name])
        tg, losses, state = reference_steps(model, loss_fn, batches, OPTIMIZERS[opt_name])
        assert [x.item() for x in losses] == [x.item() for x in want_losses]
        assert_same_state(state, want_state)
    frozen = tg.inputs_of_kind(ValueKind.FROZEN)
    params = tg.inputs_of_kind(ValueKind.PARAMETER)
    assert frozen and params
    assert all("lora_" in tg.values[v].name for v in params)
    assert not set(frozen) & set(tg.bindings)
    # Adam: two states per trainable parameter, none for frozen ones
    assert len(tg.inputs_of_kind(ValueKind.OPTIMIZER_STATE)) == 2 * len(params)


def test_autocast_traces_to_explicit_casts_bitwise():
    model, loss_fn, batches = make_case("gpt", dropout=0.1)
    mixed_loss = bf16_autocast(loss_fn)
    want_losses, want_state = eager_steps(model, mixed_loss, batches, OPTIMIZERS["adamw"])
    tg, losses, state = reference_steps(model, mixed_loss, batches, OPTIMIZERS["adamw"])
    assert tg.summary()["ops"].get("aten::_to_copy", 0) > 0
    assert any(tg.values[o].dtype == torch.bfloat16 for v in tg.vertices for o in v.outputs if o >= 0)
    assert [x.item() for x in losses] == [x.item() for x in want_losses]
    assert_same_state(state, want_state)


def test_views_are_folded_and_graph_is_in_program_order():
    model, loss_fn, batches = make_case("gpt")
    tg = memgraph.trace(model, loss_fn, batches[0], optimizer=OPTIMIZERS["adam"](model.parameters()))
    tg.validate()
    view_ops = {"aten::view", "aten::t", "aten::transpose.int", "aten::expand", "aten::permute",
                "aten::split.Tensor", "aten::slice.Tensor", "aten::select.int", "aten::detach", "aten::unsqueeze"}
    assert not view_ops & {v.op for v in tg.vertices}
    assert any(ref.stride != tg.values[ref.value].stride for v in tg.vertices for ref in v.refs())
    phases = [v.phase for v in tg.vertices]
    assert phases == sorted(phases, key=["forward", "backward", "optimizer"].index)


def test_summary_reports_counts_and_bytes():
    model, loss_fn, batches = make_case("gpt")
    tg = memgraph.trace(model, loss_fn, batches[0], optimizer=OPTIMIZERS["adam"](model.parameters()))
    s = tg.summary()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert s["bytes_parameters"] == param_bytes
    assert s["bytes_optimizer_states"] == 2 * param_bytes
    assert s["ops"]["aten::native_layer_norm"] == 2 * model.cfg.n_layers + 1
    assert sum(s["ops"].values()) == s["vertices"] == len(tg.vertices)
    assert 0 < s["bytes_saved_for_backward"] < s["bytes_total"]
    assert s["vertices_by_phase"]["optimizer"] > 0


def test_module_paths_recorded_for_forward_ops():
    model, loss_fn, batches = make_case("gpt")
    tg = memgraph.trace(model, loss_fn, batches[0], optimizer=OPTIMIZERS["sgd"](model.parameters()))
    modules = {v.module for v in tg.vertices if v.op == "aten::native_layer_norm"}
    assert {"blocks.0.ln1", "blocks.1.ln2", "ln_f"} <= modules


# -- error paths: each names the op/feature and the module, before any work -------------

class _ItemModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), _Scaler())

    def forward(self, x):
        return self.inner(x)


class _Scaler(nn.Module):
    def forward(self, x):
        return x * x.max().item()


class _BranchModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y if y.sum() > 0 else -y


def _mse(model, batch):
    return model(batch).pow(2).mean()


def test_item_is_refused_naming_module():
    with pytest.raises(UnsupportedFeature, match=r"inner\.1.*depends on tensor values"):
        memgraph.trace(_ItemModel(), _mse, torch.randn(2, 4))


def test_data_dependent_branch_is_refused():
    with pytest.raises(UnsupportedFeature, match="depends on tensor values"):
        memgraph.trace(_BranchModel(), _mse, torch.randn(2, 4))


@pytest.mark.parametrize("make_opt, pattern", [
    (lambda ps: torch.optim.LBFGS(ps), "optimizer LBFGS is not supported: its step"),
    (lambda ps: torch.optim.Rprop(ps), "optimizer Rprop is not supported"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, differentiable=True), "differentiable=True"),
    (lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.01)), "lr given as a tensor"),
])
def test_unsupported_optimizers_are_refused_by_name(make_opt, pattern):
    model = nn.Linear(4, 4)
    with pytest.raises(UnsupportedFeature, match=pattern):
        memgraph.trace(model, _mse, torch.randn(2, 4), optimizer=make_opt(model.parameters()))


def test_non_scalar_loss_is_refused():
    model = nn.Linear(4, 4)
    with pytest.raises(UnsupportedFeature, match=r"loss_fn returned a tensor of dtype torch.float32, shape \(2, 4\): "
                                                 r"it must return a floating-point scalar"):
        memgraph.trace(model, lambda m, b: m(b), torch.randn(2, 4))


def test_gradients_are_outputs_without_optimizer():
    model = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    tg = memgraph.trace(model, _mse, x)
    out = ReferenceExecutor(tg).run(x)
    model.zero_grad()
    _mse(model, x).backward()
    assert torch.equal(out["grad:weight"], model.weight.grad)
    assert torch.equal(out["grad:bias"], model.bias.grad)


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_optimizer_matches_eager_fused(kind):
    """The CUDA default: one fused kernel per parameter, the kernel eager's fused=True runs."""
    model, loss_fn, batches = make_case("gpt", dropout=0.1)

    def make_opt(params):
        return kind(params, lr=1e-3, weight_decay=0.1, fused=True)

    want_losses, want_state = eager_steps(model, loss_fn, batches, make_opt)
    tg = memgraph.trace(model, loss_fn, batches[0], optimizer=make_opt(trainable(model)), fused_optimizer=True)
    assert any(v.op.startswith("aten::_fused_adam") for v in tg.vertices)
    runner = ReferenceExecutor(tg)
    torch.manual_seed(123)
    losses = [runner.run(b)["loss"].item() for b in batches]
    assert losses == [x.item() for x in want_losses]
    assert_same_state(runner.state_dict(), want_state)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error_not_a_crash():
    model = MLP(4, 8, 2, depth=2)
    batch = (torch.randn(2, 4), torch.randn(2, 2))
    with pytest.raises(UnsupportedFeature, match="sees no CUDA device; compile with device='cpu'"):
        memgraph.compile(model, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), batch,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device="cuda")


def test_optimizer_over_another_models_parameters_is_refused():
    model, other = MLP(4, 8, 2, depth=2), MLP(4, 8, 2, depth=2)
    batch = (torch.randn(2, 4), torch.randn(2, 2))
    params = list(model.parameters())[:1] + list(other.parameters())[1:2]
    with pytest.raises(UnsupportedFeature, match=r"param group 0 holds a tensor of shape \(8,\) \(parameter 1"):
        memgraph.trace(model, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), batch,
                       optimizer=torch.optim.SGD(params, lr=0.1))


@pytest.mark.parametrize("device, pattern", [
    ("mps", "engine backends for 'cpu' and 'cuda' only"),  # torch aborts the interpreter on a CPU build
    ("xla", "engine backends for 'cpu' and 'cuda' only"),
    ("bogus", "not a device torch knows"),
])
def test_unsupported_devices_are_clear_errors_before_tracing(device, pattern):
    model = nn.Linear(4, 4)
    with pytest.raises(UnsupportedFeature, match=pattern):
        memgraph.compile(model, _mse, torch.randn(2, 4), device=device, verbose=False)


def test_a_node_belongs_to_the_innermost_module_running_when_it_was_made():
    """_ModuleTracker.module_at: the last span starting at or before the node (spans in node order,
    several may start at one node: the last of them holds), "" before the first."""
    from turnip.trace.recorder import Recorder
    from turnip.trace.tracer import _ModuleTracker

    tracker = _ModuleTracker(torch.nn.Linear(1, 1), Recorder())
    tracker.spans = [(2, "a"), (2, "a.b"), (5, ""), (5, "c"), (9, "c.d"), (12, "c")]

    def scan(index):
        return next((name for start, name in reversed(tracker.spans) if start <= index), "")

    assert [tracker.module_at(i) for i in range(15)] == [scan(i) for i in range(15)]
    assert [tracker.module_at(i) for i in (0, 1, 2, 4, 5, 8, 9, 11, 12, 100)] == \
        ["", "", "a.b", "a.b", "c", "c", "c.d", "c.d", "c", "c"]
