"""python -m turnip.bench multi_gpu (and suite --devices N) on the CPU's virtual devices: the rows it writes."""

from __future__ import annotations

import json

from turnip.bench.__main__ import main as bench_main


def test_suite_with_devices_writes_turnip_rows_beside_eager(tmp_path):
    assert bench_main(["suite", "--devices", "2", "--tiny", "--device", "cpu", "--budgets", "1.0,0.8", "--steps", "1",
                       "--warmup", "1", "--no-plots", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "multi_gpu_x2.json").read_text())
    assert doc["devices"] == 2
    rows = {(r["system"], r.get("budget")): r for r in doc["rows"]}
    assert rows[("eager", None)]["status"] == "ok"
    for budget in (1.0, 0.8):
        row = rows[("turnip", budget)]
        assert row["status"] == "ok" and row["devices"] == 2 and row["step_s_median"] > 0
        assert row["bytes_d2d"] > 0  # the gradients and the refreshed weights cross between the devices
    assert rows[("turnip", 0.8)]["arena_bytes"] < rows[("turnip", 1.0)]["arena_bytes"]
