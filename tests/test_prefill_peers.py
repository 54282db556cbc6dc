"""The prefill benchmark's peers on the CPU: ZeRO-Inference's rows say why they did not run (no CUDA, no
deepspeed), its measurement becomes one row per budget judged against it (over budget where its peak
exceeds the budget, its logits compared with eager's), and --time-limit / --tag shape the command."""

from __future__ import annotations

import importlib.util
import json
import time

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from turnip.bench import prefill  # after the skip: the benchmark needs transformers
from turnip.ir.budget import budget_size

GIB = 2**30


def test_zero_inference_is_skipped_on_the_cpu(tmp_path):
    code = prefill.main(["--tiny", "--out", str(tmp_path), "--systems", "zero_inference", "--seqs", "64"])
    rows = json.loads((tmp_path / "prefill-tiny.json").read_text())["rows"]
    assert code == 0 and [(r["budget"], r["status"]) for r in rows] == [("0.6", "skipped"), ("0.4", "skipped")]
    assert all(r["error"] == "DeepSpeed's ZeRO-Inference offloads to a CUDA device" for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the child would run ZeRO-Inference")
def test_its_process_says_why_it_did_not_run():
    """The whole path through its own process: asked for CUDA on a machine without it, the child answers."""
    cfg = prefill.PrefillConfig(seqs=[64], budgets=["16GiB"], tiny=True, device="cuda")
    (row,) = prefill.run_zero_inference(cfg, {64: None}, deadline=None)
    assert (row["system"], row["status"], row["error"]) == ("zero_inference", "skipped", "CUDA is not available")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed here")
def test_without_deepspeed_the_child_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the CUDA check, to the import
    result = prefill.zero_inference_cells({"tiny": True, "seqs": [64], "device": "cuda", "steps": 1, "warmup": 0,
                                           "deadline": time.time() + 60})
    assert result["status"] == "not installed" and "deepspeed" in result["error"]


def test_one_measurement_per_length_becomes_a_row_per_budget_judged_against_it():
    want = torch.tensor([[1.0, 2.0, 3.0]])
    result = {"status": "ok", "deepspeed": "0.19.8", "pinned_bytes": 13 * GIB, "cells": {
        8192: {"status": "ok", "steps_s": [2.0, 1.0, 3.0], "peak_allocated": 10 * GIB,
               "logits": np.array([[1.0, 2.5, 3.0]], dtype=np.float32)},
        16384: {"status": "oom", "error": "CUDA out of memory"}}}
    cells = [(8192, "16GiB"), (8192, "8GiB"), (8192, "0.5"), (16384, "16GiB")]
    rows = prefill.zero_inference_rows(cells, result, {8192: ("eager", want), 16384: None}, process_s=9.0)
    fits, over, fraction, failed = rows
    assert fits["status"] == "ok" and fits["fits_budget"] and fits["budget_bytes"] == 16 * GIB
    assert fits["step_s"] == 2.0 and fits["max_abs_diff_vs_eager"] == 0.5 and fits["pinned_bytes"] == 13 * GIB
    assert over["status"] == "over budget" and not over["fits_budget"] and over["step_s"] == 2.0  # time kept
    assert "10.00 GiB exceeds the budget 8GiB" in over["error"]
    assert fraction["status"] == "ok" and fraction["budget_bytes"] is None  # a fraction has no size to judge by
    assert (failed["status"], failed["error"]) == ("oom", "CUDA out of memory")


def test_budget_size_follows_the_budget_forms():
    assert [budget_size(b) for b in ("16GiB", "8GB", "6000000000", "0.5", "50%", None)] == [
        16 * GIB, 8 * 10**9, 6_000_000_000, None, None, None]


def test_a_malformed_budget_is_refused_before_the_model_is_built(tmp_path, capsys):
    with pytest.raises(SystemExit):
        prefill.main(["--tiny", "--out", str(tmp_path), "--budgets", "16XB"])
    assert "unknown unit 'XB'" in capsys.readouterr().err


def test_time_limit_turns_cells_into_timeout_rows_and_tag_names_the_file(tmp_path):
    code = prefill.main(["--tiny", "--out", str(tmp_path), "--seqs", "64", "--time-limit", "1", "--tag", "t"])
    rows = json.loads((tmp_path / "prefill-tiny_t.json").read_text())["rows"]
    assert code == 1 and len(rows) == 7  # eager, turnip and accelerate x 2 budgets, zero_inference x 2
    assert all(r["status"] in ("timeout", "skipped") for r in rows)
    assert all(r["error"].startswith("not started") for r in rows if r["status"] == "timeout")
