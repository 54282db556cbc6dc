"""bench/engine_overhead.py on the CPU: its graph makes one segment per chain when segments are on,
computes what its eager loop computes, and the benchmark says it needs CUDA where there is none."""

from __future__ import annotations

import pytest
import torch
from turnip.bench import engine_overhead
from turnip.ir.plan import Plan

from turnip import engine, memgraph


@pytest.mark.parametrize("segments", [True, False])
def test_tiny_chains_is_one_segment_per_chain_and_computes_the_eager_sum(segments):
    chains, length = 3, 5
    tg = engine_overhead.tiny_chains(chains, length, numel=8, device="cpu")
    mg = memgraph.build(tg, Plan(gpu_budget=1 << 34), segment_size=None if segments else 1)
    if segments:  # the last chain's segment also holds the sums of the chain ends and the loss
        assert [len(s) for s in mg.segments] == [length] * (chains - 1) + [length + chains]
    else:
        assert mg.segments == []
    x = torch.randn(8)
    base = x + x
    chain_end = base * length  # base plus length - 1 more additions of base, up to rounding
    torch.testing.assert_close(engine.run(mg, x)["loss"], (chain_end * chains).sum())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a host without CUDA")
def test_benchmark_says_it_needs_cuda():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        engine_overhead.main([])
