"""bench/engine_variants.py on the CPU: one MemGraph per budget, every setting run in every round."""

from __future__ import annotations

import json
import math

from turnip.bench import engine_variants


def test_every_setting_runs_in_every_round(tmp_path, capsys):
    rc = engine_variants.main(["--tiny", "--budgets", "0.5", "--transfer-ahead", "0,2", "--orderings",
                               "nondeterministic,deterministic", "--rounds", "2", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "engine_variants_gpt350m-tiny.json").read_text())
    part = doc["budgets"]["0.5"]
    rows = part["settings"]
    assert [(r["ordering"], r["transfer_ahead"]) for r in rows] == [
        ("nondeterministic", 0), ("nondeterministic", 2), ("deterministic", 0), ("deterministic", 2)]
    assert part["bytes_reloaded"] > 0  # half the unplanned peak: something moves
    for row in rows:
        assert len(row["step_s"]) == 2 and row["min_s"] <= row["median_s"] <= row["max_s"]
        assert row["sim_step_s"] > 0
    # each run is one more training step of the one MemGraph: 2 rounds x 4 settings, all finite, all different
    losses = [x for row in rows for x in row["losses"]]
    assert len(set(losses)) == 8 and all(math.isfinite(x) for x in losses)
    assert "transfer_ahead=2" in capsys.readouterr().out
