"""An optical circuit switch per rail, in the simulator: a NIC's circuit serves one parallelism group at a time.

The setting is the photonic rail of docs/FABRIC.md ("The optical rail in the simulator"): on a
``RailOptimized`` or ``MultiPlane`` fabric every rail switch is an optical circuit switch. A NIC's port
holds a circuit set up for one parallelism group's peers (``tp``, ``cp``, ``ep``, ``dp``, ``pp``,
``other``: the flows' ``group``, ``lib/workload/placement.GROUP_OF_KIND``); a call of another group waits
until the port has been reconfigured, which takes the delay ``D``.

Rules (:class:`OpticalRails`; the analytic simulator calls it when a collective is ready to start, when
one ends and at the instants a reconfiguration completes):

* **Where.** Every NIC's port on ``RailOptimized`` and ``MultiPlane``; on ``Arbitrary`` the ports of the NICs on
  switches the file marks ``optical = true`` (``Fabric.optical_endpoints``; a call's flows from and to the
  other NICs need no circuit).
* **What needs a circuit.** A call's network flows: those between two scale-up domains (NVLink traffic is
  the simulator's loopback and never needs one). A call of at most ``packet_bytes`` bytes (default
  :data:`PACKET_BYTES` = 4096, the size the simulator already times at 0 us:
  ``lib/sim/analytic.TINY_COLLECTIVE_BYTES``) is a control collective (the loss, the gradient norm and the
  inf/nan flag: scalars of 4-8 bytes) and runs on a packet network beside the optical one: it needs no
  circuit. ``packet_bytes = 0`` puts every call on the circuits.
* **What a reconfiguration holds up.** Only the ports it changes: a port is reconfigured only when none of
  its calls is in flight (it drains), and while it switches no call uses it; every other port keeps
  working. (The study's simulator reconfigures the whole fabric at once: it refuses a reconfiguration while
  any collective is in flight and drains every link before switching: ``TopologyManager::reconfigure``,
  ``drain_network`` in opusfabric/Opus ``simulation/reconfig_backend``; its topology is one bit a pipeline
  stage, DP or PP, ``Scheduler::reconfigure``.)
* **A call starts** when every port its network flows touch holds its group and is not switching; it
  waits otherwise. A whole call waits (a ring cannot run with one hop missing), and its flows then start
  together. A port that holds group g keeps serving g's calls while they come; it switches when it has
  no call in flight and the earliest waiting call on it wants another group (first come, first served:
  no two calls wait on each other for ever).
* **Modes.** ``on_demand``: a port is reconfigured when a call of another group is ready (and the port
  has drained). ``provisioned``: also as soon as the port's last call in flight ends, if the port's next
  call (by the port's sequence of calls in the same run on the EPS, :attr:`OpticalRails.schedule`) is of
  another group: the study provisions from a per-rank file of the indices at which each group's
  communication starts (``Scheduler::post_reconfig``, its ``provision_config``), a schedule known before
  the run as ours is. When the re-timed run's order on a port differs from the schedule, the call that
  comes is served on demand. ``eps``: no optical switch (today's network): nothing waits; the ports'
  sequences are recorded (the schedule of a provisioned run).
* **The first circuit** of a port is set up before the run (the first call of each port waits for none).

Times in ns. No Dagster import.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

MODES = ("on_demand", "provisioned")
#: The default size, bytes, up to which a call is a control collective on the packet network (module docstring).
PACKET_BYTES = 4096
#: The ``reconfig`` table of a ``[[run]]`` entry: its keys and their defaults (docs/FABRIC.md).
RECONFIG_KEYS: dict[str, Any] = {"mode": "", "delay_ms": None, "packet_bytes": PACKET_BYTES, "sweep_delays_ms": []}
#: Topologies whose rails can be optical (a rail switch a NIC index).
OPTICAL_TOPOLOGIES = ("RailOptimized", "MultiPlane", "Arbitrary")
MAX_DELAY_MS = 1_000_000


@dataclass(frozen=True)
class OpticalConfig:
    """A run's optical rails: ``mode`` (:data:`MODES` or ``"eps"``), ``delay_ns``, ``packet_bytes``."""

    mode: str
    delay_ns: float
    packet_bytes: int = PACKET_BYTES


