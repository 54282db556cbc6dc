"""BatchNorm in train mode: running statistics and num_batches_tracked are module state the step updates in
place (like optimizer states), equal to eager bitwise on the CPU, and in mg.state_dict(). Eval-mode BatchNorm,
GroupNorm and LayerNorm train like eager too. The CNN is ResNet-18's layout written here (no download)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from turnip.ir.plan import Plan, Recompute

from turnip import engine, memgraph

STEPS = 3


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: conv-BN-ReLU(inplace), conv-BN, the shortcut added in place, ReLU(inplace)."""

    def __init__(self, cin: int, cout: int, stride: int, norm):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """ResNet-18: a 7x7 stem, max pool, four stages of two BasicBlocks, average pool, classifier (narrow)."""

    def __init__(self, widths=(8, 16, 32, 64), classes: int = 10, norm=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = norm(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, cin = [], widths[0]
        for i, width in enumerate(widths):
            stages.append(nn.Sequential(BasicBlock(cin, width, 1 if i == 0 else 2, norm),
                                        BasicBlock(width, width, 1, norm)))
            cin = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def cross_entropy(m, b):
    return nn.functional.cross_entropy(m(b[0]), b[1])


def images(steps: int = STEPS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(steps)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05)


def eager(model, batches, make_opt):
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = cross_entropy(model, b)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, model.state_dict()


def assert_equal_state(got: dict, want: dict):
    assert set(got) == set(want), f"state keys differ: {set(got) ^ set(want)}"
    differ = [k for k, v in want.items() if not (got[k].dtype == v.dtype and torch.equal(got[k], v))]
    assert not differ, f"differ from eager: {differ}"


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    model = ResNet18()
    batches = images()
    return model, batches, {name: eager(model, batches, make) for name, make in (("sgd", sgd), ("adamw", adamw))}


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("budget", [None, 0.7, 0.5])
def test_resnet18_with_batchnorm_trains_like_eager(resnet, budget, opt_name):
    model, batches, oracle = resnet
    want, want_state = oracle[opt_name]
    assert any("running_mean" in k for k in want_state)  # eager really updates module state
    make = sgd if opt_name == "sgd" else adamw
    net = copy.deepcopy(model)  # the fixture's model is shared by the parametrizations
    mg = memgraph.compile(net, cross_entropy, batches[0], optimizer=make(net.parameters()), budget=budget, device="cpu")
    assert memgraph.verify(mg) == []
    moved = mg.summary()
    assert budget is None or moved["bytes_offloaded"] + moved["bytes_reloaded"] > 0 or mg.plan.recompute
    tg = mg.taskgraph
    bound = {tg.values[v].name for v in tg.bindings}
    assert "buffer:bn1.running_mean" in bound and "buffer:layer4.1.bn2.num_batches_tracked" in bound
    for ordering in ("deterministic", "nondeterministic"):
        mg.release(keep=False)  # from the compiled weights again
        got = [engine.run(mg, b, ordering=ordering)["loss"] for b in batches]
        assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), f"{ordering}: {got} != {want}"
        assert_equal_state(mg.state_dict(), want_state)


def test_recomputed_batchnorm_updates_its_statistics_once():
    """A plan that recomputes BatchNorm in the backward (the planner may): the copy writes the same
    statistics from the same old ones, so they are still eager's."""
    torch.manual_seed(0)
    model = ResNet18()
    batches = images()
    want, want_state = eager(model, batches, sgd)
    tg = memgraph.trace(model, cross_entropy, batches[0], optimizer=sgd(model.parameters()))
    consumers = tg.consumers()
    recompute = []
    for vertex in tg.vertices:
        if vertex.op != "aten::native_batch_norm.out":
            continue
        relu = next((c for o in vertex.outputs for c in consumers[o] if tg.vertices[c].op == "aten::relu_"), None)
        if relu is not None:
            backward = next(c for c in consumers[tg.vertices[relu].outputs[0]] if tg.vertices[c].phase == "backward")
            recompute += [Recompute(vertex.id, backward), Recompute(relu, backward)]
    assert len(recompute) >= 4
    mg = memgraph.build(tg, Plan(gpu_budget=1 << 40, recompute=recompute))
    mg.initial_state, mg.names, mg.device = dict(tg.initial_state), dict(tg.state_names), "cpu"
    assert memgraph.verify(mg) == []
    assert sum(v.op == "aten::native_batch_norm.out" for v in mg.taskgraph.vertices if v.phase == "recompute") >= 2
    got = [engine.run(mg, b, ordering="random", seed=k)["loss"] for k, b in enumerate(batches)]
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), f"{got} != {want}"
    assert_equal_state(mg.state_dict(), want_state)


