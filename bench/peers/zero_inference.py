"""DeepSpeed ZeRO-Inference: a model's forward with its weights in pinned CPU memory, fetched layer by layer.

ZeRO-Inference is ZeRO-3 without an optimizer: ``deepspeed.initialize(model=..., config=...)`` with
``offload_param`` to pinned CPU memory, then the engine's module is called as the model was
(DeepSpeed's hooks fetch each submodule's weights before its forward and release them after).
``deepspeed.init_inference`` is DeepSpeed-Inference's kernel injection and tensor parallelism,
another product. No "bf16"/"fp16" section: the model is used in the dtype it was built in (the
prefill benchmark's bf16 weights), so the forward is eager's. DeepSpeed has no byte budget: the
caller compares the measured peak with its budget. Every step fetches every weight from the host;
a larger ``stage3_prefetch_bucket_size`` / ``stage3_max_live_parameters`` would trade GPU memory
for overlap (left at DeepSpeed's defaults, as users run it).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from .zero3 import parameter_bytes, partition_to_host, start_single_process

log = logging.getLogger(__name__)


def inference_config() -> dict:
    """ZeRO-3 with every parameter in pinned CPU memory, no optimizer, no precision section."""
    return {
        "train_micro_batch_size_per_gpu": 1,  # initialize requires a batch size, inference or not
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def prepare(model: nn.Module, device) -> tuple[nn.Module, dict]:
    """``model`` (on the CPU) under ZeRO-Inference: the module to call for the forward, and the facts of
    the setup for the row (DeepSpeed's version, config, setup time and peak, pinned bytes)."""
    import deepspeed  # optional: present only where the wheels were installed

    config = inference_config()
    start_single_process()
    weights = parameter_bytes(model)
    torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    pinned = partition_to_host(model, config, device)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    facts = {"deepspeed": deepspeed.__version__, "ds_config": config, "init_s": time.perf_counter() - started,
             "init_peak_allocated": int(torch.cuda.max_memory_allocated(device)), "pinned_bytes": pinned,
             # every weight crosses the link once per forward (the few DeepSpeed keeps resident aside)
             "bytes_h2d": weights, "bytes_estimated": True}
    log.info("ZeRO-Inference: %.2f GiB of weights partitioned to pinned host memory in %.1fs", pinned / 2**30,
             facts["init_s"])
    engine.module.eval()
    return engine.module, facts
