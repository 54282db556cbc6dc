"""The systems the benchmark compares turnip with, each ``run(workload, device, steps, **kw) -> PeerResult``.

eager                  plain PyTorch: the reference (no memory knob)
eager_fused            the same with the optimizer's fused kernel (AdamW(fused=True)): eager's fastest
checkpoint             torch.utils.checkpoint around every transformer block (use_reentrant=False)
offload                torch.autograd.graph.save_on_cpu(pin_memory=True) around the forward
checkpoint_offload     both: one activation per block, kept on the CPU
deepspeed_zero2        DeepSpeed ZeRO-Offload: stage 2, optimizer on the CPU, eager's math   } zero_offload.py
deepspeed_zero2_bf16   the same with bf16 weights (trades precision)                         }
deepspeed_zero3        ZeRO-Infinity's CPU tier: stage 3, parameters + optimizer on the CPU  }
deepspeed_zero3_infinity  the same with eager's math, partitioned before initialize          zero_infinity.py
torchao                torchao.optim.CPUOffloadOptimizer (fused AdamW on the CPU)             } torchao_offload.py
torchao_offload_grads  the same with offload_gradients=True and per-block checkpointing      }
torchtune              torchtune OffloadActivations + per-block checkpointing                  torchtune_offload.py

The last seven need CUDA ("skipped" otherwise) and their package ("not installed" otherwise); every
DeepSpeed row uses per-block checkpointing too. ``isolated`` runs any of them (and turnip) in a
process of its own.
"""

from . import (
    checkpoint,
    eager,
    offload,
    torchao_offload,
    torchtune_offload,
    zero_infinity,
    zero_offload,
)

PEERS = {
    "eager": eager.run,
    "eager_fused": eager.run_fused,
    "checkpoint": checkpoint.run,
    "offload": offload.run,
    "checkpoint_offload": offload.run_checkpoint_offload,
    "deepspeed_zero2": zero_offload.run_zero2,
    "deepspeed_zero2_bf16": zero_offload.run_zero2_bf16,
    "deepspeed_zero3": zero_offload.run_zero3,
    "deepspeed_zero3_infinity": zero_infinity.run,
    "torchao": torchao_offload.run,
    "torchao_offload_grads": torchao_offload.run_offload_gradients,
    "torchtune": torchtune_offload.run,
}
TORCH_PEERS = ("eager", "eager_fused", "checkpoint", "offload", "checkpoint_offload")  # torch only: run anywhere
CUDA_PEERS = tuple(name for name in PEERS if name not in TORCH_PEERS)  # a package of their own, and CUDA

__all__ = ["CUDA_PEERS", "PEERS", "TORCH_PEERS"]
