"""Each benchmark system in a process of its own: its row comes back as JSON, and a raise, a crash or a
hang in the child is a row with a status, never a failure of the suite. CPU only, tiny models."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest
import torch
from turnip.bench.models.sizes import make_workload
from turnip.bench.peers import isolated
from turnip.bench.peers.isolated import WorkloadSpec, run_isolated
from turnip.bench.suite import SuiteConfig, run_suite

TINY = WorkloadSpec("gpt350m", tiny=True)

# peers a test can name as "fakepeers:<function>": the child finds the module through its --site
FAKE_PEERS = '''
import os, subprocess, sys, time
from turnip.bench.peers.common import PeerResult


def raises(workload, device, steps, **kw):
    raise RuntimeError("boom outside the peer's guard")


def crashes(workload, device, steps, **kw):
    sys.stdout.write("about to crash\\n")
    sys.stdout.flush()
    os._exit(3)


def hangs(workload, device, steps, **kw):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_PEER_PIDS"], "w") as f:
        f.write(f"{child.pid}")
    time.sleep(600)
'''


@pytest.fixture(scope="module")
def fake_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    (site / "fakepeers.py").write_text(textwrap.dedent(FAKE_PEERS))
    return site


def gone(pid: int) -> bool:
    """The process no longer runs (a zombie waiting for a reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_the_suite_runs_a_peer_in_its_own_process_with_eagers_numbers(tmp_path):
    """checkpoint in a child built from the snapshot: bitwise eager's losses (both 1 thread on the CPU)."""
    cfg = SuiteConfig(models=["gpt350m"], budgets=[1.0], steps=1, warmup=1, systems=["eager", "checkpoint"],
                      tiny=True, device="cpu", out=tmp_path, isolate="peers", plots=False)
    rows = {r["system"]: r for r in run_suite(cfg)}
    child = rows["checkpoint"]
    assert child["status"] == "ok", child.get("error")
    assert child["returncode"] == 0 and child["process_s"] > 0 and "build_s" in child  # it ran in a child
    assert "process_s" not in rows["eager"]  # eager ran in the suite's own process
    assert len(child["losses"]) == 2 and child["losses"] == rows["eager"]["losses"]
    assert child["max_loss_diff"] == 0.0 and child["math"] == "eager"
    doc = json.loads((tmp_path / "suite_gpt350m-tiny.json").read_text())
    assert [r["system"] for r in doc["rows"]] == ["eager", "checkpoint"]


def test_snapshot_round_trip_and_mismatch(tmp_path):
    workload = make_workload("gpt350m", tiny=True)
    path = isolated.write_snapshot(workload, tmp_path / "w.safetensors")
    with isolated.skip_init():
        rebuilt = make_workload("gpt350m", tiny=True)
    assert rebuilt.model.blocks[0].fc.weight.isnan().all()  # skipped initialization marks itself
    isolated.load_snapshot(rebuilt, path)
    for (name, a), (_, b) in zip(isolated.named_tensors(workload.model), isolated.named_tensors(rebuilt.model)):
        assert torch.equal(a, b), name
    assert rebuilt.model.head.weight is rebuilt.model.wte.weight  # still tied
    assert all(torch.equal(a, b) for a, b in zip(workload.batch, rebuilt.batch))
    other = make_workload("gpt350m", tiny=True, batch=2)  # another batch size: refused, not half-loaded
    with pytest.raises(ValueError, match="batch"):
        isolated.load_snapshot(other, path)


@pytest.mark.parametrize("function,status,says", [
    ("raises", "error", "boom outside the peer's guard"),
    ("crashes", "error", "exited with 3"),
])
def test_a_failing_child_is_a_row(fake_site, function, status, says):
    res = run_isolated(f"fakepeers:{function}", TINY, "cpu", 1, limit_s=60, sites={function: [str(fake_site)]},
                       threads=1)
    assert (res.system, res.status) == (function, status)
    assert says in res.error
    assert "log_tail" in res.extra
    if function == "crashes":
        assert "about to crash" in res.extra["log_tail"] and res.extra["returncode"] == 3


def test_a_hanging_child_is_killed_at_its_limit_with_what_it_started(fake_site, tmp_path, monkeypatch):
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_PEER_PIDS", str(pids))
    monkeypatch.setenv(isolated.SITE_ENV + "hangs", str(fake_site))  # the env form of --site
    t0 = time.monotonic()
    res = run_isolated("fakepeers:hangs", TINY, "cpu", 1, limit_s=7, threads=1)
    assert time.monotonic() - t0 < 7 + 5
    assert (res.system, res.status) == ("hangs", "timeout")
    assert "killed after 7s" in res.error
    if pids.exists():  # the child got as far as starting its own process: killed with it
        pid = int(pids.read_text())
        deadline = time.monotonic() + 5
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(pid)


def test_turnip_rows_say_the_plans_mix(tmp_path):
    """A turnip row says what its plan does with the step's tensors (kept / offloaded / recomputed /
    homed on the CPU) and whether its unplanned peak stays within eager's measured one."""
    cfg = SuiteConfig(models=["gpt350m"], budgets=[0.4], steps=1, warmup=1, systems=["eager", "turnip"],
                      tiny=True, device="cpu", out=tmp_path, isolate="none", plots=False)
    row = next(r for r in run_suite(cfg) if r["system"] == "turnip")
    assert row["status"] == "ok", row.get("error")
    mix = row["plan_mix"]
    assert mix["kept"] + mix["offloaded"] + mix["recomputed"] + mix["homed_on_cpu"] <= mix["values"]
    assert mix["kept"] > 0 and mix["offloaded"] + mix["recomputed"] + mix["homed_on_cpu"] > 0  # 40% moves something
    assert "unplanned_peak_within_eager" not in row  # the CPU backend measures no eager peak to compare with


def test_compile_again_records_the_warm_compile_of_each_turnip_row(tmp_path):
    """SuiteConfig.compile_again (--compile-again): after its steps each turnip row compiles the same
    step again, with no plan cache, and records that compile's seconds, phases and planner."""
    cfg = SuiteConfig(models=["gpt350m"], budgets=[0.4], steps=1, warmup=1, systems=["turnip"], tiny=True,
                      device="cpu", out=tmp_path, isolate="none", plots=False, compile_again=True)
    row = next(r for r in run_suite(cfg) if r["system"] == "turnip")
    assert row["status"] == "ok", row.get("error")
    assert row["compile_again_s"] > 0 and row["compile_again_planner"] in ("ilp", "greedy")
    assert set(row["compile_again_phase_s"]) >= {"tracing", "planning", "building"}
