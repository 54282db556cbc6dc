"""The systems the benchmark compares turnip with, each ``run(workload, device, steps, **kw) -> PeerResult``.

eager                plain PyTorch: the reference (no memory knob)
checkpoint           torch.utils.checkpoint around every transformer block (use_reentrant=False)
offload              torch.autograd.graph.save_on_cpu(pin_memory=True) around the forward
checkpoint_offload   both: one activation per block, kept on the CPU
deepspeed            DeepSpeed ZeRO-Offload (stage 2, optimizer on the CPU)      } only where the
torchao              torchao.optim.CPUOffloadOptimizer                           } package imports;
torchtune            torchtune OffloadActivations + per-block checkpointing      } else "not installed"
"""

from turnip.bench.peers import checkpoint, eager, offload, optional

PEERS = {
    "eager": eager.run,
    "checkpoint": checkpoint.run,
    "offload": offload.run,
    "checkpoint_offload": offload.run_checkpoint_offload,
    "deepspeed": optional.run_deepspeed,
    "torchao": optional.run_torchao,
    "torchtune": optional.run_torchtune,
}

__all__ = ["PEERS"]
