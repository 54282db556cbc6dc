"""Replayable randomness: run an op from a recorded generator state and put the generator back.

The states come from `step.RngReplay`: at step start, `RngReplay.capture` walks the random vertices in program order,
records the device generator's state before each, and advances the generator
exactly as eager PyTorch would by running the op once on scratch tensors. Any
later run of the vertex (in any order, or recomputed) replays from its recorded
state, so masks are the same as eager's and the same on recomputation, and the
generator ends the step where eager would leave it.
"""

from __future__ import annotations

import threading

import torch

_REPLAY_LOCK = threading.Lock()  # the default generator is process-wide state


def default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    if device.type == "cpu":
        return torch.default_generator
    raise ValueError(f"no default generator for device {device}")


def replay(state: torch.Tensor | None, device: torch.device, fn):
    """Run fn() with the device's default generator set to `state`, then put the generator back."""
    if state is None:
        return fn()
    gen = default_generator(device)
    with _REPLAY_LOCK:
        saved = gen.get_state()
        gen.set_state(state)
        try:
            return fn()
        finally:
            gen.set_state(saved)
