"""bench/plan_large.py: the LLaMA-65B-shaped LoRA step, built on the meta device, traced and planned on the
CPU; here with one layer of that shape (seconds), the full 80 by hand (see its docstring)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")


def test_one_layer_of_the_65b_shape_traces_and_plans_without_allocating_its_weights(tmp_path, monkeypatch):
    from turnip.bench import plan_large

    monkeypatch.setenv("TURNIP_RESULTS", str(tmp_path))
    assert plan_large.main(["--layers", "1", "--budgets", "0.5", "--out", "large.json"]) == 0
    doc = json.loads((tmp_path / "large.json").read_text())
    assert doc["layers"] == 1 and doc["vertices"] > 100
    # a layer of hidden 8192 in bf16, its activations for 8 x 1024 tokens and the vocab head: GBs planned, none held
    assert doc["unplanned_peak"] > 4 << 30
    (row,) = doc["rows"]
    assert row["budget"] == 0.5 and row["plans"] and all(p["predicted_step_s"] > 0 for p in row["plans"])
    assert set(doc["seconds"]) == {"build_model", "trace", "costs_and_peak"} and row["total_s"] > row["plan_s"] > 0
    assert doc["command"].startswith("python -m turnip.bench.plan_large --layers 1")
