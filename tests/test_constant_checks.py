"""trace/constant_checks.py: library checks of batch-independent values answered as eager answers
them while tracing, so a Hugging Face Llama traces to eager's own step."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from turnip import engine, memgraph

transformers = pytest.importorskip("transformers")
TRACE = sys.modules["turnip.trace.tracer"]


def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def autocast_loss(m, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return m(input_ids=ids, labels=ids).loss


def test_default_positions_trace_to_eagers_attention_and_its_gradients():
    """Without the answer, transformers builds a causal mask per layer and repeats K and V (the
    traced step's gradients then differ from eager's in the last bits under autocast)."""
    model = tiny_llama()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    tg = TRACE.trace(model, autocast_loss, ids, device="cpu")
    ops = [v.op for v in tg.vertices]
    assert not any(op.startswith("aten::where") for op in ops)  # no materialized mask: SDPA's is_causal
    eager = copy.deepcopy(model)
    loss = autocast_loss(eager, ids)
    loss.backward()
    mg = memgraph.compile(copy.deepcopy(model), autocast_loss, ids, device="cpu", verbose=False, cache=False)
    out = engine.run(mg, ids)
    assert torch.equal(out["loss"], loss.detach())
    for name, p in eager.named_parameters():
        assert torch.equal(out[f"grad:{name}"], p.grad), name


def test_positions_from_the_batch_keep_the_conservative_path():
    """Position ids that come with the batch may pack several sequences in a row: the check stays
    the library's own (a mask built from the data), and a packed batch gives eager's loss."""
    model = tiny_llama()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    packed = torch.cat([torch.arange(8), torch.arange(8)]).expand(2, 16).contiguous()  # two sequences per row

    def loss_fn(m, batch):
        tokens, positions = batch
        return m(input_ids=tokens, position_ids=positions, labels=tokens).loss

    tg = TRACE.trace(model, loss_fn, (ids, packed), device="cpu")
    assert any(v.op.startswith("aten::where") for v in tg.vertices)  # the mask, computed from the batch
    want = loss_fn(copy.deepcopy(model), (ids, packed))
    mg = memgraph.compile(copy.deepcopy(model), loss_fn, (ids, packed), device="cpu", verbose=False, cache=False)
    torch.testing.assert_close(engine.run(mg, (ids, packed))["loss"], want.detach(), rtol=1e-6, atol=0)
    plain = torch.arange(16).expand(2, 16).contiguous()  # and one sequence per row, through the same graph
    torch.testing.assert_close(engine.run(mg, (ids, plain))["loss"], loss_fn(copy.deepcopy(model), (ids, plain)).detach(),
                               rtol=1e-6, atol=0)


def test_nothing_is_patched_outside_a_trace():
    masking = pytest.importorskip("transformers.masking_utils")
    before = masking.find_packed_sequence_indices
    tiny = tiny_llama()
    TRACE.trace(tiny, autocast_loss, torch.zeros(1, 4, dtype=torch.long), device="cpu")
    assert masking.find_packed_sequence_indices is before
