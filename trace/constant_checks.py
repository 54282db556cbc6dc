"""Library checks answered as eager answers them, for values that do not depend on the batch.

Libraries branch on tensor values, and when they see a fake tensor they take the path that is safe
for any value. Hugging Face transformers' ``find_packed_sequence_indices`` reads the position ids to
tell one sequence per row from several packed ones; under the trace's fake tensors it cannot, so
it returns a mask, and the model then materializes a causal mask per layer and repeats K and V to
every head instead of calling SDPA with ``is_causal`` and ``enable_gqa`` as the eager step does. The
traced step then differs from eager's: other kernels (gradients not bitwise equal on the CPU) and
more memory (1.66 GB more at a TinyLlama-shaped step's peak on an H100).

``eager_answers()`` patches such a check, while tracing, for arguments computed from constants alone
(the default position ids are an ``arange``): the check runs on their real values, recomputed from
the traced ops, and its answer is kept where it needs no tensor of the graph (None: one sequence per
row). Arguments that depend on the batch keep the library's conservative path, so the traced step
stays right for every batch. Nothing is patched when transformers has not been imported.
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils import _pytree as pytree

from ..kernels.ops import flatten_returns
from .recorder import Arg, Recorder

log = logging.getLogger(__name__)

# (module, function) whose answer depends only on its tensor argument's values
CHECKS = (("transformers.masking_utils", "find_packed_sequence_indices"),)


def constant_value(tensor: torch.Tensor, recorder: Recorder) -> torch.Tensor | None:
    """The real value of a traced tensor computed from constants alone (no input of the trace among
    its ancestors), recomputed from the recorded ops; None when it depends on an input or on a
    tensor the recording did not make."""
    target, output = recorder.made(tensor)
    if target < 0:
        return None
    nodes = recorder.nodes
    needed, stack = set(), [target]
    while stack:
        index = stack.pop()
        if index in needed:
            continue
        node = nodes[index]
        if node.kind == "input":
            return None
        needed.add(index)
        for arg in node.arguments():
            if arg.node < 0:
                return None
            stack.append(arg.node)
    env: dict[int, list] = {}

    def real(arg):
        return env[arg.node][arg.output] if isinstance(arg, Arg) else arg

    with unset_fake_temporarily(), recorder.paused():
        for index in sorted(needed):  # recording order is a topological order
            node = nodes[index]
            if node.kind == "constant":
                env[index] = [node.value]
                continue
            args, kwargs = pytree.tree_map(real, (node.args, node.kwargs))
            env[index] = flatten_returns(node.target(*args, **kwargs))
    value = env[target][output]
    return value if isinstance(value, torch.Tensor) else None


def _answer_like_eager(check, recorder: Recorder):
    def answered(tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor):
            real = constant_value(tensor, recorder)
            if real is not None:
                with unset_fake_temporarily(), recorder.paused():
                    answer = check(real, *args, **kwargs)
                if answer is None:
                    return None
        return check(tensor, *args, **kwargs)

    return answered


@contextlib.contextmanager
def eager_answers(recorder: Recorder):
    """Within the block, CHECKS of already imported libraries answer as eager for arguments computed
    from constants alone, recomputed from the ops ``recorder`` recorded."""
    patched = []
    for module_name, name in CHECKS:
        module = sys.modules.get(module_name)
        check = getattr(module, name, None) if module is not None else None
        if check is not None:
            setattr(module, name, _answer_like_eager(check, recorder))
            patched.append((module, name, check))
    try:
        yield
    finally:
        for module, name, check in patched:
            setattr(module, name, check)
