"""The multi-GPU peers (bench/peers/distributed.py) on the CPU: two gloo ranks under torchrun, a tiny GPT.

Each launch costs about 8 s on two cores (torchrun and two ranks import torch), so every run is a
module-scoped fixture that several tests read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from turnip.bench.models.sizes import make_workload
from turnip.bench.peers import distributed_worker as worker
from turnip.bench.peers.common import ERROR, NOT_INSTALLED, OK, OOM, SKIPPED, TIMEOUT, PeerResult, trainable
from turnip.bench.peers.distributed import default_systems, failure_row, run_all, run_distributed

MODEL = "gpt350m"  # tiny=True: 3 blocks of d_model 64, vocabulary 64, 4 sequences of 32 per rank
WARMUP, STEPS = 1, 2
# Adam's first steps move each weight by about lr = 1e-4 whatever its gradient's size, so a step on the wrong
# gradients is off by ~1e-4 where the signs differ; bf16 autocast and gloo's summation order stay far below
ATOL = 1e-6


def run_with_weights(system: str, folder: Path) -> tuple[dict, dict]:
    path = folder / f"{system}.pt"
    row = run_distributed(system, MODEL, 2, steps=STEPS, warmup=WARMUP, tiny=True, device="cpu", limit_s=120,
                          save_weights=path)
    assert row["status"] == OK, (row.get("error"), row.get("log_tail"))
    return row, torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return run_with_weights("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    return run_with_weights("fsdp2", tmp_path_factory.mktemp("fsdp2"))


@pytest.fixture(scope="module")
def fsdp2_ckpt(tmp_path_factory):
    return run_with_weights("fsdp2-ckpt", tmp_path_factory.mktemp("fsdp2_ckpt"))


def one_process_training(ranks: int, steps: int) -> tuple[dict, list[float]]:
    """What data parallelism over ``ranks`` ranks computes, in this process: each step, the gradient averaged
    over the ranks' micro-batches, then the workload's AdamW. Returns the weights and each step's mean loss."""
    workload = make_workload(MODEL, tiny=True)
    model = workload.fresh_model("cpu")
    optimizer = workload.optimizer(trainable(model))
    batches = [worker.rank_batch(workload, rank) for rank in range(ranks)]
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for batch in batches:
            loss = workload.loss_fn(model, batch)
            (loss / ranks).backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total / ranks)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


@pytest.fixture(scope="module")
def reference():
    return one_process_training(ranks=2, steps=WARMUP + STEPS)


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# -- rows -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("run", ["ddp", "fsdp2"])
def test_a_two_rank_run_gives_a_row_like_the_single_gpu_peers(run, request):
    row, _ = request.getfixturevalue(run)
    single_gpu_fields = PeerResult("x").row().keys()
    assert set(single_gpu_fields) <= row.keys()
    assert row["system"] == run and row["status"] == OK and row["error"] is None
    assert row["devices"] == 2 and row["backend"] == "gloo" and row["global_batch"] == 2 * row["batch_per_device"]
    assert row["model"] == "gpt350m-tiny" and row["budget"] is None and row["math"] == "eager"
    assert len(row["step_s"]) == STEPS and len(row["losses"]) == WARMUP + STEPS
    assert row["step_s_median"] > 0 and row["first_step_s"] > 0
    assert row["peak_allocated"] is None  # no CUDA: as the single-GPU rows on the CPU
    assert row["bytes_h2d"] == row["bytes_d2h"] == 0
    assert row["returncode"] == 0 and row["process_s"] > 0 and "log_tail" not in row
    json.dumps(row)  # goes into the suite's JSON as it is


# -- the math -------------------------------------------------------------------------------------

@pytest.mark.parametrize("run", ["ddp", "fsdp2", "fsdp2_ckpt"])
def test_the_weights_after_training_are_one_process_steps_on_the_averaged_gradients(run, request, reference):
    _, weights = request.getfixturevalue(run)
    expected, _ = reference
    assert largest_difference(weights, expected) < ATOL


