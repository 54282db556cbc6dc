"""Replayable randomness: each random vertex gets the generator state eager PyTorch would give it.

At step start, `RngReplay.capture` walks the random vertices in program order,
records the device generator's state before each, and advances the generator
exactly as eager PyTorch would by running the op once on scratch tensors. Any
later run of the vertex (in any order, or recomputed) replays from its recorded
state, so masks are the same as eager's and the same on recomputation, and the
generator ends the step where eager would leave it.
"""

from __future__ import annotations

import threading

import torch
from turnip.memgraph.taskgraph import TaskGraph, TensorRef

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


class RngReplay:
    """Generator states for a graph's random vertices, step after step; reuse one across steps.

    CPU generators (Mersenne Twister) can only be advanced by drawing, so each
    step runs the random ops once on scratch tensors. CUDA generators are
    (seed, offset) counters that an op advances by an amount fixed by its
    shape: the first step measures each vertex's advance, later steps compute
    the states with no kernel launched and no memory touched.
    """

    def __init__(self, taskgraph: TaskGraph, device: torch.device):
        self.taskgraph = taskgraph
        self.device = torch.device(device)
        self.vertices = [v for v in taskgraph.vertices if v.random and v.recompute_of < 0]
        self._scratch: dict[tuple, torch.Tensor] = {}
        self._advances: list[int] | None = None  # CUDA: offset advance of each random vertex

    def _tensor(self, value_id: int) -> torch.Tensor:
        val = self.taskgraph.values[value_id]
        key = (tuple(val.shape), tuple(val.stride), val.dtype)  # shared: the capture runs one op at a time
        if key not in self._scratch:
            self._scratch[key] = torch.empty_strided(val.shape, val.stride, dtype=val.dtype,
                                                     device=self.device).zero_()
        return self._scratch[key]

    def _draw(self, vertex) -> None:
        from turnip.kernels.launch import run_vertex  # launch imports this module

        def resolve(ref: TensorRef) -> torch.Tensor:
            return self._tensor(ref.value).as_strided(ref.size, ref.stride, ref.storage_offset)

        outputs = [self._tensor(v) if v >= 0 else None for v in vertex.outputs]
        run_vertex(vertex, resolve, outputs, scalars={}, rng_state=None, device=self.device)

    def capture(self) -> dict[int, torch.Tensor]:
        """Each random vertex's generator state; leaves the generator where eager's step would."""
        if not self.vertices:
            return {}
        gen = default_generator(self.device)
        if self.device.type == "cuda" and self._advances is not None:
            return self._counted(gen)
        states, advances = {}, []
        for vertex in self.vertices:
            states[vertex.id] = gen.get_state()
            before = gen.get_offset() if self.device.type == "cuda" else 0
            self._draw(vertex)
            advances.append(gen.get_offset() - before if self.device.type == "cuda" else 0)
        if self.device.type == "cuda":
            self._advances = advances
            self._scratch.clear()
        return states

    def _counted(self, gen: torch.Generator) -> dict[int, torch.Tensor]:
        start = gen.get_state()
        offset = gen.get_offset()
        states = {}
        for vertex, advance in zip(self.vertices, self._advances):
            gen.set_offset(offset)
            states[vertex.id] = gen.get_state()
            offset += advance
        gen.set_state(start)
        gen.set_offset(offset)
        return states
