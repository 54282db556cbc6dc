"""Multi-GPU peers: what users run on N GPUs of one host (DDP, FSDP2, DeepSpeed ZeRO offload), one torchrun each.

    row = run_distributed("fsdp2-ckpt", "gpt1.3b", devices=8, steps=5, limit_s=300)
    rows = run_all("gpt1.3b", devices=8, on_row=file.add)          # default_systems(8), in order
    python -m turnip.bench.peers.distributed --model gpt1.3b --devices 8 [--systems ddp,fsdp2] [--out rows.json]

Each system runs as ``python -m torch.distributed.run --standalone --nproc_per_node=N -m
turnip.bench.peers.distributed_worker ...`` (the systems and how they are timed: distributed_worker.py) in a
session of its own, under a wall-clock limit. The row has the single-GPU peers' fields (common.PeerResult.row,
``model`` and ``budget`` as the suite's rows) plus ``devices``; ``process_s`` and ``returncode`` as
peers/isolated.py's, and ``log_tail`` where the status is not ok. A run without a row is ``timeout`` when the
limit ran out (torchrun and every rank are killed), ``oom`` when any rank ran out of CUDA memory, ``error``
otherwise, with the last lines of the output. A system that cannot run here ("skipped" without CUDA or with
fewer GPUs than asked, "not installed" without DeepSpeed) gets its row without starting anything.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .common import ERROR, OK, OOM, SKIPPED, TIMEOUT, PeerResult
from .distributed_worker import SYSTEMS, rank_failure_path, refusal, row_of
from .isolated import run_limited

log = logging.getLogger(__name__)

WORKER = "turnip.bench.peers.distributed_worker"
# ddp and fsdp2 without offloading are eager with communication on one GPU: the single-GPU suite has those
DEFAULT_SYSTEMS = ("ddp", "ddp-ckpt", "fsdp2", "fsdp2-ckpt", "fsdp2-offload-ckpt", "zero2-offload", "zero3-offload")
ONE_GPU_SYSTEMS = ("fsdp2-offload-ckpt", "zero2-offload", "zero3-offload")
TAIL_LINES = 100
MIN_SYSTEM_S = 10.0  # run_all does not start a system with less than this left of its deadline
OOM_TEXT = ("CUDA out of memory", "OutOfMemoryError")


def default_systems(devices: int) -> tuple[str, ...]:
    """The systems run_all runs on ``devices`` GPUs when not told otherwise (ddp-foreach and turnip-ranks, turnip
    itself over ranks, only by name)."""
    if devices < 1:
        raise ValueError(f"devices must be at least 1, got {devices}")
    return ONE_GPU_SYSTEMS if devices == 1 else DEFAULT_SYSTEMS


def worker_env(devices: int) -> dict[str, str]:
    """The launched processes' environment: NVLink SHARP (NVLS) off, since the lent machines' NCCL cannot use
    multicast, and each rank's share of the cores for OpenMP (torchrun would give every rank 1 thread,
    starving DeepSpeed's CPU Adam and FSDP2's CPU optimizer step) unless the caller chose a count."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // devices)))
    return env


def command(system: str, model: str, devices: int, out: Path, *, steps: int, warmup: int, batch: int | None,
            tiny: bool, device: str, snapshot: str | None, deadline: float | None,
            save_weights: str | Path | None, log_dir: Path | None = None, budget: float | None = None,
            planner: str | None = None, gpus_per_rank: int = 1, timeline: str | Path | None = None) -> list[str]:
    """The torchrun command line of one run (what a user types, with ``torchrun`` for the first four words):
    ``devices // gpus_per_rank`` ranks. ``log_dir``: each rank's output also goes to a file of its own there
    (rank_logs reads them)."""
    logs = ["--log-dir", str(log_dir), "--redirects", "3", "--tee", "3"] if log_dir is not None else []
    ranks = devices // gpus_per_rank
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *logs,
           "-m", WORKER, "--system", system, "--model", model, "--steps", str(steps), "--warmup", str(warmup),
           "--device", device, "--out", str(out)]
    for flag, value in (("--batch", batch), ("--snapshot", snapshot), ("--deadline", deadline),
                        ("--save-weights", save_weights), ("--budget", budget), ("--planner", planner),
                        ("--gpus-per-rank", gpus_per_rank if gpus_per_rank > 1 else None), ("--timeline", timeline)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + (["--tiny"] if tiny else [])


# -- the process tree ----------------------------------------------------------------------------

def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc; empty where there is none). torchrun starts each rank in a
    session of its own, so killing torchrun's process group alone would leave the ranks running."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            children[int(fields[1])].append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group, and every descendant with its own group (each rank and what it
    started). Descendants are listed first: once torchrun dies its ranks are reparented and lost to the walk;
    torchrun is stopped before the listing so that it cannot start a rank the listing would miss."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGSTOP)
    victims = [pid, *descendants(pid)]
    for victim in victims:
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(victim, signal.SIGKILL)
    # a killed process with torch loaded takes a while to tear down on a busy host: return once all are gone
    deadline = time.monotonic() + KILL_WAIT_S
    while any(running(victim) for victim in victims) and time.monotonic() < deadline:
        time.sleep(0.05)


