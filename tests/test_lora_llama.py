"""The LoRA fine-tuning workload of the TURNIP paper (bench/models/llama.py lora_workload), its
2-layer version on the CPU backend: bitwise equal to eager over three AdamW steps on the adapters,
with the base weights frozen and, under the budget, streamed read-only."""

from __future__ import annotations

import copy

import pytest
import torch
from turnip.ir.taskgraph import ValueKind

from turnip import engine, memgraph

pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.mark.parametrize("budget", [None, 0.5])
def test_two_layer_lora_llama_matches_eager(budget):
    from turnip.bench.models.sizes import make_workload

    work = make_workload("lora7b", tiny=True)
    assert work.info["lora_rank"] == 4 and work.info["trainable_parameters"] < work.info["parameters"] / 4
    batches = [work.batch] + [make_workload("lora7b", tiny=True, seed=s).batch for s in (1, 2)]
    eager = copy.deepcopy(work.model)
    opt = work.optimizer([p for p in eager.parameters() if p.requires_grad])
    want = []
    for batch in batches:
        opt.zero_grad()
        loss = work.loss_fn(eager, batch)
        loss.backward()
        opt.step()
        want.append(loss.detach())
    model = copy.deepcopy(work.model)
    mg = memgraph.compile(model, work.loss_fn, batches[0], optimizer=work.optimizer(
        [p for p in model.parameters() if p.requires_grad]), budget=budget, device="cpu", verbose=False, cache=False)
    assert memgraph.verify(mg) == []
    frozen = [v for v in mg.taskgraph.values if v.kind is ValueKind.FROZEN]
    assert len(frozen) >= 2 * 7 + 2  # every targeted base matrix, embeddings and head stay frozen
    got = [engine.run(mg, batch)["loss"] for batch in batches]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (got, want)
    state = mg.state_dict()
    for name, p in eager.named_parameters():
        assert torch.equal(state[name], p.detach()), name