def test_the_weight_check_tells_averaged_gradients_from_rank_0s_alone(ddp, reference):
    """The comparison above can fail: training on rank 0's micro-batch only lands ~lr away."""
    _, weights = ddp
    rank_0_only, _ = one_process_training(ranks=1, steps=WARMUP + STEPS)
    assert largest_difference(weights, rank_0_only) > 50 * ATOL
    assert largest_difference(weights, make_workload(MODEL, tiny=True).model.state_dict()) > 50 * ATOL


def test_the_rows_losses_are_the_mean_over_the_ranks(ddp, reference):
    row, _ = ddp
    _, losses = reference
    assert row["losses"] == pytest.approx(losses, abs=1e-4)


def test_rank_0_trains_on_the_single_gpu_rows_batch_and_rank_1_on_its_own():
    workload = make_workload(MODEL, tiny=True)
    first, second = worker.rank_batch(workload, 0), worker.rank_batch(workload, 1)
    assert all(torch.equal(a, b) for a, b in zip(first, workload.batch))
    assert [t.shape for t in second] == [t.shape for t in first] and not torch.equal(first[0], second[0])
    assert torch.equal(second[0][:, 1:], second[1][:, :-1])  # next-token pairs, as the workload's


# -- what stops a run -----------------------------------------------------------------------------

