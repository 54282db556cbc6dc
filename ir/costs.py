"""What a stage below the planner reads of a cost model: the engine's simulator prices a MemGraph with
it, and never imports the planner that measured it.

``planners.costs.CostModel`` implements ``CostModel`` (measured on CUDA, analytic elsewhere);
``FixedRates`` implements it with fixed figures, for the simulator's default and for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class CostModel(Protocol):
    """Rates and op estimates in seconds and bytes per second."""

    @property
    def h2d_bandwidth(self) -> float: ...  # pinned host -> device bytes/s

    @property
    def d2h_bandwidth(self) -> float: ...  # device -> pinned host bytes/s

    @property
    def duplex_bandwidth(self) -> float | None: ...  # both directions at once, in all (None: no shared cap)

    @property
    def hbm_bandwidth(self) -> float: ...  # device memory bytes/s (a COPY vertex reads and writes it)

    @property
    def host_update_rate(self) -> float: ...  # parameters/s of a CPU optimizer update while copies run

    @property
    def d2d_bandwidth(self) -> float: ...  # bytes/s of a copy from one device's memory to another's

    @property
    def host_links(self) -> HostLinks: ...  # what the host moves over every device's link together

    @property
    def rank_bandwidth(self) -> float: ...  # bytes/s of a message from one rank to another (another host's)

    @property
    def compute_beside_messages(self) -> float: ...  # share of compute speed while a rank's message is on the device

    def estimate(self, tg: Any, vertex: Any) -> tuple[float, int]:
        """(seconds, workspace bytes) of a TaskGraph vertex that carries no measured time."""
        ...

    def host_per_vertex_on(self, device: str) -> float:
        """Host seconds per launched vertex of a graph run on ``device``'s backend."""
        ...


@dataclass(frozen=True)
class HostLinks:
    """Bytes/s the host moves over every device's link together, host to devices, devices to host,
    and both at once (None: no cap beyond each link's own). Past two GPUs the host, not PCIe, is the
    limit: four H100s of one host moved 164 GB/s host to devices (41 each), 128 back (32 each) and
    190 in all with both directions busy; two moved 84, 108 and 162."""

    h2d: float | None = None
    d2h: float | None = None
    both: float | None = None


@dataclass(frozen=True)
class FixedRates:
    """A CostModel of fixed figures (an H100's link and HBM, planners.costs.H100's). It estimates no
    op: vertices carry their own times."""

    h2d_bandwidth: float = 50e9
    d2h_bandwidth: float = 50e9
    duplex_bandwidth: float | None = None
    hbm_bandwidth: float = 3e12
    host_update_rate: float = 2.4e9
    host_per_vertex: float = 0.0
    d2d_bandwidth: float = 300e9
    host_links: HostLinks = field(default_factory=HostLinks)
    rank_bandwidth: float = 25e9
    compute_beside_messages: float = 1.0

    def estimate(self, tg: Any, vertex: Any) -> tuple[float, int]:
        return 0.0, 0

    def host_per_vertex_on(self, device: str) -> float:
        return self.host_per_vertex
