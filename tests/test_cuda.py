"""GPU checks: tracing on CUDA, the CUDA engine against eager, no allocation during steps.

Skipped cleanly without CUDA (CI has none); run on the device with
`python -m pytest -q tests/test_cuda.py`.
"""


import copy
import dataclasses

import pytest
import torch
from cases import assert_same_state, eager_steps, make_case, trainable
from turnip.memgraph import ReferenceExecutor

from turnip import engine, memgraph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA_TOL = {"rtol": 1e-3, "atol": 1e-4}


def adamw(params):
    # fused AdamW: the kernel turnip runs on CUDA; foreach kernels round differently, and Adam turns
    # any rounding difference on a near-zero gradient into a difference of the order of lr
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)


def budget_bytes(model, loss_fn, batch, fraction: float, optimizer=None) -> int:
    """`fraction` of what the step needs beyond the engine stream's library workspace (about 32 MiB
    on an H100, more than these test models' whole step): the budgets then force offloading as
    they would on a real model."""
    optimizer = optimizer or adamw(trainable(model))
    mg = memgraph.compile(model, loss_fn, batch, optimizer=optimizer, budget=None, device="cuda")
    reserve = mg.taskgraph.runtime_reserve
    return reserve + int(fraction * (mg.stats["unplanned_peak"] - reserve))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)


@pytest.mark.parametrize("model_name", ["gpt", "hf_gpt2"])
def test_reference_on_cuda_matches_eager(model_name):
    model, loss_fn, batches = make_case(model_name, dropout=0.1, device="cuda")
    want_losses, want_state = eager_steps(model, loss_fn, batches, adamw)
    tg = memgraph.trace(model, loss_fn, batches[0], optimizer=adamw(trainable(model)), device="cuda")
    runner = ReferenceExecutor(tg)
    torch.manual_seed(123)
    losses = [runner.run(b)["loss"].item() for b in batches]
    assert losses == pytest.approx([x.item() for x in want_losses], rel=1e-4)
    assert_same_state(runner.state_dict(), want_state, exact=False, **CUDA_TOL)


@pytest.mark.parametrize("model_name", ["mlp", "gpt", "hf_gpt2"])
@pytest.mark.parametrize("budget", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("ordering", ["nondeterministic", "deterministic"])
def test_cuda_engine_matches_eager(model_name, budget, ordering):
    model, loss_fn, batches = make_case(model_name, dropout=0.1, device="cuda")
    want_losses, want_state = eager_steps(model, loss_fn, batches, adamw)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(trainable(model)),
                          budget=budget_bytes(model, loss_fn, batches[0], budget), device="cuda")
    assert memgraph.verify(mg) == []
    torch.manual_seed(123)
    losses = [engine.run(mg, b, ordering=ordering)["loss"].item() for b in batches]
    assert losses == pytest.approx([x.item() for x in want_losses], rel=1e-4)
    assert_same_state(mg.state_dict(), want_state, exact=False, **CUDA_TOL)


@pytest.mark.parametrize("transfer_ahead", [1, 4])
@pytest.mark.parametrize("ordering", ["nondeterministic", "random"])
def test_copies_reported_at_enqueue_keep_every_edge(transfer_ahead, ordering):
    """transfer_ahead: the loop goes on while copies run, their order kept by device-side waits only;
    a missing wait would show as a wrong reload (a slot read before its offload ended)."""
    model, loss_fn, batches = make_case("gpt", dropout=0.1, device="cuda")
    want_losses, want_state = eager_steps(model, loss_fn, batches, adamw)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(trainable(model)),
                          budget=budget_bytes(model, loss_fn, batches[0], 0.25), device="cuda")
    assert sum(v.kind.value == "reload" for v in mg.vertices) > 0
    torch.manual_seed(123)
    losses = [engine.run(mg, b, ordering=ordering, seed=7, transfer_ahead=transfer_ahead)["loss"].item()
              for b in batches]
    assert losses == pytest.approx([x.item() for x in want_losses], rel=1e-4)
    assert_same_state(mg.state_dict(), want_state, exact=False, **CUDA_TOL)


def test_steps_after_the_first_two_allocate_nothing():
    """The first step makes library handles, the second captures the segments' CUDA graphs (their
    temporaries come from private pools); then nothing is allocated."""
    model, loss_fn, batches = make_case("gpt", dropout=0.1, device="cuda")
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(trainable(model)),
                          budget=budget_bytes(model, loss_fn, batches[0], 0.5), device="cuda")
    engine.run(mg, batches[0])
    engine.run(mg, batches[1])
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    for b in batches[1:] * 2:
        engine.run(mg, b)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    assert after["num_alloc_retries"] == before["num_alloc_retries"]
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    assert after["segment.all.allocated"] == before["segment.all.allocated"]  # no new cudaMalloc


