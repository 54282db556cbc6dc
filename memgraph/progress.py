"""Progress of memgraph.compile over the phases a user can name: one tqdm bar on stderr.

    progress = Phases(["tracing", "measuring op costs", "planning", "building"], enabled=True)
    with progress.phase("tracing"):
        ...
    progress.close()

The bar shows only when enabled and stderr is a terminal (never in logs, pipes or tests). A
phase can take long without any step to count (one ILP solve), so while a phase runs a daemon
thread redraws the bar twice a second and its elapsed time keeps moving.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Self

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

REFRESH_S = 0.5


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class Phases:
    """A bar that advances one step per phase and names the running one."""

    def __init__(self, names: list[str], enabled: bool = True):
        self.names = list(names)
        self.seconds: dict[str, float] = {}  # wall seconds each phase took, once it ended
        self.enabled = enabled and stderr_is_terminal()
        self.bar = tqdm(total=len(self.names), desc="compile", unit="phase", file=sys.stderr, leave=False,
                        disable=not self.enabled, dynamic_ncols=True,
                        bar_format="turnip compile {bar:12} {n_fmt}/{total_fmt} {desc} [{elapsed}]")
        self._stop = threading.Event()

    @contextlib.contextmanager
    def phase(self, name: str, detail: str = "") -> Iterator[None]:
        """Name `name` (with `detail`, e.g. "ILP, up to 30 s") on the bar while the block runs."""
        self.describe(name, detail)
        started = time.perf_counter()
        with self._tick() if self.enabled else contextlib.nullcontext():
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
        self.bar.update(1)

    def describe(self, name: str, detail: str = "") -> None:
        """Rename the running phase, e.g. once it is known what it will do."""
        self.bar.set_description_str(f"{name} ({detail})" if detail else name, refresh=True)

    def skip(self, name: str) -> None:
        """A phase this compile does not need (op costs when nothing is planned)."""
        self.bar.update(1)

    @contextlib.contextmanager
    def _tick(self) -> Iterator[None]:
        """Redraw the bar while the phase runs; log lines go above it instead of through it."""
        self._stop.clear()
        thread = threading.Thread(target=self._refresh, name="turnip-progress", daemon=True)
        thread.start()
        try:
            with logging_redirect_tqdm():
                yield
        finally:
            self._stop.set()
            thread.join()

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
