"""The DeepSpeed ZeRO-3 peers checked without DeepSpeed or a GPU: ZeRO-Inference's and ZeRO-Infinity's
configurations keep clear of DeepSpeed's pitfalls (a "bf16" section changes the math, clipping is on by
default), both rows say why they did not run (no CUDA, no deepspeed), the LoRA peer is a suite system
run by name, and a spawned call reports its value or why it has none."""

from __future__ import annotations

import importlib.util
import operator
import signal
import time

import pytest
import torch
from turnip.bench.models.sizes import make_workload
from turnip.bench.peers import CUDA_PEERS, PEERS, zero_inference, zero_infinity
from turnip.bench.peers.spawned import call_spawned
from turnip.bench.suite import ALL_SYSTEMS, expand_systems

PINNED_CPU = {"device": "cpu", "pin_memory": True}
no_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None,
                                  reason="deepspeed is installed here: its 'not installed' row cannot be shown")


@pytest.fixture(scope="module")
def lora():
    pytest.importorskip("peft")
    return make_workload("lora7b", tiny=True)


def test_zero_inference_config_is_zero3_with_pinned_weights_and_no_precision_section():
    config = zero_inference.inference_config()
    assert config["zero_optimization"] == {"stage": 3, "offload_param": PINNED_CPU}
    # the model runs in the dtype it was built in (eager's bf16 weights): DeepSpeed must not cast it
    assert not {"bf16", "fp16", "torch_autocast", "optimizer"} & set(config)
    assert config["train_micro_batch_size_per_gpu"] == 1  # initialize refuses a config without a batch size


def test_zero_infinity_config_is_eagers_math_with_everything_offloaded(lora):
    config = zero_infinity.infinity_config(lora)
    assert "bf16" not in config and "fp16" not in config  # "bf16" would run the model in bf16 weights
    assert config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}  # the loss's autocast, inside DeepSpeed
    assert config["gradient_clipping"] == 0.0  # DeepSpeed clips at 1.0 unless told not to; eager does not
    assert config["zero_optimization"] == {"stage": 3, "offload_param": PINNED_CPU, "offload_optimizer": PINNED_CPU}
    # torch's AdamW options written out (DeepSpeed's CPU Adam defaults to weight decay 0)
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                               "weight_decay": 0.01}}
    assert config["train_micro_batch_size_per_gpu"] == lora.batch[0].shape[0]


def test_zero_infinity_is_a_suite_system_run_by_name():
    name = "deepspeed_zero3_infinity"
    assert PEERS[name] is zero_infinity.run and name in CUDA_PEERS
    assert name not in ALL_SYSTEMS and name in expand_systems(["offloading"])
    assert expand_systems(["turnip", name, "eager"]) == ["eager", "turnip", name]


def test_zero_infinity_is_skipped_without_cuda(lora):
    res = zero_infinity.run(lora, "cpu", 1)
    assert (res.system, res.status, res.error, res.math) == ("deepspeed_zero3_infinity", "skipped",
                                                             "needs a CUDA device", "eager")
    assert not res.losses and res.peak_allocated is None and res.bytes_h2d is None


@no_deepspeed
def test_zero_infinity_without_deepspeed_says_so(lora, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the CUDA check, to the import
    res = zero_infinity.run(lora, "cuda", 1)
    assert res.status == "not installed" and "deepspeed" in res.error and not res.losses


def test_a_spawned_call_returns_its_value_or_why_not():
    assert call_spawned(operator.add, 2, 3, limit_s=120).value == 5
    failed = call_spawned(int, "not a number", limit_s=120)
    assert failed.status == "error" and "ValueError" in failed.error and failed.value is None
    killed = call_spawned(signal.raise_signal, signal.SIGKILL, limit_s=120)  # as the host's OOM killer would
    assert killed.status == "oom" and killed.exitcode == -signal.SIGKILL
    started = time.monotonic()
    slow = call_spawned(time.sleep, 60, limit_s=1)
    assert slow.status == "timeout" and time.monotonic() - started < 30
