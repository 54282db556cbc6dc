"""The loss head in row blocks (compile(split=k), trace/split_loss.py).

Tolerance: the blocks compute each row with the same kernels, but the loss's sum, the total
weight and the head's weight gradient are added block by block, in another order than eager's
single kernels. On the CPU in fp32 the loss then differs from eager's by at most 1e-6 relative and
every gradient by at most 1e-6 absolute (these models' gradients are 1e-4..1); with SGD the
weights after three steps by at most 1e-5. Under bf16 autocast each block's weight gradient is
rounded to bf16 before an fp32 sum, as eager rounds its one product once: the head's gradient
then differs by bf16's precision (2e-2 relative). Adam divides by the gradients' running RMS, so
a near-zero gradient that rounds differently moves a weight by up to lr: the tests use SGD for
weights and compare gradients directly.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from cases import OPTIMIZERS, bf16_autocast, eager_steps, make_case, trainable
from turnip.ir.errors import InfeasibleBudget
from turnip.memgraph.report import compile_report
from turnip.trace.split_loss import find_loss_head, split_loss_head

from turnip import engine, memgraph

TRACE = sys.modules["turnip.trace.tracer"]


def grads(model, loss_fn, batch, split, autocast=False):
    """Loss and gradients of one step of the compiled graph (no optimizer: the gradients are outputs)."""
    fn = bf16_autocast(loss_fn) if autocast else loss_fn
    mg = memgraph.compile(copy.deepcopy(model), fn, batch, device="cpu", verbose=False, cache=False, split=split)
    out = engine.run(mg, batch)
    return out["loss"], {k: v for k, v in out.items() if k.startswith("grad:")}, mg


@pytest.fixture(scope="module")
def gpt():
    return make_case("gpt")


@pytest.mark.parametrize("k", [2, 4, 7])
def test_split_gradients_match_the_unsplit_step(gpt, k):
    model, loss_fn, batches = gpt
    loss, want, plain = grads(model, loss_fn, batches[0], "off")
    got_loss, got, mg = grads(model, loss_fn, batches[0], k)
    assert find_loss_head(plain.taskgraph) is None  # donation renamed the ops: nothing to find twice
    blocks = [v for v in mg.taskgraph.vertices if v.op == "aten::nll_loss_forward"]
    assert len(blocks) == len(range(0, 64, -(-64 // k)))  # 64 rows: k = 7 makes blocks of 10 rows, the last of 4
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_split_under_bf16_autocast_within_bf16_precision(gpt):
    model, loss_fn, batches = gpt
    loss, want, _ = grads(model, loss_fn, batches[0], "off", autocast=True)
    got_loss, got, mg = grads(model, loss_fn, batches[0], 4, autocast=True)
    casts = [v for v in mg.taskgraph.vertices if v.op == "aten::_to_copy" and v.phase == "backward"]
    assert len(casts) > 4  # the blocks' casts, and the fp32 sum of the bf16 weight-gradient blocks
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
    for name in want:  # within bf16's precision of each gradient's scale (a tied embedding's sum cancels)
        scale = want[name].abs().max().item()
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-2 * scale, msg=lambda m, n=name: f"{n}: {m}")


def test_the_cuda_autocast_head_splits_too(gpt):
    """On CUDA, autocast runs the log-softmax in bf16 and casts its result to fp32 for the NLL loss
    (the CPU casts the logits before the log-softmax): the same head with the cast after it, written
    out on the CPU, is found and split, within bf16's precision as above."""
    import torch.nn.functional as F

    model, _loss, batches = gpt

    def cuda_form(m, batch):
        idx, targets = batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(idx)
        logp = torch.log_softmax(logits.reshape(-1, logits.shape[-1]), -1)  # bf16, as CUDA autocast leaves it
        return F.nll_loss(logp.float(), targets.reshape(-1))

    tg = TRACE.trace(model, cuda_form, batches[0], device="cpu", donate=False)
    head = find_loss_head(tg)
    assert head is not None and head.cast_in is None and head.cast_out is not None
    assert head.cast_out_backward is not None and head.cast_in_backward is None
    loss, want, _ = grads(model, cuda_form, batches[0], "off")
    got_loss, got, mg = grads(model, cuda_form, batches[0], 4)
    assert sum(v.op == "aten::nll_loss_forward" for v in mg.taskgraph.vertices) == 4
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
    for name in want:
        scale = want[name].abs().max().item()
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-2 * scale, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("budget", [None, 0.4])
@pytest.mark.parametrize("ordering", ["nondeterministic", "deterministic"])
def test_split_training_matches_eager_within_tolerance(gpt, budget, ordering):
    model, loss_fn, batches = gpt
    want_losses, want_state = eager_steps(model, loss_fn, batches, OPTIMIZERS["sgd"])
    m = copy.deepcopy(model)
    mg = memgraph.compile(m, loss_fn, batches[0], optimizer=OPTIMIZERS["sgd"](trainable(m)), budget=budget,
                          device="cpu", verbose=False, cache=False, split=4)
    assert memgraph.verify(mg) == []
    torch.manual_seed(123)
    losses = [engine.run(mg, b, ordering=ordering)["loss"] for b in batches]
    for got, want in zip(losses, want_losses, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    state = mg.state_dict()
    for key, want in want_state.items():
        torch.testing.assert_close(state[key], want, rtol=0, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


def test_split_runs_below_the_unsplit_steps_smallest_budget():
    """The point of splitting: the largest op shrinks, so a budget the unsplit step refuses runs
    (a vocabulary large beside the model, as in a language model, where the loss head is that op)."""
    from turnip import gpt

    cfg = gpt.GPTConfig(vocab=4096, d_model=32, n_layers=1, n_heads=2)
    torch.manual_seed(0)
    model, batches = gpt.GPT(cfg), [gpt.example_batch(cfg, seed=i) for i in range(2)]
    loss_fn = gpt.lm_loss
    with pytest.raises(InfeasibleBudget) as info:
        memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS["sgd"](trainable(model)),
                         budget="16KiB", device="cpu", verbose=False, cache=False, split="off")
    floor = info.value.minimum
    m = copy.deepcopy(model)
    mg = memgraph.compile(m, loss_fn, batches[0], optimizer=OPTIMIZERS["sgd"](trainable(m)), budget=f"{floor - 1}B",
                          device="cpu", verbose=False, cache=False, split=8)
    assert mg.arena_bytes <= floor - 1 and mg.stats["loss_blocks"] == 8
    # "auto" (the default) splits only because the budget needs it, into the fewest blocks that fit
    m2 = copy.deepcopy(model)
    auto = memgraph.compile(m2, loss_fn, batches[0], optimizer=OPTIMIZERS["sgd"](trainable(m2)),
                            budget=f"{floor - 1}B", device="cpu", verbose=False, cache=False)
    assert auto.stats["loss_blocks"] == 2
    assert "loss head runs in 2 row blocks" in compile_report(auto)
    m3 = copy.deepcopy(model)
    fits = memgraph.compile(m3, loss_fn, batches[0], optimizer=OPTIMIZERS["sgd"](trainable(m3)),
                            budget=f"{floor + (64 << 10)}B", device="cpu", verbose=False, cache=False)
    assert fits.stats["loss_blocks"] == 1  # a budget the unsplit step runs in: no split, eager's bits
    want_losses, _ = eager_steps(model, loss_fn, batches, OPTIMIZERS["sgd"])
    for batch, want in zip(batches, want_losses, strict=True):
        torch.testing.assert_close(engine.run(mg, batch)["loss"], want, rtol=1e-6, atol=0)


def test_the_head_is_found_in_a_hugging_face_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_fn(m, b):
        return m(input_ids=b, labels=b).loss  # shifted labels, the last position ignored (-100)

    loss, want, _ = grads(model, loss_fn, ids, "off")
    got_loss, got, mg = grads(model, loss_fn, ids, 4)
    assert sum(v.op == "aten::nll_loss_forward" for v in mg.taskgraph.vertices) == 4
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_step_without_a_loss_head_is_left_alone():
    model, loss_fn, batches = make_case("mlp")
    tg = TRACE.trace(model, loss_fn, batches[0], device="cpu")
    assert split_loss_head(tg, 4) is tg


@pytest.mark.parametrize("bad", [1, 0, "on", 2.5, True])
def test_split_takes_off_or_a_block_count(gpt, bad):
    model, loss_fn, batches = gpt
    with pytest.raises(ValueError, match="split must be"):
        memgraph.compile(model, loss_fn, batches[0], device="cpu", verbose=False, cache=False, split=bad)


def test_every_micro_batchs_head_is_split_when_accumulating(gpt):
    model, loss_fn, batches = gpt
    micro = [batches[0], batches[1]]

    def run(split):
        m = copy.deepcopy(model)
        mg = memgraph.compile(m, loss_fn, micro[0], optimizer=OPTIMIZERS["sgd"](trainable(m)), accumulation_steps=2,
                              device="cpu", verbose=False, cache=False, split=split)
        return mg, engine.run(mg, micro)

    plain, want = run("off")
    blocks, got = run(4)
    assert sum(v.op == "aten::nll_loss_forward" for v in blocks.taskgraph.vertices) == 8  # 2 heads x 4 blocks
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-6, atol=0)
    for key, tensor in plain.state_dict().items():
        torch.testing.assert_close(blocks.state_dict()[key], tensor, rtol=0, atol=1e-6)


