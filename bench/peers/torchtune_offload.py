"""torchtune's activation offloading (training.OffloadActivations) with per-block checkpointing, as its
recipes pair them (enable_activation_checkpointing + enable_activation_offloading).

As in torchtune's ``get_act_offloading_ctx_manager``: one OffloadActivations (pinned memory, a side
stream) around the model's forward for every step, and a NoOpManager around the output head (its
activation would come straight back). The loss is computed outside, as in the recipes. Eager's math.

torchtune 0.6.1 imports names that torchao dropped after 0.15, so on the GPU machine it runs from a
site directory of its own (``--site torchtune=/tmp/site_tt``, see bench/README.md).
"""

from __future__ import annotations

from torch import nn

from . import eager
from .checkpoint import checkpoint_blocks
from .common import EAGER_MATH, PeerResult, Workload, unavailable
from .offload import ByteCounter


def output_head(model: nn.Module) -> nn.Module | None:
    """The projection to the vocabulary: Hugging Face's output embeddings, else ``head`` / ``lm_head`` / ``output``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    for name in ("head", "lm_head", "output"):
        if head is None and isinstance(getattr(model, name, None), nn.Module):
            head = getattr(model, name)
    return head


def offload_activations(model: nn.Module, ctx, noop, counter: ByteCounter) -> None:
    """Enter ``ctx`` (an OffloadActivations) for the model's forward, ``noop`` for the output head's, and
    count the bytes the offloaded activations move each way (those torchtune tracks as moved)."""
    pack, unpack = ctx.pack_hook, ctx.unpack_hook

    def counting_pack(tensor):
        tensor_id = pack(tensor)
        if ctx.tracker.get(tensor_id, (None, False))[1]:
            counter.d2h += tensor.numel() * tensor.element_size()
        return tensor_id

    def counting_unpack(tensor_id):
        moved = ctx.tracker.get(tensor_id, (None, False))[1]
        tensor = unpack(tensor_id)
        if moved:
            counter.h2d += tensor.numel() * tensor.element_size()
        return tensor

    ctx.pack_hook, ctx.unpack_hook = counting_pack, counting_unpack

    def enter(*_):
        counter.reset()  # per step: the last step's counts are reported
        ctx.__enter__()

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(lambda *_: ctx.__exit__(None, None, None), always_call=True)
    head = output_head(model)
    if head is not None:
        head.register_forward_pre_hook(lambda *_: noop.__enter__())
        head.register_forward_hook(lambda *_: noop.__exit__(None, None, None), always_call=True)


def run(workload: Workload, device, steps: int, **kw) -> PeerResult:
    system = "torchtune"
    if (missing := unavailable(system, device, "torchtune.training")) is not None:
        missing.math = EAGER_MATH
        return missing
    from torchtune.training import NoOpManager, OffloadActivations  # optional: torchtune's own site directory

    counter = ByteCounter("cuda")

    def prepare(model):
        checkpoint_blocks(model)
        offload_activations(model, OffloadActivations(), NoOpManager(), counter)

    def read_counts(result: PeerResult) -> None:
        result.bytes_h2d, result.bytes_d2h = counter.h2d, counter.d2h

    result = eager.run_with(system, workload, device, steps, prepare=prepare, after_step=read_counts, **kw)
    result.extra["checkpoint"] = "per block"
    return result