def reconfig_rule(  # noqa: PLR0911 (one return per rule broken, each its message)
    table: object, topology: str, source: str, optical_nics: int | None = None
) -> str | None:
    """What is wrong with a ``[[run]]`` entry's ``reconfig`` table (None when it is allowed). ``optical_nics``:
    the NICs on an ``Arbitrary`` file's ``optical = true`` switches (``Fabric.optical_endpoints``; None: not
    counted); an Arbitrary run with none is refused (no port would ever switch)."""
    if not isinstance(table, dict):
        return f"reconfig must be a table ({{ mode = 'provisioned', delay_ms = 10 }}), got {table!r}"
    extra = sorted(set(table) - set(RECONFIG_KEYS))
    if extra:
        return f"reconfig has unknown keys {extra} (known: {', '.join(RECONFIG_KEYS)})"
    if not table:
        return None
    if topology not in OPTICAL_TOPOLOGIES:
        return f"reconfig needs optical rails: topology {' or '.join(OPTICAL_TOPOLOGIES)}, not {topology}"
    if topology == "Arbitrary" and optical_nics == 0:
        return (
            "reconfig on an Arbitrary fabric needs optical switches: mark the NICs' switches optical = true in "
            "the fabric file (no NIC of this run is on one)"
        )
    if source != "analytic":
        return f"reconfig is simulated by the analytic simulator only (source = 'analytic'), not {source!r}"
    if (why := _mode_rule(table)) is not None:
        return why
    pb = table.get("packet_bytes", PACKET_BYTES)
    if isinstance(pb, bool) or not isinstance(pb, int) or pb < 0:
        return f"reconfig.packet_bytes must be an integer >= 0 (bytes), got {pb!r}"
    sw = table.get("sweep_delays_ms", [])
    if (
        not isinstance(sw, (list, tuple))
        or not all(_delay_ok(d) and isinstance(d, int) for d in sw)
        or len(set(sw)) != len(sw)
    ):
        return f"reconfig.sweep_delays_ms must be a list of distinct integers from 0 to {MAX_DELAY_MS} (ms), got {sw!r}"
    return None


def _mode_rule(table: dict) -> str | None:
    """``reconfig_rule``'s part on ``mode`` and ``delay_ms`` (and a table that asks for nothing)."""
    mode, delay = table.get("mode", ""), table.get("delay_ms")
    if not isinstance(mode, str):  # was: 0 or false passed as "no mode", the run silently the EPS
        return f"reconfig.mode must be one of {', '.join(MODES)}, got {mode!r}"
    if mode == "" and delay is not None:
        return "reconfig.delay_ms needs reconfig.mode (the run's own network is reconfigured)"
    if mode != "" and delay is None:
        return "reconfig.mode needs reconfig.delay_ms (the run's own network's reconfiguration delay)"
    if mode and mode not in MODES:
        return f"reconfig.mode must be one of {', '.join(MODES)}, got {mode!r}"
    if delay is not None and not _delay_ok(delay):
        return f"reconfig.delay_ms must be a number from 0 to {MAX_DELAY_MS}, got {delay!r}"
    if mode and delay == 0:
        # the 0 ms point is the EPS (the study's 0 ms run; the sweep's 0 ms rows, reconfig_sim): an optical
        # network with no delay still serves one group a port at a time (groups overlapping on a NIC are
        # serialised), another number than the 0 ms rows of the same mode
        return (
            "reconfig.delay_ms = 0 with a mode: the 0 ms point is the EPS reference (the sweep's 0 ms rows); "
            "that run is the same entry without reconfig (an optical network needs delay_ms > 0)"
        )
    if not mode and not table.get("sweep_delays_ms"):
        # was accepted: packet_bytes alone or an empty sweep changed nothing (no reconfigured run, no sweep)
        return (
            f"reconfig asks for nothing: {table!r} has no mode (a reconfigured run: mode and delay_ms) and no "
            "delay to sweep (sweep_delays_ms = [0, 1, 10, ...])"
        )
    return None


def _delay_ok(d: object) -> bool:
    return not isinstance(d, bool) and isinstance(d, (int, float)) and 0 <= d <= MAX_DELAY_MS


def reconfig_tail(table: dict[str, Any]) -> str:
    """The run id's tail of a run on a reconfigured network: ``_ocs_<mode>_<delay>ms`` (``2.5`` -> ``2p5``,
    ``0.00001`` -> ``0p00001``: positional digits);
    "" when the run's own network is the EPS (no ``mode``), so the same job with and without the optical
    switch are two runs."""
    if not table.get("mode"):
        return ""
    d = table["delay_ms"]
    # positional digits (was repr: 1e-05 ms gave "1e-05", a '-' in a run id)
    text = str(int(d)) if float(d).is_integer() else np.format_float_positional(float(d), trim="-").replace(".", "p")
    return f"_ocs_{table['mode']}_{text}ms"


def run_config(table: dict[str, Any]) -> OpticalConfig | None:
    """The optical config of a run's own network (``reconfig.mode`` set), else None (EPS)."""
    if not table.get("mode"):
        return None
    return OpticalConfig(
        str(table["mode"]), float(table["delay_ms"]) * 1e6, int(table.get("packet_bytes", PACKET_BYTES))
    )


