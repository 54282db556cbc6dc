"""Hugging Face mixture-of-experts models (Mixtral, Qwen2-MoE; tiny configs) on the CPU backend, with
each experts implementation transformers offers on the CPU: "grouped_mm" (the default) trains
bitwise equal to eager (fp32 and bf16), "batched_mm" within eager's own run-to-run spread (bitwise
under torch.use_deterministic_algorithms), "eager" is refused naming the op, the module, the line
and the implementations that compile. ("deepgemm" and "sonicmoe" need CUDA kernels.)"""

from __future__ import annotations

import copy

import pytest
import torch
from turnip.kernels.ops import KernelRefusal, grouped_mm_layout

from turnip import engine, memgraph

transformers = pytest.importorskip("transformers")
if not all(hasattr(transformers, name) for name in ("MixtralForCausalLM", "Qwen2MoeForCausalLM")):
    pytest.skip("this transformers has no Mixtral or Qwen2-MoE", allow_module_level=True)


def tiny_moe(kind: str, experts: str | None, hidden: int = 32, intermediate: int = 48):
    torch.manual_seed(0)
    common = {"vocab_size": 128, "hidden_size": hidden, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_experts_per_tok": 2, "max_position_embeddings": 64}
    if experts is not None:
        common["experts_implementation"] = experts
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=intermediate, num_local_experts=4, **common))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            intermediate_size=48, moe_intermediate_size=intermediate // 2, shared_expert_intermediate_size=48,
            num_experts=4, **common))
    return model.train()


def loss_fn(model, batch):
    return model(input_ids=batch, labels=batch).loss


BATCHES = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]


def make_opt(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def eager_steps(model):
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses = []
    for batch in BATCHES:
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, model.state_dict()


def compiled_steps(model):
    model = copy.deepcopy(model)
    mg = memgraph.compile(model, loss_fn, BATCHES[0], optimizer=make_opt(model.parameters()), device="cpu",
                          verbose=False, cache=False)
    losses = [engine.run(mg, batch)["loss"] for batch in BATCHES]
    return mg, losses, mg.state_dict()


def max_difference(got: dict, want: dict) -> float:
    assert got.keys() >= want.keys()
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_default_grouped_mm_experts_train_bitwise(kind):
    """transformers' default calls aten::_grouped_mm on fp32, which torch's meta kernel refuses (it is
    the CUDA fast path's, bf16 only) and the CPU kernel runs: the trace takes the CPU kernel's checks
    and layout, so the step runs the very kernels eager runs, forward and backward."""
    model = tiny_moe(kind, None)
    assert model.config._experts_implementation == "grouped_mm"
    want_losses, want = eager_steps(model)
    mg, losses, got = compiled_steps(model)
    ops = [v.op for v in mg.taskgraph.vertices]
    assert ops.count("aten::_grouped_mm") == 2 * 3  # (up, down) x (forward, grad input, grad weight)
    assert all(torch.equal(g, w) for g, w in zip(losses, want_losses, strict=True)), (losses, want_losses)
    assert max_difference(got, want) == 0.0


def test_grouped_mm_experts_in_bfloat16_train_bitwise():
    model = tiny_moe("mixtral", "grouped_mm").to(torch.bfloat16)
    want_losses, want = eager_steps(model)
    _, losses, got = compiled_steps(model)
    assert all(torch.equal(g, w) for g, w in zip(losses, want_losses, strict=True)), (losses, want_losses)
    assert max_difference(got, want) == 0.0


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_batched_mm_experts_train_within_eagers_own_spread(kind):
    """"batched_mm" gathers each token's expert weights (gate_up_proj[expert_ids]); the gradient of
    that gather adds duplicate expert ids with index_put_(accumulate=True), which the CPU kernel runs
    in parallel in an order that varies from run to run, so eager differs from itself: measured over
    8 reruns of these 3 steps on a 2-core machine, up to 3.4e-8 (Mixtral) and 1.3e-7 (Qwen2-MoE) in
    the weights, the compiled step 2.2e-8 and 1.8e-7 from one eager run. It is held to 1e-6 from
    eager (a few times that spread); under
    torch.use_deterministic_algorithms(True) the kernel adds in a fixed order and both are bitwise
    equal."""
    model = tiny_moe(kind, "batched_mm")
    want_losses, want = eager_steps(model)
    _, losses, got = compiled_steps(model)
    assert max(abs(g.item() - w.item()) for g, w in zip(losses, want_losses, strict=True)) <= 1e-6
    assert max_difference(got, want) <= 1e-6
    torch.use_deterministic_algorithms(True)
    try:
        want_losses, want = eager_steps(model)
        _, losses, got = compiled_steps(model)
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(g, w) for g, w in zip(losses, want_losses, strict=True)), (losses, want_losses)
    assert max_difference(got, want) == 0.0


