"""Recurrent layers run like eager or are refused at compile naming the op and module; activation
checkpointing (torch.utils.checkpoint, Hugging Face's gradient_checkpointing_enable()) is refused with the
advice that turnip decides recomputation itself."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import eager_steps
from torch import nn
from torch.utils.checkpoint import checkpoint

from turnip import engine, memgraph

STEPS = 3


class Recurrent(nn.Module):
    def __init__(self, cell, **options):
        super().__init__()
        self.rnn = cell(8, 16, batch_first=True, **options)
        self.head = nn.Linear(16 * (2 if options.get("bidirectional") else 1), 4)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class CellLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = c = x.new_zeros(x.shape[0], 16)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return self.head(h)


def mse(m, b):
    return nn.functional.mse_loss(m(b[0]), b[1])


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def train_both(model, loss_fn, batches, budget):
    """(compiled losses, eager losses, compiled state, eager state) after STEPS steps."""
    want, eager_state = eager_steps(model, loss_fn, batches, adam)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=adam(model.parameters()), budget=budget, device="cpu")
    assert memgraph.verify(mg) == []
    got = [engine.run(mg, b, ordering="deterministic" if k % 2 else "nondeterministic")["loss"]
           for k, b in enumerate(batches)]
    return got, want, mg.state_dict(), eager_state


def sequences(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(STEPS)]


MODELS = {
    "gru": lambda: Recurrent(nn.GRU),
    "gru_2_layers_bidirectional": lambda: Recurrent(nn.GRU, num_layers=2, bidirectional=True),
    "rnn_tanh_2_layers": lambda: Recurrent(nn.RNN, num_layers=2),
    "lstm_cell_loop": CellLoop,
}


@pytest.mark.parametrize("budget", [1.0, 0.5])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_recurrent_models_train_like_eager(name, budget):
    torch.manual_seed(0)
    got, want, state, want_state = train_both(MODELS[name](), mse, sequences(), budget)
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), f"{got} != {want}"
    assert all(torch.equal(state[k], v) for k, v in want_state.items())


def test_lstm_on_the_fused_cpu_kernel_is_refused_naming_op_and_module():
    torch.manual_seed(0)
    model = Recurrent(nn.LSTM)
    with torch.backends.mkldnn.flags(enabled=True), pytest.raises(memgraph.UnsupportedOp) as info:
        memgraph.compile(model, mse, sequences()[0], optimizer=adam(model.parameters()), device="cpu")
    msg = str(info.value)
    assert info.value.op == "aten::mkldnn_rnn_layer" and info.value.module == "rnn"
    assert "(LSTM)" in msg and "torch.backends.mkldnn.flags(enabled=False)" in msg, msg


def test_lstm_with_the_fused_kernel_off_trains_like_eager():
    """What the refusal advises: eager and compile both without oneDNN's fused LSTM."""
    torch.manual_seed(0)
    with torch.backends.mkldnn.flags(enabled=False):
        got, want, state, want_state = train_both(Recurrent(nn.LSTM, num_layers=2), mse, sequences(), 0.5)
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), f"{got} != {want}"
    assert all(torch.equal(state[k], v) for k, v in want_state.items())


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.inner = nn.Linear(4, 8)
        self.outer = nn.Linear(8, 2)

    def forward(self, x):
        h = checkpoint(lambda t: torch.relu(self.inner(t)), x, use_reentrant=self.reentrant)
        return self.outer(h)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_is_refused_naming_the_module(reentrant):
    """The reentrant form would otherwise compile and silently never train the checkpointed layer."""
    model = Checkpointed(reentrant)
    batch = (torch.randn(3, 4), torch.randn(3, 2))
    with pytest.raises(memgraph.UnsupportedFeature) as info:
        memgraph.compile(model, mse, batch, optimizer=adam(model.parameters()), device="cpu")
    msg = str(info.value)
    assert "module 'inner' (Linear) runs under torch.utils.checkpoint" in msg, msg
    assert "decides itself what to keep, offload or recompute" in msg


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    return model


def lm_loss(m, b):
    return m(input_ids=b, labels=b).loss


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_(en|dis)able` is deprecated:FutureWarning")
def test_hf_gradient_checkpointing_is_refused_with_advice_and_disabling_it_trains_like_eager_with_it():
    model = tiny_gpt2()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(STEPS)]
    model.gradient_checkpointing_enable()  # the call the issue names (renamed activation_checkpointing_enable)
    with pytest.raises(memgraph.UnsupportedFeature) as info:
        memgraph.compile(model, lm_loss, batches[0], optimizer=adam(model.parameters()), device="cpu")
    msg = str(info.value)
    assert "gradient checkpointing enabled" in msg and "model.gradient_checkpointing_disable()" in msg, msg
    assert "recompute" in msg

    eager_model = copy.deepcopy(model)  # eager keeps checkpointing: the advice says the numbers are the same
    opt = adam(eager_model.parameters())
    want = []
    for b in batches:
        opt.zero_grad()
        loss = lm_loss(eager_model, b)
        loss.backward()
        opt.step()
        want.append(loss.detach())
    model.gradient_checkpointing_disable()
    mg = memgraph.compile(model, lm_loss, batches[0], optimizer=adam(model.parameters()), budget=0.5, device="cpu")
    got = [engine.run(mg, b)["loss"] for b in batches]
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), f"{got} != {want}"
    state = mg.state_dict()
    assert all(torch.equal(state[k], v) for k, v in eager_model.state_dict().items())
