"""Peers that need a package the GPU image may not have: DeepSpeed ZeRO-Offload, torchao, torchtune.

Nothing is ever installed from here: each peer first checks that its package
imports and otherwise returns a "not installed" result, so the suite records
the absence instead of failing. Each runs the workload's model, loss, batch and
optimizer options through that package's own offloading.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import socket

from turnip.bench.peers import eager
from turnip.bench.peers.checkpoint import checkpoint_blocks
from turnip.bench.peers.common import NOT_INSTALLED, PeerResult, Workload, guarded, is_cuda, timed_steps, trainable

log = logging.getLogger(__name__)


def importable(module: str) -> str | None:
    """None if ``module`` imports, else why not (missing, or broken: e.g. built for another torch)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{module.split('.')[0]} is not installed"
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken install is as good as a missing one here
        return f"{module} does not import: {type(exc).__name__}: {exc}"[:300]
    return None


def _not_installed(system: str, why: str) -> PeerResult:
    log.info("%s: %s", system, why)
    return PeerResult(system, status=NOT_INSTALLED, error=why)


def _needs_cuda(system: str, device) -> PeerResult | None:
    return None if is_cuda(device) else PeerResult(system, status="skipped", error="needs a CUDA device")


def run_torchao(workload: Workload, device, steps: int, **kw) -> PeerResult:
    """torchao.optim.CPUOffloadOptimizer: optimizer states and the update on the CPU, weights on the GPU."""
    system = "torchao"
    why = importable("torchao.optim")
    if why:
        return _not_installed(system, why)
    if (skip := _needs_cuda(system, device)) is not None:
        return skip
    from torchao.optim import CPUOffloadOptimizer

    spec = workload.optimizer

    def make_optimizer(params):
        return CPUOffloadOptimizer(params, spec.cls, offload_gradients=False, **spec.kwargs)

    result = eager.run_with(system, workload, device, steps, make_optimizer=make_optimizer, **kw)
    if result.status == "ok":  # gradients go down, updated weights come back: every trainable byte each way
        nbytes = sum(p.numel() * p.element_size() for p in trainable(workload.model))
        result.bytes_h2d = result.bytes_d2h = nbytes
        result.extra["bytes_estimated"] = True
    return result


def run_torchtune(workload: Workload, device, steps: int, **kw) -> PeerResult:
    """torchtune.training.OffloadActivations with per-block checkpointing (torchtune's recommended pairing)."""
    system = "torchtune"
    why = importable("torchtune.training")
    if why:
        return _not_installed(system, why)
    if (skip := _needs_cuda(system, device)) is not None:
        return skip
    from torchtune.training import OffloadActivations

    return eager.run_with(system, workload, device, steps, prepare=checkpoint_blocks,
                          forward_context=OffloadActivations, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_deepspeed(workload: Workload, device, steps: int, warmup: int = 1, deadline: float | None = None,
                  limit_s: float | None = None) -> PeerResult:
    """DeepSpeed ZeRO-Offload: ZeRO stage 2 with the optimizer (states and step) on the CPU, one process."""
    system = "deepspeed"
    why = importable("deepspeed")
    if why:
        return _not_installed(system, why)
    if (skip := _needs_cuda(system, device)) is not None:
        return skip
    import deepspeed
    import torch.distributed as dist

    result = PeerResult(system)
    spec = workload.optimizer
    opt_params = {k: v for k, v in spec.kwargs.items() if k in ("lr", "betas", "eps", "weight_decay")}
    leaves = [x for x in workload.batch if hasattr(x, "shape")] if isinstance(workload.batch, (tuple, list)) else []
    micro_batch = int(leaves[0].shape[0]) if leaves else 1
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": spec.name, "params": opt_params},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "zero_allow_untested_optimizer": True,
        # fp32 weights like every other system; the loss function's autocast does the bf16 math
    }

    def body():
        # a one-process "distributed" job on this machine only
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                           ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        if not (dist.is_available() and dist.is_initialized()):
            deepspeed.init_distributed(dist_backend="nccl")
        model = workload.fresh_model(device)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable(model), config=config)
        batch = workload.batch_on(device)

        def step():
            loss = workload.loss_fn(engine, batch)
            engine.backward(loss)
            engine.step()
            return loss

        timed_steps(result, step, steps, device, warmup=warmup, deadline=deadline)
        nbytes = sum(p.numel() * p.element_size() for p in trainable(workload.model))
        result.bytes_h2d = result.bytes_d2h = nbytes  # gradients down, updated weights up
        result.extra["bytes_estimated"] = True

    return guarded(result, device, body, limit_s)