def test_random_ops_are_measured_before_the_arena_is_allocated():
    """The generator advances of random ops are measured on scratch tensors before the arena
    exists, so the first step's peak is not the arena plus two of the largest random outputs."""
    model, loss_fn, batches = make_case("gpt", dropout=0.1, device="cuda")
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(trainable(model)),
                          budget=budget_bytes(model, loss_fn, batches[0], 0.5), device="cuda")
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        engine.run(mg, batches[0])
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    allocs = [e for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc"]
    arena = next(k for k, e in enumerate(allocs) if e["size"] == mg.arena_bytes)
    scratch = [k for k, e in enumerate(allocs)
               if any(f.get("filename", "").endswith("kernels/step_state.py") for f in e.get("frames", []))]
    assert scratch and max(scratch) < arena
    mg.release()


def test_cuda_dropout_replay_is_stable_across_steps():
    """Later steps compute generator states by counting; they must equal eager's draws."""
    model, loss_fn, batches = make_case("mlp", dropout=0.3, device="cuda")
    batches = batches * 2
    want_losses, want_state = eager_steps(model, loss_fn, batches, sgd)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=sgd(trainable(model)), device="cuda")
    torch.manual_seed(123)
    losses = [engine.run(mg, b)["loss"].item() for b in batches]
    assert losses == pytest.approx([x.item() for x in want_losses], rel=1e-5)
    assert_same_state(mg.state_dict(), want_state, exact=False, **CUDA_TOL)


def test_pinned_storage_is_exactly_the_planned_bytes():
    """torch's pinned allocator would round the storage up to a power of two; turnip pins what it needs."""
    model, loss_fn, batches = make_case("gpt", dropout=0.1, device="cuda")
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(trainable(model)),
                          budget=budget_bytes(model, loss_fn, batches[0], 0.25), device="cuda")
    assert mg.cpu_bytes > 0
    engine.run(mg, batches[0])
    storage = mg.runtime.storage
    assert storage.numel() == mg.cpu_bytes and storage.is_pinned()
    mg.release()


def test_multi_tensor_update_matches_eager_fused_adamw():
    """One _fused_adamw_ vertex per block updates every parameter of the block in its home."""
    model, loss_fn, batches = make_case("gpt", dropout=0.0, device="cuda")
    want_losses, want_state = eager_steps(model, loss_fn, batches, adamw)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(trainable(model)), budget=1.0, device="cuda")
    tg = mg.taskgraph
    updates = [v for v in tg.vertices if v.op == "aten::_fused_adamw_"]
    assert len(updates) < len(trainable(model)) and max(len(v.copy_in) for v in updates) > 3
    assert mg.stats["in_place"] >= 3 * len(trainable(model)) and mg.stats.get("copies", 0) == 0
    losses = [engine.run(mg, b)["loss"].item() for b in batches]
    assert losses == pytest.approx([x.item() for x in want_losses], rel=1e-4)
    assert_same_state(mg.state_dict(), want_state, exact=False, **CUDA_TOL)


def test_cuda_graph_segments_equal_plain_launches_under_a_scheduler():
    """Segments replayed as CUDA graphs (attention ops among their kernels) give the per-vertex launches'
    numbers bit for bit, also when an LR scheduler changes a scalar a captured graph baked in (it is
    captured again, then, changing step after step, launched plainly)."""
    model, loss_fn, batches = make_case("gpt", dropout=0.0, device="cuda")
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(trainable(model)),
                          budget=budget_bytes(model, loss_fn, batches[0], 0.5), device="cuda")
    assert mg.segments and memgraph.verify(mg) == []
    tasks = mg.taskgraph.vertices  # attention without dropout is captured too (kernels/ops.py draws)
    assert any("attention" in tasks[mg.vertices[v].task_vertex].op for seg in mg.segments for v in seg)
    plain = dataclasses.replace(mg, segments=[])

    def run(g):
        g.optimizer = adamw(trainable(model))
        schedule = torch.optim.lr_scheduler.LambdaLR(g.optimizer, lambda step: 1.0 / (1 + step))
        losses = []
        for b in batches + batches:
            losses.append(engine.run(g, b)["loss"].item())
            schedule.step()
        return losses, g.state_dict()

    want_losses, want_state = run(plain)
    losses, state = run(mg)
    graphs = mg.runtime.segment_graphs
    assert not graphs.uncapturable
    assert graphs.captures > len(mg.segments)  # every segment, and the scheduled ones again once
    assert graphs.volatile and graphs.volatile <= set(graphs.recaptures)  # then plain launches
    assert losses == want_losses
    assert_same_state(state, want_state)
    mg.release()
    plain.release()


