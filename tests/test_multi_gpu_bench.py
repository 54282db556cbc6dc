"""python -m turnip.bench multi_gpu (and suite --devices N) on the CPU's virtual devices: the rows it writes."""

from __future__ import annotations

import json
import os

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
        # one loop over both devices: every vertex of either is a unit it launched (no segments on the CPU)
        assert row["loop_launches"] == row["vertices"] and 0 < row["loop_busy_s"] <= row["step_s_median"]
        assert row["sim_host_per_launch_us"] > 0 and row["sim_host_busy_s"] > 0
    assert rows[("turnip", 0.8)]["arena_bytes"] < rows[("turnip", 1.0)]["arena_bytes"]


def test_isolated_budgets_each_run_in_a_process_of_their_own_into_one_file(tmp_path):
    """--isolate: the first budget's process measures eager, the next is given its peak; one JSON holds
    every row; a budget whose process is killed at --row-limit is a timeout row, not a lost run."""
    from turnip.bench import multi_gpu

    out = tmp_path / "x2.json"
    multi_gpu.main(["--devices", "2", "--tiny", "--device", "cpu", "--budgets", "1.0,0.8", "--steps", "1",
                    "--warmup", "0", "--isolate", "--no-plots", "--out", str(out)])
    doc = json.loads(out.read_text())
    rows = {(r["system"], r.get("budget")): r for r in doc["rows"]}
    assert [r["system"] for r in doc["rows"]].count("eager") == 1 and rows[("eager", None)]["status"] == "ok"
    assert doc["eager_peak"] is None or doc["eager_peak"] == rows[("eager", None)]["peak_reserved"]
    assert all(rows[("turnip", b)]["status"] == "ok" and rows[("turnip", b)]["devices"] == 2 for b in (1.0, 0.8))
    assert doc["info"]["parameters"] > 0

    slow = tmp_path / "slow.json"
    multi_gpu.main(["--devices", "2", "--tiny", "--device", "cpu", "--budgets", "1.0", "--isolate", "--row-limit",
                    "0.5", "--no-plots", "--out", str(slow)])
    (row,) = json.loads(slow.read_text())["rows"]
    assert (row["system"], row["status"], row["budget"]) == ("turnip", "timeout", 1.0)
    assert row["error"] == "killed after 0s without a result"


def test_host_update_rows_run_the_updates_on_the_hosts_cores(tmp_path):
    """--host-update all: compile's host_update with the workload's optimizer fused; the row says how
    many updates the host ran."""
    from turnip.bench import multi_gpu

    out = tmp_path / "host.json"
    multi_gpu.main(["--devices", "2", "--tiny", "--device", "cpu", "--budgets", "0.5", "--steps", "1", "--warmup", "0",
                    "--no-eager", "--host-update", "all", "--no-plots", "--out", str(out)])
    row = next(r for r in json.loads(out.read_text())["rows"] if r["system"] == "turnip")
    assert row["status"] == "ok" and row["host_update"] == "all" and row["host_updates"] > 0


def test_ranks_rows_run_turnip_over_ranks_under_torchrun_beside_one_process(tmp_path):
    """--ranks: each budget again as turnip-ranks, a torchrun of one process per device (gloo on the CPU),
    whose row says how many messages a rank sends and receives."""
    from turnip.bench import multi_gpu

    out = tmp_path / "ranks.json"
    multi_gpu.main(["--devices", "2", "--tiny", "--device", "cpu", "--budgets", "1.0", "--steps", "1", "--warmup", "0",
                    "--no-eager", "--ranks", "--planner", "greedy", "--no-plots", "--out", str(out)])
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["turnip"]["status"] == "ok"
    ranks = rows["turnip-ranks"]
    assert ranks["status"] == "ok", ranks.get("error")
    assert (ranks["devices"], ranks["budget"]) == (2, 1.0) and ranks["messages"] > 0 and ranks["step_s_median"] > 0


def test_ranks_of_two_devices_each_run_under_torchrun(tmp_path):
    """--gpus-per-rank 2 on 4 devices: two ranks of two devices each (gloo on the CPU), the stand-in for two
    hosts; the row counts the step's devices, its ranks and each rank's devices, and --timelines gives each
    rank's timeline."""
    from turnip.bench import multi_gpu

    out = tmp_path / "ranks2x2.json"
    multi_gpu.main(["--devices", "4", "--tiny", "--device", "cpu", "--budgets", "1.0", "--steps", "1", "--warmup", "0",
                    "--no-eager", "--ranks", "--gpus-per-rank", "2", "--planner", "greedy", "--no-plots", "--timelines",
                    "--out", str(out)])
    ranks = next(r for r in json.loads(out.read_text())["rows"] if r["system"] == "turnip-ranks")
    assert ranks["status"] == "ok", ranks.get("error")
    assert (ranks["devices"], ranks["ranks"], ranks["gpus_per_rank"]) == (4, 2, 2)
    assert ranks["messages"] > 0 and ranks["step_s_median"] > 0
    for rank in (0, 1):  # each rank's timeline of one more step, its messages on their own lane
        events = json.loads((tmp_path / f"ranks2x2_ranks_1.timeline.rank{rank}.json").read_text())
        names = {e.get("name", "") for e in (events["traceEvents"] if isinstance(events, dict) else events)}
        assert any("turnip::send" in n for n in names) and any("turnip::recv" in n for n in names), rank


