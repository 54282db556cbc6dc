"""Library checks answered as eager answers them, for values that do not depend on the batch.

Libraries branch on tensor values, and when they see a fake tensor they take the path that is safe
for any value. Hugging Face transformers' ``find_packed_sequence_indices`` reads the position ids to
tell one sequence per row from several packed ones; under ``make_fx``'s fake tensors it cannot, so
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
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, get_proxy_slot

log = logging.getLogger(__name__)

# (module, function) whose answer depends only on its tensor argument's values
CHECKS = (("transformers.masking_utils", "find_packed_sequence_indices"),)


def constant_value(tensor: torch.Tensor) -> torch.Tensor | None:
    """The real value of a traced tensor computed from constants alone (no input of the trace among
    its ancestors), recomputed from the recorded ops; None when it depends on an input."""
    mode = get_proxy_mode()
    if mode is None:
        return None
    slot = get_proxy_slot(tensor, mode.tracer, None)
    if slot is None:
        return None
    target = slot.proxy.node
    needed, stack = set(), [target]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        if node.op == "placeholder":
            return None
        needed.add(node)
        stack.extend(node.all_input_nodes)
    env: dict = {}
    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        for node in target.graph.nodes:  # graph order is a topological order
            if node not in needed:
                continue
            if node.op == "call_function":
                args = torch.fx.node.map_arg(node.args, env.__getitem__)
                kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
                env[node] = node.target(*args, **kwargs)
            elif node.op == "get_attr":
                env[node] = getattr(mode.tracer.root, node.target)
            else:
                return None
    value = env[target]
    return value if isinstance(value, torch.Tensor) else None


def _answer_like_eager(check):
    def answered(tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor):
            real = constant_value(tensor)
            if real is not None:
                with unset_fake_temporarily(), disable_proxy_modes_tracing():
                    answer = check(real, *args, **kwargs)
                if answer is None:
                    return None
        return check(tensor, *args, **kwargs)

    return answered


@contextlib.contextmanager
def eager_answers():
    """Within the block, CHECKS of already imported libraries answer as eager for constant arguments."""
    patched = []
    for module_name, name in CHECKS:
        module = sys.modules.get(module_name)
        check = getattr(module, name, None) if module is not None else None
        if check is not None:
            setattr(module, name, _answer_like_eager(check))
            patched.append((module, name, check))
    try:
        yield
    finally:
        for module, name, check in patched:
            setattr(module, name, check)
