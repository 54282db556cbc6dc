"""Reference executor: a TaskGraph op by op in program order, with ordinary torch allocation.

The oracle for every later stage: same kernels, same order as eager PyTorch.
"""

from __future__ import annotations

import torch

from ..ir.batch import check_batch
from ..ir.taskgraph import TaskGraph, TensorRef
from ..kernels.launch import run_vertex
from ..kernels.step_state import RngReplay, StepContext
from ..kernels.views import ref_view


class ReferenceExecutor:
    """Runs steps of a TaskGraph, keeping parameters and optimizer states between steps."""

    def __init__(self, taskgraph: TaskGraph, device: str | torch.device | None = None):
        self.tg = taskgraph
        self.device = torch.device(device or taskgraph.device)
        self.state = {vid: t.detach().to(self.device, copy=True) for vid, t in taskgraph.initial_state.items()}
        self.step = taskgraph.optimizer.initial_step if taskgraph.optimizer is not None else 0
        self.rng = RngReplay(taskgraph, self.device)

    def run(self, batch) -> dict[str, torch.Tensor]:
        tg = self.tg
        leaves = check_batch(tg, batch)  # checked and ordered as engine.run does
        self.step += 1
        ctx = StepContext(tg, self.step, self.device, self.rng)
        env: dict[int, torch.Tensor] = dict(self.state)
        for vid, leaf in zip(tg.batch_inputs, leaves):
            env[vid] = leaf.to(self.device)

        def resolve(ref: TensorRef) -> torch.Tensor:
            return ref_view(env[ref.value], ref)

        def allocate(vid: int) -> torch.Tensor:
            val = tg.values[vid]
            return torch.empty_strided(val.shape, val.stride, dtype=val.dtype, device=self.device)

        for vertex in tg.vertices:
            # an in-place op writes every output into its buffer (out= arguments included): give it all of them
            # and so does an op that reads its own output buffer (trace/donate.py METADATA_ONLY)
            own = set(vertex.outputs)
            reads_own = any(ref.value in own for ref in vertex.refs())
            buffers = [allocate(v) if v >= 0 else None for v in vertex.outputs] if vertex.copy_in or reads_own else None
            outs = run_vertex(vertex, resolve, buffers, ctx.scalars, ctx.rng_state(vertex), self.device, allocate)
            for vid, tensor in zip(vertex.outputs, outs):
                if vid >= 0:
                    env[vid] = tensor
        for src, dst in tg.bindings.items():
            self.state[src] = env[dst]
        return {name: env[vid] for name, vid in tg.outputs.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: self.state[vid] for name, vid in self.tg.state_names.items()}
