"""Why the GPU's compute stream idled in a traced step: each gap charged to what its next unit waited for.

    python -m turnip.bench.trace_waits bench/results/h100/trace_gpt1.3b_s13.json [--top 15] [--json out.json]

A trace written by engine.run(..., trace=...) or by the simulator (engine/timing_sim.py) names, for
every unit (a segment or one vertex), the units it waits for (args "after") and when the host
launched it (args "launched", where the backend records it). A unit starts at the latest of three
times: its predecessors' ends, the end of the unit before it on its own stream, and its launch.
For each gap in a device's compute (no compute stream of it running anything) this names which of
them came last for the unit that ended the gap:

- ``waits for <kind>``: a predecessor on another stream (a reload, an offload whose freed bytes the
  unit writes, ...) ended last; its name and size are listed;
- ``waits for <kind> on another device``: the loop launched the unit as soon as it heard that a
  predecessor on another device had ended (within LOOP_SLACK_US, and the unit started within that of
  its launch: a copy between devices starts some 50-70 us after it): a copy between devices is
  launched only once its writers have run, so the wait is for that device, not for the host;
- ``loop heard late of another device``: the same, but the loop launched the unit more than
  LOOP_SLACK_US after that predecessor ended (its completion heard late, or the loop busy);
- ``host launch``: the host launched the unit after the stream had run dry (the loop was late);
- ``unexplained``: none of them is within the slack of its start (device scheduling, timer noise).

Given the measured trace and the simulator's of the same step (``.sim.json`` beside it, as the
suite keeps them), it prints both, so a gap the simulator did not predict stands out.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

SLACK_US = 30.0  # a start this close after a time counts as caused by it (event and timer resolution)
LOOP_SLACK_US = 200.0  # a launch this close after a predecessor's end: the loop reacting to hearing of it


def load_units(path: Path) -> list[dict]:
    doc = json.loads(Path(path).read_text())
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"]


def simulated_beside(trace: Path) -> Path:
    """Where the suite keeps the simulator's trace of the step a measured trace shows."""
    return trace.with_name(trace.name.removesuffix(".json") + ".sim.json")


def explain_gaps(units: list[dict], min_gap_us: float = 20.0) -> list[dict]:
    """One row per gap of at least ``min_gap_us`` in a device's compute, largest first: a time when
    none of its compute streams ran anything (the CPU backend's several compute lanes count as one)."""
    by_vertex = {e["args"]["vertex"]: e for e in units}
    devices: dict[int, list[dict]] = collections.defaultdict(list)
    for e in units:
        if e["cat"] == "compute":
            devices[e["pid"]].append(e)
    rows = []
    for lane in devices.values():
        lane.sort(key=lambda e: e["ts"])
        prev_end = lane[0]["ts"]
        for e in lane:
            gap = e["ts"] - prev_end
            if gap >= min_gap_us:
                rows.append(_why(e, gap, prev_end, by_vertex))
            prev_end = max(prev_end, e["ts"] + e["dur"])
    rows.sort(key=lambda r: -r["gap_us"])
    return rows


def _why(e: dict, gap: float, prev_end: float, by_vertex: dict) -> dict:
    start = e["ts"]
    preds = [by_vertex[p] for p in e["args"].get("after", []) if p in by_vertex]
    last = max(preds, key=lambda p: p["ts"] + p["dur"], default=None)
    last_end = last["ts"] + last["dur"] if last is not None else float("-inf")
    launched = e["args"].get("launched", float("-inf"))
    row = {"gap_us": round(gap, 1), "at_ms": round(prev_end / 1e3, 3), "unit": e["name"],
           "vertex": e["args"]["vertex"], "phase": e["args"].get("phase", ""), "module": e["args"].get("module", ""),
           "launched_after_stream_dry_us": round(launched - prev_end, 1) if launched > float("-inf") else None}
    if last is not None and last_end >= launched and start - last_end <= SLACK_US:
        row["cause"] = f"waits for {last['cat']}"
        row["waited_for"] = _unit_facts(last)
    elif (last is not None and last["pid"] != e["pid"] and launched > prev_end and launched >= last_end
          and start - launched <= LOOP_SLACK_US):
        late = launched - last_end > LOOP_SLACK_US
        row["cause"] = "loop heard late of another device" if late else f"waits for {last['cat']} on another device"
        row["waited_for"] = {**_unit_facts(last), "device": last["pid"], "heard_after_us": round(launched - last_end, 1)}
    elif launched > prev_end and start - launched <= SLACK_US:
        row["cause"] = "host launch"
    else:
        row["cause"] = "unexplained"
    return row


def _unit_facts(e: dict) -> dict:
    """What a gap's row says of the unit it waited for."""
    return {"unit": e["name"], "vertex": e["args"]["vertex"], "bytes": e["args"].get("bytes"),
            "started_ms": round(e["ts"] / 1e3, 3), "took_us": round(e["dur"], 1)}


def summarize(rows: list[dict]) -> dict:
    total = collections.Counter()
    for r in rows:
        total[r["cause"]] += r["gap_us"]
    return {cause: round(us / 1e3, 3) for cause, us in total.most_common()}


def report(path: Path, top: int) -> dict:
    rows = explain_gaps(load_units(path))
    out = {"trace": str(path), "idle_ms_by_cause": summarize(rows), "gaps": rows}
    print(f"{path}: compute idle {sum(r['gap_us'] for r in rows) / 1e3:.2f} ms in {len(rows)} gaps; by cause "
          f"(ms): {out['idle_ms_by_cause']}")
    for r in rows[:top]:
        what = r.get("waited_for")
        detail = (f"{what['unit']} ({(what['bytes'] or 0) / 2**20:.1f} MiB, started {what['started_ms']} ms, "
                  f"took {what['took_us'] / 1e3:.2f} ms)" if what else "")
        print(f"  {r['gap_us'] / 1e3:6.2f} ms at {r['at_ms']:8.2f} before {r['unit']} [{r['phase']} {r['module']}]: "
              f"{r['cause']} {detail}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnip.bench.trace_waits", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a trace JSON of engine.run or the simulator; its .sim.json is read too")
    parser.add_argument("--top", type=int, default=15, help="gaps listed per trace")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    path = Path(args.trace)
    results = [report(path, args.top)]
    sim = simulated_beside(path)
    if not path.name.endswith(".sim.json") and sim.exists():
        results.append(report(sim, args.top))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
