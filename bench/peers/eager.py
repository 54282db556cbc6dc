"""Eager PyTorch: the reference every other system is compared with (no memory knob)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from .common import EAGER_MATH, PeerResult, Workload, guarded, timed_steps, trainable


def training_step(model, loss_fn, batch, optimizer, forward_context: Callable = contextlib.nullcontext):
    """zero_grad, forward (inside ``forward_context``: where saved-tensor hooks go), backward, step."""
    optimizer.zero_grad(set_to_none=True)
    with forward_context():
        loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    return loss


def run_with(system: str, workload: Workload, device, steps: int, prepare: Callable | None = None,
             forward_context: Callable = contextlib.nullcontext, warmup: int = 1, deadline: float | None = None,
             limit_s: float | None = None, after_step: Callable | None = None,
             make_optimizer: Callable | None = None, math: str = EAGER_MATH) -> PeerResult:
    """The loop all torch-level peers share: copy the model, ``prepare(model)``, time the steps.

    ``after_step(result)`` runs once after the timed steps (e.g. to read byte counters);
    ``make_optimizer(params)`` replaces the workload's optimizer (same class and options, other home).
    """
    result = PeerResult(system, math=math)

    def body():
        model = workload.fresh_model(device)
        if prepare is not None:
            prepare(model)
        optimizer = (make_optimizer or workload.optimizer)(trainable(model))
        batch = workload.batch_on(device)
        timed_steps(result, lambda: training_step(model, workload.loss_fn, batch, optimizer, forward_context),
                    steps, device, warmup=warmup, deadline=deadline)
        if after_step is not None:
            after_step(result)

    return guarded(result, device, body, limit_s)


def run(workload: Workload, device, steps: int, system: str = "eager", **kw) -> PeerResult:
    result = run_with(system, workload, device, steps, **kw)
    if result.status == "ok":
        result.bytes_h2d = result.bytes_d2h = 0
    return result


def run_fused(workload: Workload, device, steps: int, **kw) -> PeerResult:
    """Eager with the optimizer's fused kernel (``fused=True``, e.g. AdamW's): the fastest eager step
    a user can pick, the numbers of the same update rounded as that kernel rounds them."""
    spec = workload.optimizer
    return run(workload, device, steps, "eager_fused",
               make_optimizer=lambda params: spec(params, fused=True), **kw)
