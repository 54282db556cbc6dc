"""One system (a peer, or turnip at one budget) in a process of its own, with a wall-clock limit.

    python -m turnip.bench.peers.isolated --system torchao --model gpt1.3b --steps 5     # by hand: prints JSON
    python -m turnip.bench.peers.isolated --request REQUEST.json                         # what the suite runs

Why a process each: torchao's CPUOffloadOptimizer keeps model and optimizer alive through its
gradient hooks, DeepSpeed initializes torch.distributed once per process, torchtune needs a torchao
of its own (a site directory first on its path), and a crash, a hang or a CUDA error must cost one
row, not the suite. The child writes its ``PeerResult`` as JSON to a file (libraries print on stdout);
the parent turns a missing result into a row: ``timeout`` when it had to kill the child at its limit,
``oom`` for a SIGKILL it did not send (the host's out-of-memory killer), ``error`` otherwise, with the
tail of the child's output.

The child rebuilds the workload by name. A 1B-parameter model takes 7-13 s to initialize, so the
parent writes the canonical weights (and batch) once to a safetensors *snapshot* and children build
the model without random initialization and copy the snapshot in; every parameter and buffer must
match it by name, shape and dtype, or the child builds the workload the slow way.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..models.llama import Unavailable
from ..models.sizes import make_workload
from . import PEERS, turnip_system
from .common import ERROR, NOT_INSTALLED, OK, OOM, TIMEOUT, PeerResult, Workload, describe

log = logging.getLogger(__name__)

SITE_ENV = "TURNIP_PEER_SITE_"  # TURNIP_PEER_SITE_torchtune=/tmp/site_tt: sys.path entries first for that system
TAIL_LINES = 30


# -- the workload a child rebuilds ---------------------------------------------------------------

@dataclass
class WorkloadSpec:
    """What a child needs to rebuild the parent's workload: make_workload's arguments and the snapshot."""

    name: str
    tiny: bool = False
    batch: int | None = None
    snapshot: str | None = None  # safetensors file of the canonical weights and batch (write_snapshot)


def named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (a tied one once) and buffers, persistent or not: everything a forward reads."""
    return [*model.named_parameters(), *model.named_buffers()]


def write_snapshot(workload: Workload, path: str | Path) -> Path:
    """The canonical weights as ``model.<name>`` and the batch's tensors as ``batch.<i>``, in one file."""
    tensors = {f"model.{name}": t.detach().contiguous() for name, t in named_tensors(workload.model)}
    leaves = torch.utils._pytree.tree_leaves(workload.batch)
    tensors.update({f"batch.{i}": x.detach().contiguous() for i, x in enumerate(leaves)
                    if isinstance(x, torch.Tensor)})
    save_file(tensors, str(path))
    return Path(path)


@contextlib.contextmanager
def skip_init():
    """Random initialization skipped (it is most of a large model's build time; the snapshot's
    values replace it): a floating tensor it would have drawn is filled with NaN instead, so a
    model used before its snapshot is loaded computes NaN, never plausible numbers (left
    uninitialized, its memory could even hold a freed copy of the very weights the snapshot has).
    Restores every function it replaced."""
    init_names = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                  "xavier_normal_", "orthogonal_")
    saved = [(torch.nn.init, n, getattr(torch.nn.init, n)) for n in init_names if hasattr(torch.nn.init, n)]
    saved += [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in ("uniform_", "normal_")]

    def keep(tensor, *_args, **_kwargs):
        if tensor.is_floating_point():
            with torch.no_grad():
                tensor.fill_(float("nan"))
        return tensor

    try:
        for owner, name, _ in saved:
            setattr(owner, name, keep)
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def load_snapshot(workload: Workload, path: str | Path) -> None:
    """Copy a snapshot into ``workload`` (built under skip_init); ValueError where they differ."""
    stored = load_file(str(path))
    names = named_tensors(workload.model)
    want = {f"model.{name}" for name, _ in names}
    have = {k for k in stored if k.startswith("model.")}
    if want != have:
        raise ValueError(f"snapshot names differ: missing {sorted(want - have)[:3]}, extra {sorted(have - want)[:3]}")
    with torch.no_grad():
        for name, t in names:
            src = stored[f"model.{name}"]
            if src.shape != t.shape or src.dtype != t.dtype:
                raise ValueError(f"snapshot's {name} is {src.dtype}{list(src.shape)}, the model's {t.dtype}"
                                 f"{list(t.shape)}")
            t.copy_(src)
    leaves, tree = torch.utils._pytree.tree_flatten(workload.batch)
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            src = stored.get(f"batch.{i}")
            if src is None or src.shape != x.shape or src.dtype != x.dtype:
                raise ValueError(f"snapshot's batch tensor {i} differs from the workload's")
            leaves[i] = src.clone()
    workload.batch = torch.utils._pytree.tree_unflatten(leaves, tree)


