"""DeepSpeed ZeRO-Infinity's CPU tier with eager's math: the suite's ``deepspeed_zero3_infinity`` row.

ZeRO-3 with ``offload_param`` and ``offload_optimizer`` to pinned CPU memory, per-block activation
checkpointing, and the workload's own math: fp32 weights with the forward under DeepSpeed's
"torch_autocast" bf16 (no "bf16" section: DeepSpeed turns the loss's autocast off inside its engine,
and "bf16" would run the model in bf16 weights), "gradient_clipping" 0.0 (DeepSpeed clips at 1.0 by
default; eager does not), and the workload's AdamW options on the trainable parameters only (a LoRA
model's adapters) through DeepSpeed's CPU Adam. This is the configuration the TURNIP paper compares
its LoRA fine-tuning with. Unlike ``deepspeed_zero3`` (bf16 weights, the model placed whole on the
GPU by initialize before it is partitioned), the model is partitioned into host memory first
(peers/zero3.py), so a 7B model never sits on the GPU at once and the row's peak is the steps'.
"""

from __future__ import annotations

import logging
import time

import torch

from .checkpoint import checkpoint_blocks
from .common import (
    EAGER_MATH,
    OK,
    PeerResult,
    Workload,
    guarded,
    trainable,
    trainable_bytes,
    unavailable,
)
from .zero3 import parameter_bytes, partition_to_host, start_single_process
from .zero_offload import ds_config, time_engine_steps

log = logging.getLogger(__name__)

SYSTEM = "deepspeed_zero3_infinity"


def infinity_config(workload: Workload) -> dict:
    """Stage 3, parameters and optimizer in pinned CPU memory, fp32 weights under DeepSpeed's bf16
    torch_autocast, no clipping, the workload's AdamW options (zero_offload.ds_config's stage-3 form)."""
    return ds_config(workload, stage=3, bf16_weights=False)


def run(workload: Workload, device, steps: int, warmup: int = 1, deadline: float | None = None,
        limit_s: float | None = None) -> PeerResult:
    if (missing := unavailable(SYSTEM, device, "deepspeed")) is not None:
        missing.math = EAGER_MATH
        return missing
    import deepspeed  # optional: present only where the wheels were installed

    result = PeerResult(SYSTEM, math=EAGER_MATH)
    config = infinity_config(workload)
    result.extra.update(ds_config=config, checkpoint="per block", partitioned="zero.Init(module=...) before initialize")

    def body():
        start_single_process()
        model = workload.fresh_model("cpu")
        checkpoint_blocks(model)
        started = time.perf_counter()
        result.extra["pinned_bytes"] = partition_to_host(model, config, device)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable(model), config=config)
        # the first DeepSpeed process of a machine also JIT-builds CPU Adam here: the row says how long
        result.extra["init_s"] = time.perf_counter() - started
        result.extra["init_peak_allocated"] = int(torch.cuda.max_memory_allocated(device))
        log.info("%s: partition + deepspeed.initialize took %.1f s", SYSTEM, result.extra["init_s"])
        time_engine_steps(result, engine, workload, device, steps, warmup, deadline)

    result = guarded(result, device, body, limit_s)
    if result.status == OK:
        # every weight is fetched for the forward and again for the recomputed forward + backward; the
        # trainable gradients go down to CPU Adam (their updated weights come back with the next fetch)
        result.bytes_h2d, result.bytes_d2h = 2 * parameter_bytes(workload.model), trainable_bytes(workload.model)
        result.extra["bytes_estimated"] = True
    return result