@pytest.mark.parametrize("kind, cls, file", [("mixtral", "MixtralExperts", "modeling_mixtral.py"),
                                             ("qwen2_moe", "Qwen2MoeExperts", "modeling_qwen2_moe.py")])
def test_eager_experts_loop_is_refused_naming_the_implementations_that_compile(kind, cls, file):
    """The "eager" experts loop runs only the experts some token chose (nonzero, then a Python loop
    over them): a data-dependent number of ops, refused at its line with the way out."""
    model = tiny_moe(kind, "eager")
    with pytest.raises(memgraph.UnsupportedOp) as info:
        memgraph.compile(model, loss_fn, BATCHES[0], optimizer=make_opt(model.parameters()), device="cpu",
                         verbose=False, cache=False)
    err = info.value
    assert (err.op, err.module, err.module_type) == ("aten::nonzero", "model.layers.0.mlp.experts", cls)
    assert err.source is not None and err.source.file.endswith(file) and ".nonzero()" in err.source.text
    message = str(err)
    assert f"module 'model.layers.0.mlp.experts' ({cls})" in message
    assert 'experts implementation "eager"' in message
    assert 'experts_implementation="grouped_mm" (transformers\' default) or "batched_mm"' in message


def test_grouped_mm_inputs_eager_refuses_are_refused_as_eager_refuses_them():
    """An intermediate size of 42 floats (168 bytes) is no multiple of 16 bytes: eager's grouped mm
    refuses the down projection's weight, and so does compile, at the call, naming batched_mm."""
    model = tiny_moe("mixtral", None, hidden=40, intermediate=42)
    with pytest.raises(RuntimeError, match="strides should be multiple of 16 bytes"):
        loss_fn(copy.deepcopy(model), BATCHES[0])
    with pytest.raises(memgraph.UnsupportedOp) as info:
        memgraph.compile(model, loss_fn, BATCHES[0], optimizer=make_opt(model.parameters()), device="cpu",
                         verbose=False, cache=False)
    err = info.value
    assert isinstance(err, RuntimeError)  # an EagerRefusal, as eager raises
    assert (err.op, err.module, err.module_type) == ("aten::_grouped_mm", "model.layers.0.mlp.experts",
                                                     "MixtralExperts")
    assert err.source is not None and "grouped_mm(" in err.source.text
    assert "strides should be multiple of 16 bytes" in str(err) and '"batched_mm"' in str(err)


OFFS = torch.tensor([2, 2, 6], dtype=torch.int32)
CALLS = {  # (mat_a, mat_b, offs, kwargs): accepted and refused as the CPU kernel does
    "2d x 3d": (torch.randn(6, 16), torch.randn(3, 16, 12), OFFS, {}),
    "2d x 3d, b column-major": (torch.randn(6, 16), torch.randn(3, 20, 16).transpose(1, 2), OFFS, {}),
    "padded rows": (torch.randn(6, 16), torch.randn(3, 5, 16).transpose(1, 2), OFFS, {}),
    "2d x 2d": (torch.randn(16, 6), torch.randn(6, 20), OFFS, {}),
    "2d x 2d, weight gradient": (torch.randn(6, 16).t(), torch.randn(6, 20), OFFS, {}),
    "3d x 3d": (torch.randn(3, 6, 16), torch.randn(3, 16, 12), None, {}),
    "bf16": (torch.randn(6, 16).bfloat16(), torch.randn(3, 16, 16).bfloat16(), OFFS, {}),
    "float16, padded": (torch.randn(6, 16).half(), torch.randn(3, 5, 16).half().transpose(1, 2), OFFS, {}),
    "float64": (torch.randn(6, 16).double(), torch.randn(3, 16, 12).double(), OFFS, {}),
    "mixed dtypes": (torch.randn(6, 16), torch.randn(3, 16, 16).bfloat16(), OFFS, {}),
    "misaligned stride": (torch.randn(6, 16), torch.randn(3, 16, 5), OFFS, {}),
    "no offsets": (torch.randn(6, 16), torch.randn(3, 16, 12), None, {}),
    "int64 offsets": (torch.randn(6, 16), torch.randn(3, 16, 12), OFFS.long(), {}),
    "groups mismatch": (torch.randn(6, 16), torch.randn(4, 16, 12), OFFS, {}),
    "contraction mismatch": (torch.randn(6, 16), torch.randn(3, 8, 12), OFFS, {}),
    "out_dtype": (torch.randn(6, 16).bfloat16(), torch.randn(3, 16, 16).bfloat16(), OFFS,
                  {"out_dtype": torch.float32}),
}


