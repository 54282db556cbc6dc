"""Call one function in a fresh Python process (multiprocessing's spawn) under a wall-clock limit.

For a peer that is not a training workload (peers/isolated.py rebuilds those by name): the prefill
benchmark's ZeRO-Inference cells. A fresh interpreter, not a fork, because the parent has already
initialized CUDA, and DeepSpeed sets up torch.distributed, pinned partitions and module hooks that
must not outlive its cells. The function and its arguments must pickle (a module-level function,
plain data); its return value comes back through a pipe. A missing value is an ``Outcome`` with
a status: ``timeout`` when the limit ran out (the child is killed), ``oom`` for a SIGKILL we did not
send (the host's out-of-memory killer), ``error`` otherwise.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .common import ERROR, OK, OOM, TIMEOUT, describe

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    status: str = OK
    value: Any = None
    error: str | None = None
    seconds: float = 0.0
    exitcode: int | None = None


def _child(fn: Callable, args: tuple, conn) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        conn.send((OK, fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - whatever stopped the child is the parent's row
        log.error("%s failed:\n%s", getattr(fn, "__name__", fn), traceback.format_exc())
        conn.send((ERROR, describe(exc)))
    finally:
        conn.close()


def call_spawned(fn: Callable, *args, limit_s: float | None = None) -> Outcome:
    """``fn(*args)`` in a new process; its value, or why there is none, within ``limit_s`` seconds."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    proc = context.Process(target=_child, args=(fn, args, send), name=f"turnip-{getattr(fn, '__name__', 'call')}")
    t0 = time.monotonic()
    proc.start()
    send.close()  # ours: the child's end closing is how a dead child shows up (EOF)
    outcome = Outcome()
    try:
        if receive.poll(limit_s):
            outcome.status, payload = receive.recv()
            if outcome.status == OK:
                outcome.value = payload
            else:
                outcome.error = payload
        else:
            outcome.status, outcome.error = TIMEOUT, f"killed after {limit_s:.0f}s without a result"
            proc.kill()
    except EOFError:  # the child died before it could answer
        outcome.status = ERROR
    finally:
        receive.close()
        proc.join(30)
        if proc.is_alive():  # answered but hangs on exit (a library's teardown): it has done its work
            proc.kill()
            proc.join()
    outcome.seconds, outcome.exitcode = time.monotonic() - t0, proc.exitcode
    if outcome.status == ERROR and outcome.error is None:
        if proc.exitcode == -signal.SIGKILL:
            outcome.status, outcome.error = OOM, "killed by SIGKILL without a result (the host's out-of-memory killer?)"
        else:
            outcome.error = f"the process exited with {proc.exitcode} without a result"
    log.info("%s: %s in %.1fs (own process)", proc.name, outcome.status, outcome.seconds)
    return outcome
