"""The A/B benches (bench/prefetch_ab.py, bench/pinned_memory.py, bench/planner_ab.py) need a GPU: without one they stop
with a message naming what they need, before any work; and results land where TURNIP_RESULTS says."""

import json

import pytest
import torch
from turnip.bench import pinned_memory, planner_ab, prefetch_ab
from turnip.bench.results import write_result


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("bench", [prefetch_ab, pinned_memory, planner_ab])
def test_without_cuda_the_ab_benches_stop_with_a_message(bench):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main([])


def test_write_result_writes_json_under_turnip_results(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNIP_RESULTS", str(tmp_path))
    path = write_result("x.json", {"rows": [1, 2]})
    assert path == tmp_path / "x.json" and json.loads(path.read_text()) == {"rows": [1, 2]}