def test_auto_split_traces_once(monkeypatch):
    """"auto" splits the graph it traced, unsplit and undonated, instead of tracing the step again for
    each block count it tries (a 7B model's trace takes tens of seconds)."""
    from turnip import gpt

    compile_module = sys.modules["turnip.memgraph.compiler"]
    calls = []
    real = compile_module.trace_step
    monkeypatch.setattr(compile_module, "trace_step", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    cfg = gpt.GPTConfig(vocab=4096, d_model=32, n_layers=1, n_heads=2)
    torch.manual_seed(0)
    model, batch = gpt.GPT(cfg), gpt.example_batch(cfg)
    with pytest.raises(InfeasibleBudget):  # far below any split: every count is tried, still one trace
        memgraph.compile(model, gpt.lm_loss, batch, budget="8KiB", device="cpu", verbose=False, cache=False)
    assert len(calls) == 1 and calls[0]["donate"] is False


def test_a_summed_loss_splits_too(gpt):
    """reduction="sum": the blocks' sums add up to the loss, no division by the total weight."""
    import torch.nn.functional as F

    model, _loss, batches = gpt

    def summed(m, batch):
        idx, targets = batch
        logits = m(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")

    loss, want, _ = grads(model, summed, batches[0], "off")
    got_loss, got, mg = grads(model, summed, batches[0], 4)
    assert not any(v.op == "aten::div.Tensor" and v.phase == "forward" and not v.module
                   for v in mg.taskgraph.vertices)
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