def check_layout(name: str, device: str) -> None:
    mat_a, mat_b, offs, kwargs = (x.to(device) if isinstance(x, torch.Tensor) else x for x in CALLS[name])
    try:
        real = torch._grouped_mm(mat_a, mat_b, offs=offs, **kwargs)
    except RuntimeError as err:
        eager_error = str(err)
    else:
        eager_error = None
    try:
        layout = grouped_mm_layout(mat_a, mat_b, offs, **kwargs)
    except KernelRefusal as err:
        assert eager_error is not None, f"eager accepts what the layout refuses: {err}"
        if device == "cpu" and name not in ("mixed dtypes", "float64"):  # eager names dtypes as C++ does
            assert str(err) == eager_error.split("\n")[0]
        return
    assert eager_error is None, f"the layout accepts what eager refuses: {eager_error}"
    assert layout == (list(real.shape), list(real.stride()), real.dtype)


@pytest.mark.parametrize("name", list(CALLS))
def test_grouped_mm_layout_is_the_cpu_kernels(name):
    check_layout(name, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CALLS))
def test_grouped_mm_layout_is_the_cuda_kernels(name):
    """The trace takes the same layout on CUDA: the bfloat16 fast path and the fallback for the
    other dtypes make their result with the CPU kernel's helpers."""
    check_layout(name, "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_grouped_mm_experts_train_on_cuda_as_eager_does(dtype):
    """On CUDA, float32 experts run CUDA's per-group fallback, which the meta kernel (bfloat16
    only) would refuse; the step matches eager on CUDA within CUDA's tolerance, and eager's own
    run-to-run spread on the same step is measured beside it."""
    model = tiny_moe("mixtral", None).to(dtype)
    runs = []
    for _ in range(2):
        eager = copy.deepcopy(model).cuda()
        opt = make_opt(eager.parameters())
        for batch in BATCHES:
            opt.zero_grad()
            loss_fn(eager, batch.cuda()).backward()
            opt.step()
        runs.append({k: v.cpu() for k, v in eager.state_dict().items()})
    spread = max_difference(runs[1], runs[0])
    compiled = copy.deepcopy(model)
    mg = memgraph.compile(compiled, loss_fn, BATCHES[0].cuda(), optimizer=make_opt(compiled.parameters()),
                          device="cuda", verbose=False, cache=False)
    assert "aten::_grouped_mm" in {v.op for v in mg.taskgraph.vertices}
    for batch in BATCHES:
        engine.run(mg, batch.cuda())
    got = {k: v.cpu() for k, v in mg.state_dict().items()}
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert max_difference(got, runs[0]) <= max(tolerance, spread), (max_difference(got, runs[0]), spread)


def test_the_bench_mixtral_workload_trains_bitwise_under_autocast_at_half_its_peak():
    """The bench's Mixtral (its tiny form: default experts, bf16 autocast, AdamW) at a budget that
    makes the planner evict, as `python -m turnip.bench suite --models mixtral` runs it."""
    from turnip.bench.models.sizes import make_workload

    workload = make_workload("mixtral", tiny=True)
    assert workload.info["experts_implementation"] == "grouped_mm"
    eager_model = copy.deepcopy(workload.model)
    opt = workload.optimizer(eager_model.parameters())
    want_losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = workload.loss_fn(eager_model, workload.batch)
        loss.backward()
        opt.step()
        want_losses.append(loss.detach())
    model = copy.deepcopy(workload.model)
    mg = memgraph.compile(model, workload.loss_fn, workload.batch, optimizer=workload.optimizer(model.parameters()),
                          device="cpu", budget=0.5, verbose=False, cache=False)
    assert mg.summary()["bytes_offloaded"] > 0 or mg.plan.recompute, "the budget should make the plan evict"
    losses = [engine.run(mg, workload.batch)["loss"] for _ in range(2)]
    assert all(torch.equal(g, w) for g, w in zip(losses, want_losses, strict=True)), (losses, want_losses)
    assert max_difference(mg.state_dict(), eager_model.state_dict()) == 0.0


def test_grouped_mm_reading_offsets_on_the_host_stays_out_of_cuda_graph_segments():
    """CUDA's float32 grouped mm copies the group offsets to the host, which no CUDA graph can
    capture: on a CUDA step such a vertex is left out of every segment (the rest is captured);
    on the CPU, where no graph is captured, and in bfloat16 (CUDA's fast path) it joins."""
    import dataclasses

    from turnip.memgraph.segments import find_segments

    def grouped_in_segments(mg, device):
        on = dataclasses.replace(mg, taskgraph=dataclasses.replace(mg.taskgraph, device=device))
        tasks = on.taskgraph.vertices
        return sum(tasks[on.vertices[v].task_vertex].op == "aten::_grouped_mm" for s in find_segments(on) for v in s)

    fp32, _, _ = compiled_steps(tiny_moe("mixtral", None))
    assert grouped_in_segments(fp32, "cpu") == 6
    assert grouped_in_segments(fp32, "cuda") == 0
    bf16, _, _ = compiled_steps(tiny_moe("mixtral", None).to(torch.bfloat16))
    assert grouped_in_segments(bf16, "cuda") == 6
