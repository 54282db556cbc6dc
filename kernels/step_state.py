"""Per-step host state of a traced step: the optimizer's scalars and each random vertex's generator state."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ir.taskgraph import TaskGraph, TensorRef, Vertex
from .launch import Resolve, run_vertex
from .ops import draws
from .rng import default_generator


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
        # in eager's draw order: on several devices the program order interleaves them, eager's loop draws
        # device 0's micro-batch, then device 1's (trace/data_parallel.py keeps each one's order)
        # only the vertices that draw: an attention op without dropout leaves the generator as it was, and a
        # CUDA graph may hold it (memgraph/segments.py), where no state could be set per launch
        random = [v for v in taskgraph.vertices if v.random and v.recompute_of < 0]
        self.vertices = sorted((v for v in random if draws(v)), key=lambda v: (v.device, v.id))
        # random by their schema, drawing nothing: they run with no state set
        self.draws_nothing = frozenset(v.id for v in random if not draws(v))
        self._scratch: dict[tuple, torch.Tensor] = {}
        self._advances: list[int] | None = None  # CUDA: offset advance of each random vertex

    def checkpoint(self) -> torch.Tensor | None:
        """The device generator's state before a step draws (None when the graph draws nothing): what
        ``restore`` puts back if the step stops."""
        return default_generator(self.device).get_state() if self.vertices else None

    def restore(self, state: torch.Tensor | None) -> None:
        """Put the device generator back to a ``checkpoint`` (a random vertex of the stopped step still
        running puts it back to its own saved state when it ends: kernels/rng.py, replay)."""
        if state is not None:
            default_generator(self.device).set_state(state)

    def _tensor(self, value_id: int) -> torch.Tensor:
        val = self.taskgraph.values[value_id]
        key = (tuple(val.shape), tuple(val.stride), val.dtype)  # shared: the capture runs one op at a time
        if key not in self._scratch:
            self._scratch[key] = torch.empty_strided(val.shape, val.stride, dtype=val.dtype,
                                                     device=self.device).zero_()
        return self._scratch[key]

    def _draw(self, vertex) -> None:
        def resolve(ref: TensorRef) -> torch.Tensor:
            return self._tensor(ref.value).as_strided(ref.size, ref.stride, ref.storage_offset)

        outputs = [self._tensor(v) if v >= 0 else None for v in vertex.outputs]
        run_vertex(vertex, resolve, outputs, scalars={}, rng_state=None, device=self.device)

    def measure(self) -> None:
        """CUDA: measure each random vertex's generator advance now, on scratch tensors freed before
        returning, and put the generator back where it was. The engine calls it before allocating
        its arena: measured during the first step instead, the scratch outputs (two of the largest
        random op's outputs, 2 x 256 MiB for a 32K-token prefill's attention) came on top of the
        arena and took the step's peak past its budget. The caching allocator's segments that held
        them are given back too: kept, they stayed reserved beside the arena for good (gpt1.3b on
        two H200s: 0.35 GiB on the first GPU, whose generator draws, the attention ops' scratch
        and cuDNN workspace; the reserved peak past the budget by as much)."""
        if self.device.type != "cuda" or not self.vertices or self._advances is not None:
            return
        gen = default_generator(self.device)
        start = gen.get_state()
        try:
            self.capture()
        finally:
            gen.set_state(start)
            torch.cuda.synchronize(self.device)
            with torch.cuda.device(self.device):
                torch.cuda.empty_cache()

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


class StepContext:
    """Per-step host state: the optimizer's scalars and the random vertices' generator states."""

    def __init__(self, taskgraph: TaskGraph, step: int, device: torch.device | str, rng: RngReplay | None = None):
        self.taskgraph = taskgraph
        self.step = step
        self.device = torch.device(device)
        self.scalars = taskgraph.optimizer.scalars(step) if taskgraph.optimizer is not None else {}
        rng = rng if rng is not None else RngReplay(taskgraph, self.device)
        self.rng_states = rng.capture()
        self._draws_nothing = rng.draws_nothing

    def rng_state(self, vertex: Vertex) -> torch.Tensor | None:
        if not vertex.random:
            return None
        source = vertex.recompute_of if vertex.recompute_of >= 0 else vertex.id
        if source in self._draws_nothing:  # random by its schema only (kernels/ops.py draws)
            return None
        return self.rng_states[source]

    def run(self, vertex: Vertex, resolve: Resolve, outputs: Sequence[torch.Tensor | None]) -> None:
        run_vertex(vertex, resolve, outputs, self.scalars, self.rng_state(vertex), self.device)
