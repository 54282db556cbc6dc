"""Traced compute against the cost model, per unit size: measured / simulated time of the compute units
of each trace kept in ../traces/ (gzipped engine timelines and their simulations), binned by the
unit's bytes. Run from this folder: python compute_by_unit_size.py"""
import collections
import gzip
import json
from pathlib import Path

TRACES = Path(__file__).resolve().parent.parent / "traces"


def load(path: Path) -> list[dict]:
    return [e for e in json.load(gzip.open(path))["traceEvents"] if e.get("ph") == "X"]


def size_bin(nbytes: int) -> str:
    mib = nbytes / 2**20
    return "<8MiB" if mib < 8 else "8-32MiB" if mib < 32 else "32-128MiB" if mib < 128 else ">=128MiB"


for measured in sorted(p for p in TRACES.glob("trace_*.gz") if ".sim." not in p.name):
    simulated = measured.with_name(measured.name.replace(".json_", ".sim.json_"))
    by_vertex = {e["args"]["vertex"]: e for e in load(simulated)}
    bins = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in load(measured):
        sim = by_vertex.get(e["args"]["vertex"])
        if e["args"]["kind"] != "compute" or sim is None or sim["dur"] <= 0:
            continue
        row = bins[size_bin(e["args"].get("bytes") or 0)]
        row[0] += 1
        row[1] += e["dur"]
        row[2] += sim["dur"]
    print(measured.name, {k: (n, round(us / 1e3, 1), round(sim_us / 1e3, 1), round(us / sim_us, 2))
                          for k, (n, us, sim_us) in sorted(bins.items())})
