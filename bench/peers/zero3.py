"""What the DeepSpeed ZeRO-3 peers share (ZeRO-Inference for prefill, ZeRO-Infinity's CPU tier for LoRA):
a one-process job without the launcher, and the model partitioned into pinned host memory before
``deepspeed.initialize`` sees it.

Why partition first: ``deepspeed.initialize`` on a model that is not yet partitioned moves the whole
model to the GPU and only then partitions it (DeepSpeed 0.19.8, engine._configure_distributed_model),
so a 7B model would set the row's peak at 13.5-27 GB before the first step. ``zero.Init(module=...)``
is DeepSpeed's own way to partition an already-built model: one parameter at a time through the GPU
into its CPU partition, which is what a user gets from loading under ``zero.Init`` (Hugging Face's
ZeRO-3 integration does that). deepspeed is imported by the callers (it is optional).
"""

from __future__ import annotations

from torch import nn

from .zero_offload import single_process_env


def start_single_process() -> None:
    """torch.distributed for one process on this machine, as DeepSpeed's launcher would set it up."""
    import deepspeed
    import torch.distributed as dist

    single_process_env()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl")


def partition_to_host(model: nn.Module, config: dict, device) -> int:
    """Partition ``model``'s parameters into the host memory ``config``'s offload_param names (pinned CPU)
    and move its buffers to ``device`` (what initialize does to a model it places itself; partitioned
    models it leaves alone). Returns the bytes of the partitions now held in pinned host memory."""
    import deepspeed

    deepspeed.zero.Init(module=model, config_dict_or_path=config)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    partitions = [p.ds_tensor for p in model.parameters() if getattr(p, "ds_tensor", None) is not None]
    return sum(t.numel() * t.element_size() for t in partitions if t.device.type == "cpu" and t.is_pinned())


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of every parameter as stored (a partitioned one by its full size, ``ds_numel``): what ZeRO-3
    fetches from the host for one forward."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())
