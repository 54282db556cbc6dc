"""The A/B benches (bench/prefetch_ab.py, bench/pinned_memory.py, bench/planner_ab.py) need a GPU: without one they stop
with a message naming what they need, before any work; results land where TURNIP_RESULTS says; and the
alternating rounds they share report each round done, so a run cut short keeps what it measured."""

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


def test_the_alternating_rounds_report_each_round_done_with_its_medians_so_far(monkeypatch):
    """run_alternately sets every row's median of the steps so far and calls after_round after each
    round, so a bench cut short by its time limit writes the rounds it ran."""
    from turnip.bench.peers import common

    class Built:
        released = 0

        def release(self, keep=True):
            self.released += 1

    times = iter([0.3, 0.1, 0.2, 0.6, 0.4, 0.5, 0.9, 0.7, 0.8, 1.2, 1.0, 1.1])
    monkeypatch.setattr(common, "device_timed_steps", lambda run, steps, warmup: [next(times) for _ in range(steps)])
    builds = {"A": Built(), "B": Built()}
    rows = {"A": {"steps_s": []}, "B": {"steps_s": []}}
    seen = []
    common.run_alternately(builds, rows, None, rounds=2, steps=3, warmup=1,
                           after_round=lambda done: seen.append((done, rows["A"]["median_s"], rows["B"]["median_s"])))
    assert seen == [(1, 0.2, 0.5), (2, pytest.approx(0.5), pytest.approx(0.8))]
    assert rows["A"]["steps_s"] == [0.3, 0.1, 0.2, 0.9, 0.7, 0.8] and builds["A"].released == 2