def processes_naming(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def stuck_in_warmup(marker: Path, limit_s: float) -> dict:
    """ddp with more warmup steps than it can run: the ranks' own deadline stops only timed steps, so only
    the kill at ``limit_s`` ends it. ``marker``: a path only this run's command lines carry."""
    return run_distributed("ddp", MODEL, 2, steps=1, warmup=10**6, tiny=True, device="cpu", limit_s=limit_s,
                           save_weights=marker)


def test_a_run_past_its_limit_is_a_timeout_and_leaves_no_process_behind(tmp_path):
    marker = tmp_path / "never-written.pt"
    row = stuck_in_warmup(marker, limit_s=4)  # torchrun is still starting its ranks, or they are importing torch
    assert row["status"] == TIMEOUT and row["error"] == "killed after 4s without a result"
    assert row["devices"] == 2 and row["step_s"] == [] and row["process_s"] < 15
    assert processes_naming(str(marker)) == []


@pytest.mark.slow  # 40 s: two ranks start training in ~10 s on two idle cores, in 20-30 s beside other tests
def test_ranks_killed_while_training_leave_no_process_behind(tmp_path):
    marker = tmp_path / "never-written.pt"
    row = stuck_in_warmup(marker, limit_s=40)
    assert row["status"] == TIMEOUT and "ddp step" in row["log_tail"]  # the ranks were training
    assert processes_naming(str(marker)) == []


def test_a_failing_rank_is_an_error_row_with_the_end_of_the_output():
    row = run_distributed("ddp", "gpt7b-no-such-size", 2, steps=1, warmup=0, tiny=True, device="cpu", limit_s=120)
    assert row["status"] == ERROR and row["error"].startswith("rank "), row.get("log_tail")
    assert "unknown GPT size" in row["error"] and row["failed_ranks"] == [0, 1] and row["returncode"] != 0
    assert "KeyError" in row["log_tail"]  # the ranks' tracebacks, then torchrun's summary


def test_a_cuda_oom_on_any_rank_is_an_oom_row(tmp_path):
    out = tmp_path / "row.json"
    (tmp_path / "row.json.rank1.json").write_text(json.dumps(
        {"rank": 1, "status": OOM, "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
         "peak_allocated": 123}))
    row = failure_row("fsdp2", 4, out, ["...", "exitcode: 1"], killed=False, limit_s=60, returncode=1)
    assert row["status"] == OOM and row["error"].startswith("rank 1: OutOfMemoryError") and row["devices"] == 4
    assert row["peak_allocated"] == 123 and row["failed_ranks"] == [1]
    # a rank that died before it wrote its file: its message in its output is enough
    logs = {0: ["Traceback (most recent call last):", "torch.OutOfMemoryError: CUDA out of memory."], 1: []}
    row = failure_row("ddp", 2, tmp_path / "other.json", [], killed=False, limit_s=60, returncode=1, logs=logs)
    assert row["status"] == OOM and "CUDA out of memory" in row["error"]


def test_a_rank_that_dies_outside_its_guard_is_an_error_with_its_own_last_lines(tmp_path):
    """An import error, a crash: the error quotes the rank that raised, not torchrun's summary."""
    logs = {0: ["hello"], 1: ["Traceback (most recent call last):", '  File "x.py"', "ImportError: cannot import y"]}
    torchrun = ["ChildFailedError:", "exitcode  : 1 (pid: 7)", "====="]
    row = failure_row("ddp", 2, tmp_path / "row.json", torchrun, killed=False, limit_s=60, returncode=1, logs=logs)
    assert row["status"] == ERROR and row["error"].startswith("rank 1 exited without a result")
    assert row["error"].endswith("ImportError: cannot import y") and row["failed_ranks"] == []
    row = failure_row("ddp", 2, tmp_path / "row.json", torchrun, killed=False, limit_s=60, returncode=1)
    assert row["status"] == ERROR and row["error"].startswith("torchrun exited with 1") and "=====" in row["error"]
    row = failure_row("ddp", 2, tmp_path / "row.json", torchrun, killed=True, limit_s=60, returncode=-9, logs=logs)
    assert row["status"] == TIMEOUT and row["error"] == "killed after 60s without a result"


@pytest.mark.parametrize("system", ["fsdp2-offload-ckpt", "zero2-offload", "zero3-offload"])
def test_a_cuda_only_system_on_the_cpu_is_refused_without_starting_torchrun(system):
    row = run_distributed(system, MODEL, 2, tiny=True, device="cpu")
    assert row["status"] == SKIPPED and "needs CUDA" in row["error"] and system in row["error"]
    assert row["devices"] == 2 and "process_s" not in row


def test_the_worker_refuses_a_cuda_only_system_by_itself(tmp_path, monkeypatch):
    """Run by hand under torchrun on a machine without CUDA: rank 0 writes the refusal, no process group."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "row.json"
    assert worker.main(["--system", "zero3-offload", "--model", MODEL, "--tiny", "--device", "cpu",
                        "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["status"] == SKIPPED and "needs CUDA" in row["error"] and row["devices"] == 2


def test_deepspeed_missing_is_not_installed_not_a_crash(monkeypatch):
    monkeypatch.setattr(worker.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(worker, "importable", lambda module: f"{module} is not installed")
    refused = worker.refusal("zero2-offload", "cuda")
    assert refused.status == NOT_INSTALLED and refused.error.startswith("deepspeed not installed")
    assert worker.refusal("fsdp2-offload-ckpt", "cuda") is None


def test_unknown_systems_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="unknown system"):
        run_distributed("ddp2", MODEL, 2, device="cpu")
    with pytest.raises(ValueError, match="unknown systems"):
        run_all(MODEL, 2, ["ddp", "zero4"], device="cpu")


def test_default_systems_by_device_count():
    assert default_systems(1) == ("fsdp2-offload-ckpt", "zero2-offload", "zero3-offload")
    assert default_systems(8)[:2] == ("ddp", "ddp-ckpt") and "ddp-foreach" not in default_systems(8)
    assert set(default_systems(8)) | {"ddp-foreach", "turnip-ranks"} == set(worker.SYSTEMS)  # those two by name only


def test_run_all_hands_each_row_over_as_it_comes_and_times_out_what_it_cannot_start():
    seen = []
    # a deadline already past: nothing starts, every system is a "not started" timeout row
    rows = run_all(MODEL, 2, ["ddp", "fsdp2"], deadline=0.0, on_row=seen.append, tiny=True, device="cpu")
    assert seen == rows and [r["system"] for r in rows] == ["ddp", "fsdp2"]
    assert all(r["status"] == TIMEOUT and r["error"].startswith("not started") for r in rows)


# -- timing across ranks (one gloo rank, in this process) -----------------------------------------

@pytest.fixture
def one_rank_group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29400 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_timing_stops_after_a_timed_step_once_past_the_deadline(one_rank_group):
    result = PeerResult("fake")
    calls = []

    def step():
        calls.append(1)
        return torch.tensor(2.0)

    worker.timed_steps(result, step, steps=5, warmup=2, device=torch.device("cpu"), deadline=0.0)
    assert len(calls) == 3 and len(result.step_s) == 1 and result.losses == [2.0, 2.0, 2.0]
    assert result.first_step_s is not None and result.extra["truncated"] == "deadline after 1 timed steps"