def test_a_lane_whose_capture_failed_launches_and_captures_again():
    """A capture that fails (here: a host synchronization inside it) leaves the lane's pool marked
    as captured into; the lane is given a new pool (LanePools.renew), so its plain launches and
    later captures still allocate from a pool of its own."""
    from turnip.engine.lane_pools import LanePools
    from turnip.kernels.capture import captured

    pools = LanePools(block=0)
    stream = torch.cuda.Stream()
    pools.add("lane", stream, prewarm=False)
    x = torch.ones(1024, device="cuda")
    with torch.cuda.stream(stream):
        with pytest.raises(RuntimeError):  # torch.AcceleratorError is one
            captured(lambda: (x * 2).sum().item(), pools.handle("lane"))
        pools.renew("lane")
        with pools.allocating_from("lane"):
            y = x * 3
        graph = captured(lambda: torch.mul(x, 4, out=y), pools.handle("lane"))
        graph.replay()
    stream.synchronize()
    assert y[0].item() == 4.0 and len(pools.retired) == 1


def test_forward_only_step_matches_eager_under_a_budget():
    """compile(..., backward=False) on CUDA: the outputs (returned in pinned host memory) are eager's
    no_grad forward within float tolerance at a budget that streams weights."""
    model, _loss, batches = make_case("gpt", device="cuda")
    model.eval()

    def last(m, batch):
        return m(batch[0])[:, -1]

    full = memgraph.compile(model, last, batches[0], device="cuda", backward=False)
    reserve = full.taskgraph.runtime_reserve
    budget = reserve + int(0.4 * (full.stats["unplanned_peak"] - reserve))
    mg = memgraph.compile(model, last, batches[0], budget=budget, device="cuda", backward=False)
    assert memgraph.verify(mg) == []
    for batch in batches:
        out = engine.run(mg, batch)["output"]
        with torch.no_grad():
            want = last(model, batch)
        assert out.device.type == "cpu"
        torch.testing.assert_close(out, want.cpu(), **CUDA_TOL)
    mg.release()


def test_loss_head_in_row_blocks_matches_eager():
    """compile(split=4) on CUDA: the loss and the gradients within float tolerance of the unsplit step."""
    model, loss_fn, batches = make_case("gpt", device="cuda")

    def step(split):
        mg = memgraph.compile(model, loss_fn, batches[0], device="cuda", split=split)
        out = engine.run(mg, batches[0])
        mg.release()
        return out

    plain, blocks = step("off"), step(4)
    torch.testing.assert_close(blocks["loss"], plain["loss"], rtol=1e-5, atol=0)
    for name in plain:
        torch.testing.assert_close(blocks[name], plain[name], rtol=1e-3, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("transfer_ahead", [0, 4])
def test_callback_completions_match_events_and_eager(transfer_ahead):
    """completion="callback": host functions report each unit; with launch-ahead, copies reported at
    enqueue (transfer_ahead=4), segment capture (step 2) and replay (step 3) the step is events' and
    eager's. Needs CuPy (the cuda12 / cuda13 extras)."""
    pytest.importorskip("cupy", reason="completion='callback' needs CuPy")
    model, loss_fn, batches = make_case("gpt", dropout=0.1, device="cuda")
    want_losses, want_state = eager_steps(model, loss_fn, batches, adamw)
    budget = budget_bytes(model, loss_fn, batches[0], 0.25)

    def steps(completion):
        mg = memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(trainable(model)), budget=budget,
                              device="cuda")
        assert mg.segments and sum(v.kind.value == "reload" for v in mg.vertices) > 0
        torch.manual_seed(123)
        losses = [engine.run(mg, b, completion=completion, transfer_ahead=transfer_ahead)["loss"].item()
                  for b in batches]
        state = mg.state_dict()
        mg.release()
        return losses, state

    event_losses, event_state = steps("events")
    losses, state = steps("callback")
    assert losses == pytest.approx(event_losses, rel=1e-6)
    assert_same_state(state, event_state, exact=False, rtol=1e-6, atol=1e-7)
    assert losses == pytest.approx([x.item() for x in want_losses], rel=1e-4)
    assert_same_state(state, want_state, exact=False, **CUDA_TOL)