class _Port:
    __slots__ = ("active", "group", "k", "ready", "waiting")

    def __init__(self) -> None:
        self.group: str | None = None  # the circuit's group (the target while it switches)
        self.ready = 0.0  # the instant its circuit is up
        self.active = 0  # calls in flight on it
        self.waiting: deque[int] = deque()  # calls waiting for it, in arrival order
        self.k = 0  # calls admitted on it so far (its position in the schedule)


class OpticalRails:
    """The ports' circuit states and the calls waiting for them (module docstring).

    Use: :meth:`request` when a call is ready (returns the calls that may start now, in arrival order),
    :meth:`release` when a call ends, :meth:`wake` at every instant :meth:`next_wake` gives; each returns
    the calls admitted. ``reconfigurations`` counts the circuit changes.
    """

    def __init__(self, config: OpticalConfig, schedule: dict[int, list[str]] | None = None) -> None:
        self.config = config
        self.ports: dict[int, _Port] = {}
        self.calls: dict[int, tuple[str, tuple[int, ...], float]] = {}  # waiting or in flight: group, ports, ready
        self.waiting: dict[int, None] = {}  # calls waiting, in arrival order
        self.schedule = schedule or {}
        self.log: dict[int, list[str]] = {}  # each port's groups in admission order (the EPS run's: a schedule)
        self.wakes: list[float] = []
        self.reconfigurations = 0

    def needs_circuit(self, call_bytes: float) -> bool:
        """Whether a call of ``call_bytes`` (its per-rank buffer) is on the circuits, not the packet network."""
        return call_bytes > self.config.packet_bytes

    def _port(self, p: int) -> _Port:
        port = self.ports.get(p)
        if port is None:
            port = self.ports[p] = _Port()
        return port

    def request(self, call: int, group: str, ports: tuple[int, ...], t: float) -> list[int]:
        """Call ``call`` of ``group`` is ready at ``t`` on ``ports`` (NIC endpoints); the calls admitted now."""
        self.calls[call] = (group, ports, t)
        if self.config.mode == "eps":
            return self._admit(call, t)
        self.waiting[call] = None
        for p in ports:
            self._port(p).waiting.append(call)
        return self._serve(t)

    def release(self, call: int, t: float) -> list[int]:
        """Call ``call`` ended at ``t``: its ports drain; the calls admitted now."""
        group, ports, _ = self.calls.pop(call)
        for p in ports:
            port = self.ports[p]
            port.active -= 1
            if port.active == 0 and self.config.mode == "provisioned" and not port.waiting:
                nxt = self.schedule.get(p, [])
                if port.k < len(nxt) and nxt[port.k] != port.group:
                    self._switch(port, nxt[port.k], t)
        return [] if self.config.mode == "eps" else self._serve(t)

    def next_wake(self) -> float:
        return min(self.wakes) if self.wakes else math.inf

    def wake(self, t: float) -> list[int]:
        """A reconfiguration completed at ``t``: the calls admitted now."""
        self.wakes = [w for w in self.wakes if w > t]
        return self._serve(t)

    def _switch(self, port: _Port, group: str, t: float) -> None:
        port.group, port.ready = group, t + self.config.delay_ns
        self.reconfigurations += 1
        if self.config.delay_ns > 0:
            self.wakes.append(port.ready)

    def _admit(self, call: int, t: float) -> list[int]:
        group, ports, _ = self.calls[call]
        for p in ports:
            port = self._port(p)
            port.active += 1
            port.k += 1
            if port.group is None:  # the first circuit: set up before the run
                port.group = group
            self.log.setdefault(p, []).append(group)
        return [call]

    def _serve(self, t: float) -> list[int]:
        """Admit every waiting call whose ports hold its group and are up (arrival order), and start the
        reconfigurations the earliest waiting calls need on drained ports; repeat until nothing changes."""
        out: list[int] = []
        changed = True
        while changed:
            changed = False
            for call in list(self.waiting):
                group, ports, _ = self.calls[call]
                if all(self._port(p).group in (group, None) and self._port(p).ready <= t for p in ports):
                    del self.waiting[call]
                    for p in ports:
                        self.ports[p].waiting.remove(call)
                    out += self._admit(call, t)
                    changed = True
            for p in sorted({p for c in self.waiting for p in self.calls[c][1]}):
                port = self.ports[p]
                if port.active or not port.waiting or port.ready > t:
                    continue
                first = self.calls[port.waiting[0]][0]
                if port.group != first:
                    self._switch(port, first, t)
                    changed = True
        return out