def test_rows_are_saved_as_they_are_measured_so_a_run_cut_short_keeps_them(tmp_path):
    """The file is rewritten after every row: a later failure (here an unknown peer, refused once the
    turnip row is measured) leaves the rows before it on disk."""
    import pytest
    from turnip.bench import multi_gpu

    out = tmp_path / "cut.json"
    with pytest.raises(ValueError, match="no-such-peer"):
        multi_gpu.main(["--devices", "2", "--tiny", "--device", "cpu", "--budgets", "1.0", "--steps", "1",
                        "--warmup", "0", "--no-eager", "--no-plots", "--peers", "no-such-peer", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["system"], row["status"], row["budget"]) == ("turnip", "ok", 1.0)
    for probe in (row["host_before"], row["host_after"]):  # how fast and busy the host was around the steps
        assert probe["python_us"] > 0 and probe["loadavg_1m"] >= 0 and probe["cpus"] >= 1


def test_loop_profile_names_where_the_loop_spends_its_time(tmp_path):
    """python -m turnip.bench.loop_profile: the loop's own facts per step, unprofiled and profiled, and
    the functions that took the host's time, the loop's among them."""
    from turnip.bench import loop_profile

    out = tmp_path / "loop.json"
    assert loop_profile.main(["--tiny", "--device", "cpu", "--devices", "2", "--budget", "0.5", "--steps", "1",
                              "--warmup", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    (plain,), (profiled,) = doc["unprofiled"], doc["profiled"]
    assert (plain["step"], profiled["step"]) == (2, 3) and plain["loss"] > 0  # after one warmup step
    assert doc["host_before"]["python_us"] > 0 and doc["host_after"]["python_us"] > 0
    assert doc["devices"] == 2 and plain["launches"] == profiled["launches"] > 0
    assert 0 < plain["busy_s"] <= plain["step_s"] and doc["busy_us_per_launch"] == plain["busy_us_per_launch"]
    assert any("loop.py" in row["function"] for row in doc["own_time"])
    assert doc["total_time"][0]["total_s"] >= max(row["own_s"] for row in doc["own_time"])


def test_host_probe_times_a_fixed_workload_and_reads_the_hosts_load():
    """bench/host_probe.py: a fixed workload's best time grows with the work; the load figures are the
    host's (a row records them before and after its steps)."""
    from turnip.bench import host_probe

    probe = host_probe.host_probe()
    assert probe["python_us"] > 0 and probe["cpus"] >= 1 and probe["loadavg_1m"] >= 0
    assert probe["runnable"] is None or probe["runnable"] >= 1  # this thread runs
    small = host_probe.python_us()
    host_probe.WORKLOAD_ITEMS *= 8
    try:
        assert host_probe.python_us() > 2 * small
    finally:
        host_probe.WORKLOAD_ITEMS //= 8


def test_host_probe_runs_the_workload_on_each_allowed_cpu_and_puts_the_affinity_back(tmp_path):
    """`python -m turnip.bench.host_probe --by-cpu`: one row per CPU the process may use, each run pinned
    there, the affinity as before afterwards; the host's CPU time so far, whose steal share two probes
    give, only grows."""
    from turnip.bench import host_probe

    allowed = os.sched_getaffinity(0)
    first = host_probe.host_probe()["jiffies"]
    assert host_probe.main(["--by-cpu", "--out", str(tmp_path / "probe.json")]) == 0
    doc = json.loads((tmp_path / "probe.json").read_text())
    assert sorted(row["cpu"] for row in doc["by_cpu"]) == sorted(allowed)
    assert all(row["python_us"] > 0 for row in doc["by_cpu"])
    assert os.sched_getaffinity(0) == allowed
    assert doc["probe"]["cpu_now"] in allowed
    later = doc["probe"]["jiffies"]
    assert all(later[k] >= first[k] for k in ("busy", "idle", "steal")) and later["busy"] + later["idle"] > 0
