"""The offloading peers' configurations, checked without their packages or a GPU: DeepSpeed's config
says eager's math where the row claims it, and torchtune's offloading wraps the model's forward but
not its output head (with a stand-in for OffloadActivations)."""

from __future__ import annotations

import pytest
import torch
from turnip.bench.models.sizes import make_workload
from turnip.bench.peers import eager, torchtune_offload, zero_offload
from turnip.bench.peers.offload import ByteCounter


@pytest.fixture(scope="module")
def gpt():
    return make_workload("gpt350m", tiny=True)


def test_deepspeed_configs(gpt):
    eager_math = zero_offload.ds_config(gpt, stage=2, bf16_weights=False)
    # DeepSpeed turns the loss's autocast off: eager's math needs its own autocast and no "bf16" section
    assert eager_math["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and "bf16" not in eager_math
    assert eager_math["gradient_clipping"] == 0.0  # DeepSpeed clips at 1.0 by default
    # torch's AdamW defaults spelled out: DeepSpeed's CPU Adam has other ones (weight decay 0)
    assert eager_math["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                                   "weight_decay": 0.01}}
    assert eager_math["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert eager_math["train_micro_batch_size_per_gpu"] == gpt.batch[0].shape[0]
    bf16 = zero_offload.ds_config(gpt, stage=2, bf16_weights=True)
    assert bf16["bf16"] == {"enabled": True} and "torch_autocast" not in bf16
    zero3 = zero_offload.ds_config(gpt, stage=3, bf16_weights=True)["zero_optimization"]
    assert zero3["offload_param"] == zero3["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    sgd = make_workload("gpt350m", tiny=True)
    sgd.optimizer.cls = torch.optim.SGD
    with pytest.raises(ValueError, match="Adam"):
        zero_offload.ds_config(sgd, stage=2, bf16_weights=False)


class StandIn(torch.autograd.graph.saved_tensors_hooks):
    """OffloadActivations' interface as the wiring uses it: hooks, and a tracker of id -> (tensor, moved)."""

    def __init__(self, moved: bool):
        self.tracker, self.packed = {}, 0

        def pack(tensor):
            self.packed += 1
            self.tracker[self.packed] = (tensor, moved)
            return self.packed

        def unpack(tensor_id):
            return self.tracker.pop(tensor_id)[0]

        super().__init__(pack, unpack)


def test_torchtune_offloading_wraps_the_forward_but_not_the_head(gpt):
    assert torchtune_offload.output_head(gpt.model) is gpt.model.head
    ctx, noop, counter = StandIn(moved=True), StandIn(moved=False), ByteCounter("cpu")

    def prepare(model):
        torchtune_offload.offload_activations(model, ctx, noop, counter)

    res = eager.run_with("torchtune-like", gpt, "cpu", 1, prepare=prepare)
    want = eager.run(gpt, "cpu", 1)
    assert res.status == "ok" and res.losses == want.losses
    assert ctx.packed > 0 and noop.packed > 0  # the blocks' activations went to ctx, the head's to the no-op
    assert not ctx.tracker and not noop.tracker  # every saved tensor came back in the backward
    assert counter.d2h == counter.h2d > 0  # moved bytes counted each way
    assert not gpt.model._forward_pre_hooks  # the hooks went on the peer's copy, not the canonical model
