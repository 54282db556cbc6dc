"""The LoRA fine-tuning workload of the TURNIP paper (bench/models/llama.py lora_workload), its
2-layer version on the CPU backend: bitwise equal to eager over three AdamW steps on the adapters,
with the base weights frozen and, under the budget, streamed read-only."""

from __future__ import annotations

import copy

import pytest
import torch
from turnip.ir.taskgraph import ValueKind
from turnip.memgraph.report import plan_mix

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


def test_frozen_base_weights_read_through_casts_are_kept_half_width():
    """Under autocast the base matrices are read only by casts to bf16: the TaskGraph keeps them in
    bf16 (cast once, at compile), so a CPU-homed one crosses the link at 2 bytes per element; the
    fp32 originals take no place and still come back from state_dict; the embedding, read by a
    gather, stays fp32."""
    from turnip.bench.models.sizes import make_workload

    work = make_workload("lora7b", tiny=True)
    model = copy.deepcopy(work.model)
    mg = memgraph.compile(model, work.loss_fn, work.batch, optimizer=work.optimizer(
        [p for p in model.parameters() if p.requires_grad]), budget=0.3, device="cpu", verbose=False, cache=False)
    tg = mg.taskgraph
    halves = [v for v in tg.values if v.kind is ValueKind.FROZEN and v.dtype == torch.bfloat16]
    assert len(halves) == 2 * 7 + 1  # every targeted base matrix of both layers, and the LM head
    by_name = {v.name: v for v in tg.values}
    state = mg.state_dict()
    for half in halves:
        full = by_name[half.name.rsplit(":", 1)[0]]
        assert full.dtype == torch.float32 and full.id not in mg.homes and half.id in mg.homes
        assert torch.equal(tg.initial_state[half.id], tg.initial_state[full.id].to(torch.bfloat16))
        key = next(k for k, vid in mg.names.items() if vid == full.id)
        assert torch.equal(state[key], dict(work.model.named_parameters())[key].detach())
    reloaded = [mv for mv in mg.vertices if mv.kind.value == "reload" and mv.value in {h.id for h in halves}]
    assert reloaded, "a 30% budget should stream some base matrices"
    assert all(p.nbytes <= -(-tg.values[mv.value].nbytes // 64) * 64 and tg.values[mv.value].dtype == torch.bfloat16
               for mv in reloaded for p in mv.writes.values())
    embed = [v for v in tg.values if v.kind is ValueKind.FROZEN and "embed_tokens" in v.name]
    assert embed and all(v.dtype == torch.float32 and v.id in mg.homes for v in embed)
    mix = plan_mix(mg)  # what the suite's rows and `turnip info` report
    assert (mix.half_width_weights, mix.bytes_half_width) == (len(halves), sum(h.nbytes for h in halves))
    trainable_ids = {v.id for v in tg.values if v.kind is ValueKind.PARAMETER}
    assert mix.parameters_kept + mix.parameters_streamed + mix.parameters_host_stepped == len(trainable_ids) > 0
    assert mix.parameters_host_stepped == 0
