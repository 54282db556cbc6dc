"""DeepSpeed's CPU offloading on one GPU: ZeRO-Offload (stage 2, optimizer on the CPU) and ZeRO-Infinity's
CPU tier (stage 3, parameters and optimizer on the CPU), each with per-block checkpointing.

deepspeed_zero2        stage 2, offload_optimizer cpu (pinned), fp32 weights, "torch_autocast" bf16: eager's math
deepspeed_zero2_bf16   stage 2, offload_optimizer cpu (pinned), "bf16" weights (fp32 master copy on the CPU)
deepspeed_zero3        stage 3, offload_param + offload_optimizer cpu (pinned), "bf16" weights

What DeepSpeed 0.19.8 does on its own, measured on an H100 (see ../shared/tools/device-wheels.sh):
it turns the caller's torch.autocast off inside its engine, so eager's math (fp32 weights, the forward
under bf16 autocast) needs its "torch_autocast" section and no "bf16" section; it clips the gradient
norm to 1.0 unless "gradient_clipping" is 0.0 (eager does not clip); without its launcher it needs the
single-process rendezvous variables. The optimizer is DeepSpeed's own CPU AdamW (DeepSpeedCPUAdam,
JIT-built on first use, ~45 s, cached in ~/.cache/torch_extensions) with the workload's options.
The model is handed to ``deepspeed.initialize`` on the CPU: DeepSpeed casts it (bf16 rows), moves it to
the GPU and, at stage 3, partitions it to the CPU; ``init_peak_allocated`` says what that cost.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import torch

from .checkpoint import checkpoint_blocks
from .common import (
    BF16_WEIGHTS,
    EAGER_MATH,
    OK,
    PeerResult,
    Workload,
    guarded,
    is_cuda,
    timed_steps,
    trainable_bytes,
    unavailable,
)

log = logging.getLogger(__name__)

DS_OPTIMIZERS = {torch.optim.AdamW: "AdamW", torch.optim.Adam: "Adam"}


def micro_batch(workload: Workload) -> int:
    leaves = [x for x in torch.utils._pytree.tree_leaves(workload.batch) if isinstance(x, torch.Tensor)]
    return int(leaves[0].shape[0]) if leaves else 1


def ds_config(workload: Workload, stage: int, bf16_weights: bool) -> dict:
    """The DeepSpeed config of one row: ZeRO ``stage`` with the optimizer (and at stage 3 the parameters)
    in pinned CPU memory; fp32 weights under DeepSpeed's torch_autocast, or bf16 weights."""
    spec = workload.optimizer
    if spec.cls not in DS_OPTIMIZERS:
        raise ValueError(f"the DeepSpeed peers run Adam/AdamW on the CPU, not {spec.name}")
    hp = spec.hyperparameters()
    if hp.get("amsgrad") or hp.get("maximize"):
        raise ValueError("DeepSpeed's CPU Adam has no amsgrad / maximize")
    params = {"lr": float(hp["lr"]), "betas": [float(b) for b in hp["betas"]], "eps": float(hp["eps"]),
              "weight_decay": float(hp["weight_decay"])}
    offload = {"device": "cpu", "pin_memory": True}
    zero: dict = {"stage": stage, "offload_optimizer": dict(offload)}
    if stage == 3:
        zero["offload_param"] = dict(offload)
    config = {
        "train_micro_batch_size_per_gpu": micro_batch(workload),
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": DS_OPTIMIZERS[spec.cls], "params": params},
        "zero_optimization": zero,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; eager does not clip
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if bf16_weights:
        config["bf16"] = {"enabled": True}
    else:  # eager's math: DeepSpeed would otherwise run the forward without the loss's autocast
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> None:
    """The rendezvous DeepSpeed's launcher would set, for a one-process job on this machine."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def estimated_bytes(workload: Workload, stage: int, bf16_weights: bool) -> tuple[int, int]:
    """(host->device, device->host) bytes of one step, from the parameter count: stage 2 sends every
    gradient down and brings every updated weight back; stage 3 also fetches every weight for the forward
    and again for the backward (the recomputed forward reuses the backward's fetch)."""
    dtype = torch.bfloat16 if bf16_weights else None
    nbytes = trainable_bytes(workload.model, dtype)
    if stage == 3:
        return 2 * nbytes, nbytes
    return nbytes, nbytes


def time_engine_steps(result: PeerResult, engine, workload: Workload, device, steps: int, warmup: int,
                      deadline: float | None) -> None:
    """Time ``steps`` training steps of a DeepSpeed engine (loss, engine.backward, engine.step) into
    ``result``, after ``warmup`` untimed ones."""
    batch = workload.batch_on(device)

    def step():
        loss = workload.loss_fn(engine, batch)
        engine.backward(loss)
        engine.step()
        return loss

    timed_steps(result, step, steps, device, warmup=warmup, deadline=deadline)


def run_config(system: str, workload: Workload, device, steps: int, stage: int, bf16_weights: bool,
               warmup: int = 1, deadline: float | None = None, limit_s: float | None = None) -> PeerResult:
    math = BF16_WEIGHTS if bf16_weights else EAGER_MATH
    if (missing := unavailable(system, device, "deepspeed")) is not None:
        missing.math = math
        return missing
    import deepspeed  # optional: present only where the wheels were installed
    import torch.distributed as dist

    result = PeerResult(system, math=math)
    config = ds_config(workload, stage, bf16_weights)
    result.extra.update(ds_config=config, checkpoint="per block")

    def body():
        single_process_env()
        if not (dist.is_available() and dist.is_initialized()):
            deepspeed.init_distributed(dist_backend="nccl")
        model = workload.fresh_model("cpu")  # DeepSpeed places (and at stage 3 partitions) it
        checkpoint_blocks(model)
        started = time.perf_counter()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                              if p.requires_grad], config=config)
        # the first DeepSpeed process of a machine also JIT-builds CPU Adam here: the row says how long
        result.extra["init_s"] = time.perf_counter() - started
        log.info("%s: deepspeed.initialize took %.1f s", system, result.extra["init_s"])
        if is_cuda(device):
            result.extra["init_peak_allocated"] = int(torch.cuda.max_memory_allocated(device))
        time_engine_steps(result, engine, workload, device, steps, warmup, deadline)

    result = guarded(result, device, body, limit_s)
    if result.status == OK:
        result.bytes_h2d, result.bytes_d2h = estimated_bytes(workload, stage, bf16_weights)
        result.extra["bytes_estimated"] = True
    return result


def run_zero2(workload: Workload, device, steps: int, **kw) -> PeerResult:
    """ZeRO-Offload with eager's math: fp32 weights on the GPU, forward under DeepSpeed's bf16 autocast."""
    return run_config("deepspeed_zero2", workload, device, steps, stage=2, bf16_weights=False, **kw)


def run_zero2_bf16(workload: Workload, device, steps: int, **kw) -> PeerResult:
    """ZeRO-Offload with bf16 weights on the GPU (fp32 master weights in the CPU optimizer)."""
    return run_config("deepspeed_zero2_bf16", workload, device, steps, stage=2, bf16_weights=True, **kw)


def run_zero3(workload: Workload, device, steps: int, **kw) -> PeerResult:
    """ZeRO-Infinity's CPU tier: bf16 weights and the optimizer in CPU memory, fetched layer by layer."""
    return run_config("deepspeed_zero3", workload, device, steps, stage=3, bf16_weights=True, **kw)