@pytest.mark.parametrize("completion", ["events", "callback"])
@pytest.mark.parametrize("ordering", ["nondeterministic", "deterministic"])
def test_updates_on_the_host_match_eager(completion, ordering):
    """host_update="all": every fused AdamW update runs on the host's cores (CPU _fused_adamw_) on the
    pinned homes of its parameter and states; within float tolerance of eager stepping the same CPU
    kernel (ZeRO-Offload's way). Against eager's CUDA fused AdamW it is not: where sqrt(v) is near
    eps the two kernels' formulations part by up to about lr (bench/results/test_logs/cuda_tests_host_788d9fb.txt)."""
    if completion == "callback":
        pytest.importorskip("cupy", reason="completion='callback' needs CuPy")
    model, loss_fn, batches = make_case("gpt", dropout=0.1, device="cuda")
    want_losses, want_state = eager_steps_cpu_update(model, loss_fn, batches)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(trainable(model)),
                          budget=budget_bytes(model, loss_fn, batches[0], 0.5), device="cuda", host_update="all")
    assert mg.plan.host_update and memgraph.verify(mg) == []
    torch.manual_seed(123)
    losses = [engine.run(mg, b, ordering=ordering, completion=completion)["loss"].item() for b in batches]
    assert losses == pytest.approx([x.item() for x in want_losses], rel=1e-4)
    assert_same_state(mg.state_dict(), want_state, exact=False, **CUDA_TOL)


def eager_steps_cpu_update(model, loss_fn, batches, seed: int = 123):
    """Eager forward and backward on CUDA, the AdamW step by torch's CPU fused kernel on CPU copies
    of the parameters (what a CPU-offloaded optimizer does); returns (losses, state_dict)."""
    model = copy.deepcopy(model)
    params = trainable(model)
    masters = [p.detach().cpu().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.1, fused=True)
    losses = []
    torch.manual_seed(seed)
    for batch in batches:
        for p in params:
            p.grad = None
        loss = loss_fn(model, batch)
        loss.backward()
        for p, master in zip(params, masters):
            master.grad = p.grad.detach().cpu()
        opt.step()
        with torch.no_grad():
            for p, master in zip(params, masters):
                p.copy_(master)
        losses.append(loss.detach().clone())
    return losses, model.state_dict()


FAILED_CAPTURE_THEN_RELEASE = """
import gc
import torch
from turnip.engine.lane_pools import LanePools
from turnip.kernels.capture import captured
pools = LanePools(block=0)
stream = torch.cuda.Stream()
pools.add("lane", stream, prewarm=False)
x = torch.ones(1024, device="cuda")
with torch.cuda.stream(stream):
    try:
        captured(lambda: (x * 2).sum().item(), pools.handle("lane"))
    except RuntimeError:
        pass
    else:
        raise SystemExit("the capture should have failed")
    pools.renew("lane")
stream.synchronize()
pools.clear()  # the engine's release: the retired pool is freed, its cached blocks emptied
gc.collect()
torch.cuda.synchronize()
torch.cuda.empty_cache()
print("released")
"""


def test_a_failed_capture_leaves_no_capture_underway_to_abort_the_process():
    """After a failed capture the allocator must not count a capture as underway: torch aborts the
    process when it next frees cached blocks (the engine's release frees the lane's retired pool)
    if it does."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FAILED_CAPTURE_THEN_RELEASE], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "released" in done.stdout, done.stderr[-2000:]


def test_a_timelines_device_times_follow_the_hosts_launches(tmp_path):
    """A traced step's device times are on the host's clock: no unit starts before the loop launched it.
    They once counted from the step's start, before the step's timers were made, and ran ~9 ms early
    on gpt1.3b (so bench/trace_waits.py blamed the host for gaps that were waits on another device)."""
    import json

    model, loss_fn, batches = make_case("gpt", device="cuda")
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=adamw(trainable(model)),
                          budget=budget_bytes(model, loss_fn, batches[0], 0.5), device="cuda")
    engine.run(mg, batches[0])
    path = tmp_path / "step.json"
    engine.run(mg, batches[1], timeline=path)
    units = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X" and "launched" in e["args"]]
    assert units
    early = [(e["name"], e["ts"] - e["args"]["launched"]) for e in units if e["ts"] < e["args"]["launched"] - 50]
    assert early == []


@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
def test_attention_without_dropout_leaves_the_generator_where_it_was(backend):
    """kernels/ops.py draws: an attention op at dropout_p 0 draws nothing, so segments may capture it in a
    CUDA graph and RngReplay keeps no state for it. The same op with dropout moves the generator."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    moved = {}
    for p in (0.0, 0.1):
        before = gen.get_offset()
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p).sum().backward()
        except RuntimeError as exc:  # a backend this GPU or build lacks
            pytest.skip(f"{backend}: {exc}")
        torch.cuda.synchronize()
        moved[p] = gen.get_offset() - before
    assert moved[0.0] == 0
    assert moved[0.1] > 0
