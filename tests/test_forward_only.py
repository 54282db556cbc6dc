"""Forward-only steps (compile(..., backward=False)): inference and prefill graphs. The outputs fn
returns, bit for bit what eager's forward under torch.no_grad gives, at every budget and ordering;
the weights are read, never written; what cannot apply to a forward is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import make_case
from turnip.trace.errors import UnsupportedFeature

from turnip import engine, memgraph


def last_and_all(model, batch):
    idx, _targets = batch
    logits = model(idx)
    return {"last": logits[:, -1], "logits": logits}


@pytest.fixture(scope="module")
def gpt():
    model, _loss, batches = make_case("gpt")
    return model.eval(), batches


@pytest.mark.parametrize("budget", [None, 0.5, 0.3])
@pytest.mark.parametrize("ordering", ["nondeterministic", "deterministic"])
def test_forward_outputs_are_eagers_bit_for_bit(gpt, budget, ordering):
    model, batches = gpt
    before = copy.deepcopy(model.state_dict())
    mg = memgraph.compile(model, last_and_all, batches[0], budget=budget, device="cpu", backward=False,
                          verbose=False, cache=False)
    tg = mg.taskgraph
    assert {v.phase for v in tg.vertices} == {"forward"} and tg.optimizer is None and mg.optimizer is None
    if budget == 0.3:
        assert mg.summary()["bytes_reloaded"] > 0  # the budget makes it move something
    for batch in batches:
        out = engine.run(mg, batch, ordering=ordering)
        with torch.no_grad():
            want = last_and_all(model, batch)
        assert sorted(out) == ["output:last", "output:logits"]
        for key, tensor in want.items():
            assert torch.equal(out[f"output:{key}"], tensor), key
    for name, tensor in mg.state_dict().items():  # read-only: the weights are the model's
        assert torch.equal(tensor, before[name]), name


def test_a_single_tensor_and_a_tuple(gpt, tmp_path):
    model, batches = gpt
    mg = memgraph.compile(model, lambda m, b: m(b[0]), batches[0], device="cpu", backward=False, verbose=False,
                          cache=False)
    with torch.no_grad():
        assert torch.equal(engine.run(mg, batches[1])["output"], model(batches[1][0]))
    pair = memgraph.compile(model, lambda m, b: (m(b[0]).amax(-1), b[1]), batches[0], device="cpu", backward=False,
                            verbose=False, cache=False)
    pair.save(tmp_path / "fwd.mg")
    loaded = memgraph.load(tmp_path / "fwd.mg")
    out = engine.run(loaded, batches[2])
    with torch.no_grad():
        assert torch.equal(out["output:0"], model(batches[2][0]).amax(-1))
    assert torch.equal(out["output:1"], batches[2][1])


def test_a_two_layer_llama_prefill_matches_eager():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))

    def prefill(m, ids):
        return m(input_ids=ids).logits[:, -1]

    mg = memgraph.compile(model, prefill, tokens, budget=0.4, device="cpu", backward=False, verbose=False,
                          cache=False)
    with torch.no_grad():
        want = prefill(model, tokens)
    # bit for bit: transformers' check for packed sequences is answered as eager answers it while
    # tracing (trace/constant_checks.py), so the traced step takes eager's causal path
    assert torch.equal(engine.run(mg, tokens)["output"], want)


def test_what_a_forward_cannot_take_is_refused(gpt):
    model, batches = gpt
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedFeature, match="it takes no optimizer"):
        memgraph.compile(model, last_and_all, batches[0], optimizer=opt, device="cpu", backward=False,
                         verbose=False, cache=False)
    with pytest.raises(UnsupportedFeature, match="max_grad_norm, accumulation_steps > 1"):
        memgraph.compile(model, last_and_all, batches[0], max_grad_norm=1.0, accumulation_steps=2, device="cpu",
                         backward=False, verbose=False, cache=False)
    with pytest.raises(UnsupportedFeature, match="output 'output:1' is a int"):
        memgraph.compile(model, lambda m, b: (m(b[0]), 3), batches[0], device="cpu", backward=False, verbose=False,
                         cache=False)
    with pytest.raises(UnsupportedFeature, match="must return a tensor"):
        memgraph.compile(model, lambda m, b: None, batches[0], device="cpu", backward=False, verbose=False,
                         cache=False)


def test_a_size_budget_that_holds_the_step_undonated_skips_buffer_donation(gpt):
    """Donation trades kernel time for memory (memgraph/compiler.py, undonated_if_it_fits): a forward
    whose size budget holds it whole without donation is not donated; a tighter one is, and both
    give eager's outputs."""
    model, batches = gpt

    def donated_ops(mg):
        return [v.op for v in mg.taskgraph.vertices if v.copy_in and v.op.endswith(".out")]

    fitted = memgraph.compile(model, last_and_all, batches[0], device="cpu", backward=False, verbose=False,
                              cache=False)
    assert donated_ops(fitted)  # budget None: the donated step's own peak
    roomy = memgraph.compile(model, last_and_all, batches[0], budget=f"{4 * fitted.stats['unplanned_peak']}B",
                             device="cpu", backward=False, verbose=False, cache=False)
    assert donated_ops(roomy) == []
    assert roomy.stats["unplanned_peak"] >= fitted.stats["unplanned_peak"]
    tight = memgraph.compile(model, last_and_all, batches[0], budget=f"{fitted.stats['unplanned_peak']}B", device="cpu",
                             backward=False, verbose=False, cache=False)
    if roomy.stats["unplanned_peak"] > fitted.stats["unplanned_peak"]:
        assert donated_ops(tight)  # donation is what lets it fit whole
    with torch.no_grad():
        want = last_and_all(model, batches[0])
    for mg in (roomy, tight):
        got = engine.run(mg, batches[0])
        assert torch.equal(got["output:last"], want["last"]) and torch.equal(got["output:logits"], want["logits"])
