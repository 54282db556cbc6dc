"""Model/optimizer cases shared by the tests, and the eager-PyTorch oracle they compare against."""

from __future__ import annotations

import copy

import pytest
import torch
from turnip.bench.models import mlp

from turnip import gpt

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, dampening=0.1),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
}


def make_case(name: str, dropout: float = 0.0, device="cpu"):
    """(model, loss_fn, batches) for a named model; weights are seeded so cases are reproducible."""
    torch.manual_seed(0)
    if name == "mlp":
        model = mlp.MLP(depth=10, dropout=dropout)
        return model.to(device), mlp.mlp_loss, [mlp.example_batch(batch=64, seed=i, device=device) for i in range(3)]
    if name in ("gpt", "gpt_lora"):
        cfg = gpt.GPTConfig(n_layers=4, dropout=dropout, lora_rank=4 if name == "gpt_lora" else 0)
        model = gpt.GPT(cfg)
        return model.to(device), gpt.lm_loss, [gpt.example_batch(cfg, seed=i, device=device) for i in range(3)]
    if name == "hf_gpt2":
        transformers = pytest.importorskip("transformers")
        cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0,
                                      eos_token_id=0, bos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg).to(device)
        model.train()

        def loss_fn(m, batch):
            return m(input_ids=batch, labels=batch).loss

        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        return model, loss_fn, [torch.randint(0, 128, (2, 16), generator=g).to(device) for g in gens]
    raise KeyError(name)


def bf16_autocast(loss_fn):
    """The same loss with its forward under CPU bf16 autocast (mixed precision)."""
    def mixed_loss(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(model, batch)

    return mixed_loss


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def eager_steps(model, loss_fn, batches, make_opt, seed: int = 123):
    """Train a deep copy eagerly; returns (losses, state_dict). Seeds the global RNG like the runner does."""
    model = copy.deepcopy(model)
    opt = make_opt(trainable(model))
    losses = []
    torch.manual_seed(seed)
    for batch in batches:
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses, model.state_dict()


def assert_same_optimizer_state(got: dict, want: dict, exact: bool = True, groups: bool = True):
    """Torch-format optimizer state dicts equal (bitwise, or within float tolerance), the step count
    included; with groups, the param_groups too."""
    if groups:
        assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, state in want["state"].items():
        assert got["state"][index].keys() == state.keys(), index
        for key, tensor in state.items():
            mine, theirs = got["state"][index][key].cpu(), tensor.cpu()
            if exact:
                assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), f"state {index} {key}"
            else:
                torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def assert_same_state(got: dict, want: dict, exact: bool = True, rtol=1e-4, atol=1e-5):
    assert set(got) == set(want), f"state keys differ: {set(got) ^ set(want)}"
    for key in want:
        a, b = got[key].detach().cpu(), want[key].detach().cpu()
        if exact:
            assert torch.equal(a, b), f"{key}: max diff {(a.float() - b.float()).abs().max().item()}"
        else:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")