KILL_WAIT_S = 10.0


def running(pid: int) -> bool:
    """``pid`` exists and has not exited (a zombie, exited and not yet reaped, does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


# -- one run -------------------------------------------------------------------------------------

def rank_logs(log_dir: Path, devices: int, lines: int = 20) -> dict[int, list[str]]:
    """The last ``lines`` non-empty lines of each rank's stderr (torchrun's --log-dir layout:
    <run>/attempt_<n>/<local rank>/stderr.log; one host, so the local rank is the rank)."""
    logs = {}
    for rank in range(devices):
        files = sorted(log_dir.glob(f"*/attempt_*/{rank}/stderr.log"))
        with contextlib.suppress(OSError):
            if files:
                text = files[-1].read_text(errors="replace").splitlines()
                logs[rank] = [line for line in text if line.strip()][-lines:]
    return logs


def rank_failures(out: Path, devices: int) -> list[dict]:
    """What the ranks that caught their failure wrote (distributed_worker.report_failure), by rank."""
    failures = []
    for rank in range(devices):
        with contextlib.suppress(OSError, ValueError):
            failures.append(json.loads(rank_failure_path(out, rank).read_text()))
    return failures


def failed_rank_lines(logs: dict[int, list[str]]) -> tuple[int, list[str]] | None:
    """The rank whose stderr ends in an exception (the others were stopped by torchrun), and its last lines."""
    ended = [(rank, lines) for rank, lines in sorted(logs.items()) if lines]
    raised = [(rank, lines) for rank, lines in ended if "Error" in lines[-1] or "Exception" in lines[-1]]
    return (raised or ended or [None])[0]


def classify(failures: list[dict], logs: dict[int, list[str]], tail: list[str], killed: bool, limit_s: float,
             returncode: int | None) -> tuple[str, str]:
    """(status, error) of a run without a row: timeout, a CUDA OOM on any rank, or an error with the failing
    rank's last lines of stderr (torchrun's own where no rank said anything)."""
    if killed:
        return TIMEOUT, f"killed after {limit_s:.0f}s without a result"
    ooms = [f for f in failures if f.get("status") == OOM]
    if ooms:
        return OOM, f"rank {ooms[0]['rank']}: {ooms[0]['error']}"
    text = [line for lines in logs.values() for line in lines] + list(tail)
    if any(marker in line for line in text for marker in OOM_TEXT):  # a rank died before it could say so
        return OOM, "CUDA out of memory (from the output): " + next(
            line.strip() for line in text if any(marker in line for marker in OOM_TEXT))[:500]
    if failures:
        return ERROR, f"rank {failures[0]['rank']}: {failures[0]['error']}"
    failed = failed_rank_lines(logs)
    if failed is not None:  # it failed outside the worker's guard: an import, a crash, a signal
        rank, lines = failed
        return ERROR, f"rank {rank} exited without a result: {' | '.join(x.strip() for x in lines[-3:])}"[:600]
    last = " | ".join(line.strip() for line in tail[-5:] if line.strip())
    return ERROR, f"torchrun exited with {returncode} without a result: {last}"[:600]


def failure_row(system: str, devices: int, out: Path, tail, *, killed: bool, limit_s: float,
                returncode: int | None, logs: dict[int, list[str]] | None = None) -> dict:
    """The row of a run that wrote none (classify says why), with the largest peak a failing rank reported."""
    failures = rank_failures(out, devices)
    result = PeerResult(system)
    result.status, result.error = classify(failures, logs or {}, list(tail), killed, limit_s, returncode)
    peaks = [f["peak_allocated"] for f in failures if isinstance(f.get("peak_allocated"), int)]
    result.peak_allocated = max(peaks) if peaks else None
    result.extra["failed_ranks"] = [f["rank"] for f in failures]
    return row_of(result, devices)


def run_distributed(system: str, model: str, devices: int, *, steps: int = 5, warmup: int = 2,
                    batch: int | None = None, tiny: bool = False, device: str | None = None,
                    limit_s: float = 600.0, snapshot: str | None = None,
                    save_weights: str | Path | None = None, budget: float | None = None,
                    planner: str | None = None, gpus_per_rank: int = 1, timeline: str | Path | None = None) -> dict:
    """Train ``system`` on ``devices`` GPUs (gloo processes on the CPU) in its own torchrun; its row.

    ``batch`` is per GPU (default: the workload's), ``snapshot`` the suite's weights file
    (peers/isolated.write_snapshot), ``save_weights`` a path for rank 0's final weights (ddp and fsdp2
    systems; the tests). The ranks stop timing a little before ``limit_s`` so a slow system still reports
    the steps it timed; at ``limit_s`` everything is killed and the row is a timeout. ``budget`` and
    ``planner``: the turnip system's (per GPU: bytes, or a fraction of its unplanned peak), and
    ``gpus_per_rank`` (turnip-ranks: ``devices // gpus_per_rank`` ranks of that many GPUs each), ``timeline``
    (turnip-ranks: each rank's Perfetto timeline of one more step, ``<stem>.rank<r><suffix>`` beside it).
    """
    if gpus_per_rank < 1 or devices % gpus_per_rank:
        raise ValueError(f"gpus_per_rank={gpus_per_rank} does not divide {devices} devices")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    refused = refusal(system, device)  # raises for an unknown system
    if refused is None and device == "cuda" and torch.cuda.device_count() < devices:
        refused = PeerResult(system, status=SKIPPED,
                             error=f"needs {devices} GPUs; this host has {torch.cuda.device_count()}")
    if refused is not None:
        log.info("%s on %d devices: %s (%s)", system, devices, refused.status, refused.error)
        return {"model": model + ("-tiny" if tiny else ""), "budget": None, **row_of(refused, devices)}
    margin = min(15.0, max(2.0, 0.1 * limit_s))  # the ranks' own deadline comes this much before the kill
    with tempfile.TemporaryDirectory(prefix=f"turnip-{system}-") as folder:
        out = Path(folder) / "row.json"
        cmd = command(system, model, devices, out, steps=steps, warmup=warmup, batch=batch, tiny=tiny,
                      device=device, snapshot=snapshot, deadline=time.time() + limit_s - margin,
                      save_weights=save_weights, log_dir=Path(folder) / "logs", budget=budget, planner=planner,
                      gpus_per_rank=gpus_per_rank, timeline=timeline)
        log.info("%s on %d devices: %s (limit %.0fs)", system, devices, " ".join(cmd[1:]), limit_s)
        # torchrun runs each rank in a session of its own: kill_tree finds them (stragglers too, after an exit)
        ran = run_limited(cmd, worker_env(devices), limit_s, lambda line: log.info("[%s] %s", system, line),
                          TAIL_LINES, kill=kill_tree)
        killed, tail, process_s = ran.killed, ran.tail, ran.seconds
        if killed:
            log.warning("%s: no result after %.0fs: killed torchrun and its ranks", system, limit_s)
        row = None
        if out.exists() and not killed:
            with contextlib.suppress(ValueError, OSError):
                row = json.loads(out.read_text())
        if row is None:
            row = failure_row(system, devices, out, tail, killed=killed, limit_s=limit_s,
                              returncode=ran.returncode, logs=rank_logs(Path(folder) / "logs", devices))
    row = {"model": model + ("-tiny" if tiny else ""), "budget": None, **row, "process_s": process_s,
           "returncode": ran.returncode}
    if row["status"] != OK:
        row["log_tail"] = "\n".join(tail)[-6000:]
    log.info("%s on %d devices: %s in %.1fs%s", system, devices, row["status"], process_s,
             f", {row['step_s_median'] * 1e3:.1f} ms a step" if row.get("step_s_median") else "")
    return row


def run_all(model: str, devices: int, systems: list[str] | tuple[str, ...] | None = None, *,
            limit_s: float = 600.0, deadline: float | None = None,
            on_row: Callable[[dict], None] | None = None, **options) -> list[dict]:
    """Each of ``systems`` (default_systems(devices)) in its own torchrun, in order; their rows.

    ``limit_s`` is each system's limit, ``deadline`` (time.monotonic()) the whole call's: a system that
    would start with less than MIN_SYSTEM_S left is a timeout row, never started. ``on_row(row)`` runs as
    each row arrives (the suite's ResultFile.add), ``options`` go to run_distributed.
    """
    systems = tuple(systems or default_systems(devices))
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:  # before anything runs, not after an hour of the others
        raise ValueError(f"unknown systems {unknown} (known: {', '.join(SYSTEMS)})")
    rows = []
    for system in systems:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < MIN_SYSTEM_S:
            result = PeerResult(system, status=TIMEOUT, error=f"not started: {max(0.0, left):.0f}s left")
            row = {"model": model + ("-tiny" if options.get("tiny") else ""), "budget": None,
                   **row_of(result, devices)}
        else:
            limit = limit_s if left is None else min(limit_s, left - 5)
            row = run_distributed(system, model, devices, limit_s=limit, **options)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnip.bench.peers.distributed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt1.3b")
    parser.add_argument("--devices", type=int, default=max(1, torch.cuda.device_count()))
    parser.add_argument("--systems", help=f"comma-separated, of {', '.join(SYSTEMS)} (default: by --devices)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batch", type=int, help="sequences per GPU")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--limit", type=float, default=300.0, help="seconds for each system")
    parser.add_argument("--out", type=Path, help="write the rows here (JSON list)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, datefmt="%H:%M:%S",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else None
    rows = run_all(args.model, args.devices, systems, limit_s=args.limit, steps=args.steps, warmup=args.warmup,
                   batch=args.batch, tiny=args.tiny)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1, default=str))
    for row in rows:
        step = row.get("step_s_median")
        peak = row.get("peak_allocated")
        log.info("%-20s %-12s %10s ms %8s GiB  %s", row["system"], row["status"],
                 f"{step * 1e3:.1f}" if step else "-", f"{peak / 2**30:.2f}" if peak else "-", row.get("error") or "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