def test_saved_and_loaded_batchnorm_state_continues_training(tmp_path):
    torch.manual_seed(0)
    model = ResNet18()
    batches = images()
    want, want_state = eager(model, batches, sgd)
    mg = memgraph.compile(model, cross_entropy, batches[0], optimizer=sgd(model.parameters()),
                          budget=0.7, device="cpu")
    got = [engine.run(mg, b)["loss"] for b in batches[:2]]
    mg.save(tmp_path / "step.mg")
    loaded = memgraph.load(tmp_path / "step.mg")
    got.append(engine.run(loaded, batches[2])["loss"])
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), f"{got} != {want}"
    assert_equal_state(loaded.state_dict(), want_state)


NORMS = {
    "batchnorm_eval": (nn.BatchNorm2d, True),
    "groupnorm": (lambda c: nn.GroupNorm(4, c), False),
    "layernorm_channels": (lambda c: nn.GroupNorm(1, c), False),  # LayerNorm over (C, H, W)
}


@pytest.mark.parametrize("budget", [None, 0.5])
@pytest.mark.parametrize("name", sorted(NORMS))
def test_other_normalizations_train_like_eager(name, budget):
    norm, eval_mode = NORMS[name]
    torch.manual_seed(0)
    model = ResNet18(norm=norm)
    if eval_mode:
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)  # statistics that matter, and must stay as they are
                module.eval()
    batches = images()
    want, want_state = eager(model, batches, sgd)
    mg = memgraph.compile(model, cross_entropy, batches[0], optimizer=sgd(model.parameters()),
                          budget=budget, device="cpu")
    assert not any(mg.taskgraph.values[v].name.startswith("buffer:") for v in mg.taskgraph.bindings)
    got = [engine.run(mg, b, ordering="deterministic" if k % 2 else "nondeterministic")["loss"]
           for k, b in enumerate(batches)]
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), f"{got} != {want}"
    assert_equal_state(mg.state_dict(), want_state)


class TokenMLP(nn.Module):
    """LayerNorm over features, as in transformers, with an in-place ReLU."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(inplace=True),
                                 nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(inplace=True), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("budget", [None, 0.5])
def test_layernorm_trains_like_eager(budget):
    torch.manual_seed(0)
    model = TokenMLP()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(128, 16, generator=g), torch.randint(0, 10, (128,), generator=g)) for _ in range(STEPS)]
    want, want_state = eager(model, batches, adamw)
    mg = memgraph.compile(model, cross_entropy, batches[0], optimizer=adamw(model.parameters()),
                          budget=budget, device="cpu")
    got = [engine.run(mg, b, ordering="deterministic" if k % 2 else "nondeterministic")["loss"]
           for k, b in enumerate(batches)]
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), f"{got} != {want}"
    assert_equal_state(mg.state_dict(), want_state)


def test_cumulative_batchnorm_is_refused_naming_the_module():
    """momentum=None averages with 1 / num_batches_tracked, read back on the host: data-dependent."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None))
    with pytest.raises(memgraph.UnsupportedFeature, match=r"module '1' \(BatchNorm1d\), at .*depends on tensor values"):
        memgraph.trace(model, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
                       (torch.randn(3, 4), torch.randn(3, 4)), optimizer=sgd(model.parameters()))