def build_workload(spec: WorkloadSpec) -> Workload:
    if spec.snapshot:
        try:
            with skip_init():
                workload = make_workload(spec.name, tiny=spec.tiny, batch=spec.batch)
            load_snapshot(workload, spec.snapshot)
            return workload
        except (ValueError, OSError) as exc:
            log.warning("snapshot %s not used (%s): building %s from scratch", spec.snapshot, exc, spec.name)
    return make_workload(spec.name, tiny=spec.tiny, batch=spec.batch)


# -- the child ------------------------------------------------------------------------------------

def resolve(system: str):
    """A system's run function: turnip, a name in PEERS, or ``module:function`` (any importable peer)."""
    if system == "turnip":
        return turnip_system.run
    if system in PEERS:
        return PEERS[system]
    module, sep, attr = system.partition(":")
    if not sep:
        raise ValueError(f"unknown system {system!r} (known: turnip, {', '.join(PEERS)}, or module:function)")
    return getattr(importlib.import_module(module), attr)


def child_run(request: dict) -> PeerResult:
    """Build the workload, run the system under the time left before the request's deadline."""
    system = request["system"]
    name = system.rpartition(":")[2]
    t0 = time.monotonic()
    try:
        workload = build_workload(WorkloadSpec(**request["workload"]))
    except Unavailable as exc:
        return PeerResult(name, status=NOT_INSTALLED, error=str(exc))
    build_s = time.monotonic() - t0
    deadline = request.get("deadline")
    limit_s = max(1.0, deadline - time.time()) if deadline else None
    run = resolve(system)
    kwargs = dict(request.get("options") or {})
    if limit_s is not None:
        kwargs.update(limit_s=limit_s, deadline=time.monotonic() + 0.8 * limit_s)
    log.info("%s: workload %s built in %.1fs; running with %s s left", name, workload.name, build_s,
             f"{limit_s:.0f}" if limit_s else "no limit")
    result = run(workload, request["device"], request["steps"], warmup=request.get("warmup", 1), **kwargs)
    result.extra["build_s"] = build_s
    return result


def write_result(path: str | Path, result: PeerResult) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"result": asdict(result)}, default=str))
    os.replace(tmp, path)


def child_main(request: dict) -> int:
    threads = request.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    name = request["system"].rpartition(":")[2]
    try:
        result = child_run(request)
    except Exception as exc:  # anything outside the peer's own guard is this row's error too
        log.exception("%s failed", name)
        result = PeerResult(name, status=ERROR, error=describe(exc))
    if request.get("result"):
        write_result(request["result"], result)
    else:
        print(json.dumps({"result": asdict(result)}, indent=1, default=str))
    return 0


# -- the parent -----------------------------------------------------------------------------------

def result_from_json(data: dict) -> PeerResult:
    known = {f.name for f in fields(PeerResult)}
    return PeerResult(**{k: v for k, v in data.items() if k in known})


def site_for(system: str, sites: dict[str, list[str]] | None = None) -> list[str]:
    """The extra sys.path entries of ``system``: ``sites[system]`` and $TURNIP_PEER_SITE_<system> (":"-separated)."""
    paths = list((sites or {}).get(system, []))
    paths += [p for p in os.environ.get(SITE_ENV + system, "").split(os.pathsep) if p]
    return paths


def _forward_output(stream, show: Callable[[str], None], tail: collections.deque) -> None:
    """Show the child's output line by line (a live log), keeping the last lines."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        tail.append(line)
        show(line)
    stream.close()


def _kill_group(pid: int) -> None:
    """SIGKILL the child's process group (the child and whatever it started: a compiler, workers)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


@dataclass
class Ran:
    """How a child run under a limit ended."""

    returncode: int
    killed: bool  # the limit ran out
    tail: list[str]  # its last lines of output
    seconds: float


