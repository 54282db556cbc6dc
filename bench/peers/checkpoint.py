"""Activation checkpointing per transformer block (torch.utils.checkpoint, use_reentrant=False).

Each block's ``forward`` is replaced on the instance by a checkpointed call of the
original, so state_dict keys stay the same and any block signature (GPT's
``block(x)``, HF Llama's ``layer(hidden, position_embeddings=..., ...)``) works.
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from . import eager
from .common import PeerResult, Workload


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the longest nn.ModuleList in the model (GPT.blocks, Llama's model.layers)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks to checkpoint")
    return list(max(lists, key=len))


def checkpoint_blocks(model: nn.Module) -> int:
    """Wrap every block of ``model`` in place; returns how many were wrapped."""
    blocks = find_blocks(model)
    for block in blocks:
        original = block.forward

        def checkpointed(*args, _forward=original, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed
    return len(blocks)


def run(workload: Workload, device, steps: int, **kw) -> PeerResult:
    result = eager.run_with("checkpoint", workload, device, steps, prepare=checkpoint_blocks, **kw)
    if result.status == "ok":
        result.bytes_h2d = result.bytes_d2h = 0
    return result
