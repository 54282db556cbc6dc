"""torchao's CPUOffloadOptimizer: the optimizer's states and its step on the CPU, the weights on the GPU.

torchao                  CPUOffloadOptimizer(params, AdamW, fused=True): gradients copied down after each
                         parameter's backward, the CPU's fused AdamW, updated weights copied back
torchao_offload_grads    the same with offload_gradients=True (a GPU gradient is freed once it is copied
                         down) and per-block checkpointing: torchao's lowest-memory configuration

Both compute eager's math: fp32 weights, torch's AdamW with the workload's options (run on the CPU),
no clipping. Parameters under 4096 elements stay on the GPU with an on-device AdamW (torchao's
``minimal_size``). CPUOffloadOptimizer's gradient hooks keep the model and optimizer alive after the
run, so each configuration must run in a process of its own (the suite's isolation does that).
"""

from __future__ import annotations

import torch

from . import eager
from .checkpoint import checkpoint_blocks
from .common import EAGER_MATH, OK, PeerResult, Workload, trainable_bytes, unavailable


def run_config(system: str, workload: Workload, device, steps: int, offload_gradients: bool, **kw) -> PeerResult:
    if (missing := unavailable(system, device, "torchao.optim")) is not None:
        missing.math = EAGER_MATH
        return missing
    from torchao.optim import CPUOffloadOptimizer  # optional: present only where the wheel was installed

    spec = workload.optimizer
    options = dict(spec.kwargs)
    if spec.cls is torch.optim.AdamW:
        options.setdefault("fused", True)  # torchao's default too: the CPU's fused AdamW

    def make_optimizer(params):
        return CPUOffloadOptimizer(params, spec.cls, offload_gradients=offload_gradients, **options)

    prepare = checkpoint_blocks if offload_gradients else None
    result = eager.run_with(system, workload, device, steps, prepare=prepare, make_optimizer=make_optimizer, **kw)
    result.extra.update(optimizer=f"CPUOffloadOptimizer({spec.name}, {options})",
                        offload_gradients=offload_gradients, checkpoint="per block" if prepare else None)
    if result.status == OK:  # gradients go down, updated weights come back: every trainable byte each way
        result.bytes_h2d = result.bytes_d2h = trainable_bytes(workload.model)
        result.extra["bytes_estimated"] = True
    return result


def run(workload: Workload, device, steps: int, **kw) -> PeerResult:
    return run_config("torchao", workload, device, steps, offload_gradients=False, **kw)


def run_offload_gradients(workload: Workload, device, steps: int, **kw) -> PeerResult:
    return run_config("torchao_offload_grads", workload, device, steps, offload_gradients=True, **kw)