def run_limited(command: list[str], env: dict, limit_s: float, show: Callable[[str], None], tail_lines: int,
                kill: Callable[[int], None] = _kill_group) -> Ran:
    """Run ``command`` in a session of its own, its output shown line by line by ``show``, killed by
    ``kill(pid)`` after ``limit_s`` seconds, and after it exits too (whatever it left running)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    tail: collections.deque = collections.deque(maxlen=tail_lines)
    reader = threading.Thread(target=_forward_output, args=(proc.stdout, show, tail), daemon=True)
    reader.start()
    killed = False
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        killed = True
    finally:
        kill(proc.pid)
        proc.wait()
        reader.join(timeout=10)
    return Ran(proc.returncode, killed, list(tail), time.monotonic() - t0)


def run_isolated(system: str, workload: WorkloadSpec, device, steps: int, limit_s: float, warmup: int = 1,
                 options: dict | None = None, sites: dict[str, list[str]] | None = None, threads: int | None = None,
                 name: str | None = None) -> PeerResult:
    """Run ``system`` in a new ``python -m turnip.bench.peers.isolated`` process, killed after ``limit_s``.

    The child stops itself a little earlier (its own time limit) so that a slow system still reports
    the steps it timed and its peak; ``options`` are the run function's keyword arguments (JSON).
    """
    name = name or system.rpartition(":")[2]
    margin = min(15.0, max(2.0, 0.1 * limit_s))  # the child's own limit fires this much before the kill
    with tempfile.TemporaryDirectory(prefix=f"turnip-{name}-") as folder:
        result_path = Path(folder) / "result.json"
        request = {"system": system, "workload": asdict(workload), "device": str(device), "steps": steps,
                   "warmup": warmup, "options": options or {}, "deadline": time.time() + limit_s - margin,
                   "result": str(result_path), "threads": threads}
        request_path = Path(folder) / "request.json"
        request_path.write_text(json.dumps(request, default=str))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        extra = site_for(name, sites)
        if extra:
            env["PYTHONPATH"] = os.pathsep.join([*extra, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                           if p]])
        command = [sys.executable, "-m", "turnip.bench.peers.isolated", "--request", str(request_path)]
        log.info("%s: own process, limit %.0fs%s", name, limit_s, f", site {extra}" if extra else "")
        ran = run_limited(command, env, limit_s, lambda line: sys.stderr.write(f"[{name}] {line}\n"), TAIL_LINES)
        killed, tail, wall_s = ran.killed, ran.tail, ran.seconds
        if killed:
            log.warning("%s: no result after %.0fs: killed it", name, limit_s)
        result = None
        if result_path.exists():
            try:
                result = result_from_json(json.loads(result_path.read_text())["result"])
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("%s: unreadable result (%r)", name, exc)
    if result is None:
        result = PeerResult(name)
        if killed:
            result.status, result.error = TIMEOUT, f"killed after {limit_s:.0f}s without a result"
        elif ran.returncode == -signal.SIGKILL:
            result.status, result.error = OOM, "killed by SIGKILL without a result (the host's out-of-memory killer?)"
        else:
            last = next((line for line in reversed(tail) if line.strip()), "")
            result.status = ERROR
            result.error = f"the process exited with {ran.returncode} without a result: {last}"[:600]
    if result.status != OK:
        result.extra["log_tail"] = "\n".join(tail)[-3000:]
    result.extra.update(process_s=wall_s, returncode=ran.returncode)
    log.info("%s: %s in %.1fs (own process)", name, result.status, wall_s)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnip.bench.peers.isolated", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--request", help="a JSON request written by run_isolated (everything else is ignored)")
    parser.add_argument("--system", help="a peer name, turnip, or module:function")
    parser.add_argument("--model", default="gpt350m")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget", type=float, help="turnip: fraction of the unplanned peak")
    parser.add_argument("--time-limit", type=float, help="seconds for the run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, datefmt="%H:%M:%S",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.request:
        request = json.loads(Path(args.request).read_text())
    elif args.system:
        request = {"system": args.system, "workload": asdict(WorkloadSpec(args.model, args.tiny, args.batch)),
                   "device": args.device, "steps": args.steps, "warmup": args.warmup,
                   "options": {"budget": args.budget} if args.budget is not None else {},
                   "deadline": time.time() + args.time_limit if args.time_limit else None}
    else:
        parser.error("give --request or --system")
    return child_main(request)


if __name__ == "__main__":
    raise SystemExit(main())
