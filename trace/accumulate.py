"""Gradient accumulation traced into one step: k forward+backward passes, then one update.

The step of ``compile(..., accumulation_steps=k)`` is eager's

    opt.zero_grad()
    for b in micro_batches:
        loss_fn(model, b).backward()
    opt.step()

traced as it runs: every micro-batch's backward goes through autograd's own AccumulateGrad on
the traced parameters, so the first backward stores each gradient and every later one adds its
gradient in place (``grad += new``) at the moment eager does, in eager's order. A micro-batch's
gradients die as soon as they are added and its activations as soon as its backward has read
them: the planner sees one graph holding one micro-batch's activations at a time.

The step's outputs: "losses", the k losses (a tensor of shape (k,)), and "loss", their sum
l1 + l2 + ... + lk added in order: the loss whose gradient the update applies (with the usual
``loss / k`` inside loss_fn, the mean loss over the k micro-batches).
"""

from __future__ import annotations

import torch

from .errors import UnsupportedFeature


def check_steps(accumulation_steps) -> int:
    """The number of micro-batches a step accumulates over, checked: a positive int."""
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise UnsupportedFeature(f"accumulation_steps must be a positive int (the number of micro-batches each "
                                 f"engine.run accumulates gradients over), got {accumulation_steps!r}")
    return accumulation_steps


def micro_prefix(micro: int, steps: int) -> str:
    """The path of micro-batch `micro` in the list engine.run takes ("" without accumulation)."""
    return f"[{micro}]" if steps > 1 else ""


def split(leaves: list, steps: int) -> list[list]:
    """The step's batch inputs (micro-batch after micro-batch) cut into one list per micro-batch."""
    per = len(leaves) // steps
    return [list(leaves[m * per:(m + 1) * per]) for m in range(steps)]


def accumulate(micro_loss, train: list[torch.Tensor], micro_batches: list) -> tuple[list, tuple]:
    """Eager's accumulation loop on the traced parameters `train` (fresh leaves, .grad None):
    micro_loss(inputs) is one micro-batch's forward and loss; its backward accumulates into
    .grad. Returns (the losses, the accumulated gradients in the order of train, None where a
    parameter got no gradient, as eager leaves its .grad None)."""
    losses = []
    for inputs in micro_batches:
        loss = micro_loss(inputs)
        if train:
            loss.backward()
        losses.append(loss.detach())
    return losses, tuple(p.grad for p in train)


def loss_outputs(losses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(their sum, added in order as a loop `total = total + loss` does; the losses stacked)."""
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total, torch.stack(losses)
