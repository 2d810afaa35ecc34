"""Counters, timings and per-request traces of transfers: `Recorder`, `Stats`, `Trace`.

Collected where they happen, on the engine's thread, once per request or per
step (never per block): a `Trace` is one transfer's record (its phases, in
order, each a start and a duration; its bytes; its outcome), and
`Recorder.finish` folds it into the counters, per-phase totals and the
interval's series when the transfer ends, logs it at DEBUG as one JSON line
and keeps it in a bounded ring. `stats()` on a connector returns a `Stats`
(plain data: it crosses process boundaries as a dict). D's poster thread
writes only into its own read's objects, which the engine's thread reads
once the post is done.

Plain Python (no JAX, numpy or NIXL): vLLM's scheduler and metrics
processes import it.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["OUTCOMES", "Recorder", "Stats", "Trace"]

logger = logging.getLogger(__name__)

OUTCOMES = ("ok", "peer_gone", "deadline", "corruption", "binding", "refused",
            "lease_expired", "revoked", "other_process", "cancelled")
"""How a transfer ends: delivered, or why not (`<role>_failed_<outcome>` counts each failure
but `cancelled`, a read D gave up itself)."""

MAX_SERIES = 4096
"""Observations kept per series between two takes; beyond, they are counted in
`series_dropped` (totals and counts still include them)."""


@dataclass
class Trace:
    """One transfer of one request, on one side.

    - `req_id`: the request's id on this side (P's transfer id, D's request id);
      `p_req_id`: the id P named (both sides know it).
    - `role`: "P" or "D"; `p`, `d`: the P and D agent names (D's is known to P
      once D said done).
    - `started`: wall-clock start (seconds since the epoch); `phases`: in order,
      `[name, start, duration]`, start in seconds after `started`.
    - `bytes`: KV bytes staged (P) or read (D): blocks x block bytes;
      `wire_bytes`: what NIXL moved (with the fingerprint and tag rows; D);
      `blocks`, `descriptors`: their counts.
    - `outcome`: one of `OUTCOMES`, None while under way; `wall`: seconds from
      the trace's start to its end (its phases lie within).
    """

    req_id: str
    role: str
    p_req_id: str = ""
    p: str = ""
    d: str = ""
    started: float = field(default_factory=time.time)
    phases: list[list[Any]] = field(default_factory=list)
    bytes: int = 0
    wire_bytes: int = 0
    blocks: int = 0
    descriptors: int = 0
    outcome: str | None = None
    wall: float = 0.0
    _t0: float = field(default_factory=time.monotonic, repr=False)

    def phase(self, name: str, start: float, end: float | None = None) -> float:
        """Add phase `name` from monotonic time `start` to `end` (now when None); returns `end`."""
        end = time.monotonic() if end is None else end
        if start < self._t0 and not self.phases:  # begun before the trace was made
            self.started -= self._t0 - start
            self._t0 = start
        self.phases.append([name, round(start - self._t0, 6), round(max(end - start, 0.0), 6)])
        return end

    @property
    def stages(self) -> list[list[Any]]:
        """Deprecated: `phases` ("stage" means copying blocks into staging)."""
        warnings.warn("Trace.stages is now Trace.phases", DeprecationWarning, stacklevel=2)
        return self.phases

    def extend(self, name: str, start: float, end: float | None = None) -> None:
        """Phase `name` again (a request gathered over several steps, read and written in
        parts): one phase from its first start, whose duration is the sum of its parts."""
        end = time.monotonic() if end is None else end
        same = next((s for s in reversed(self.phases) if s[0] == name), None)
        if same is not None:
            same[2] = round(same[2] + max(end - start, 0.0), 6)
        else:
            self.phase(name, start, end)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["_t0"]
        return out


@dataclass
class Stats:
    """A connector's counters since it started, and optionally an interval's observations.

    - `counters`: name -> count (requests, bytes, failures by reason); see the README.
    - `totals`: series name -> sum of its observations since start (seconds, bytes).
    - `gauges`: name -> current value (staging slots in use, requests waiting).
    - `series`: series name -> the observations since the last take (for
      histograms); empty unless taken (`stats(take=True)`).
    """

    counters: dict[str, int] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    series: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Recorder:
    """Where a connector's counters, series and finished traces go (one per connector).

    **Arguments:**

    - `enabled`: False records nothing (`finish` only logs), for measuring the cost.
    - `ring`: how many finished traces `traces()` keeps.
    """

    def __init__(self, enabled: bool = True, ring: int = 256):
        self.enabled = enabled
        self.counters: dict[str, int] = {}
        self.totals: dict[str, float] = {}
        self.gauges: dict[str, float] = {}
        self._series: dict[str, list[float]] = {}
        self._ring: deque[Trace] = deque(maxlen=ring)

    def count(self, name: str, n: int = 1) -> None:
        if self.enabled:
            self.counters[name] = self.counters.get(name, 0) + n

    def observe(self, name: str, value: float) -> None:
        """One observation of series `name` (its total and count since start, and the
        interval's list)."""
        if not self.enabled:
            return
        self.totals[name] = self.totals.get(name, 0.0) + value
        self.counters[name + "_count"] = self.counters.get(name + "_count", 0) + 1
        series = self._series.setdefault(name, [])
        if len(series) < MAX_SERIES:
            series.append(value)
        else:
            self.counters["series_dropped"] = self.counters.get("series_dropped", 0) + 1

    def gauge(self, name: str, value: float) -> None:
        if self.enabled:
            self.gauges[name] = value

    def finish(self, trace: Trace, outcome: str | None = None) -> None:
        """A transfer ended: log its trace, keep it, fold it into the counters."""
        if outcome is not None:
            trace.outcome = outcome
        trace.outcome = trace.outcome or "ok"
        trace.wall = round(time.monotonic() - trace._t0, 6)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("kvxfer trace %s", json.dumps(trace.to_dict(), separators=(",", ":")))
        if not self.enabled:
            return
        self._ring.append(trace)
        role = trace.role.lower()
        if trace.outcome == "ok":
            self.count(f"{role}_requests_ok")
            self.count(f"{role}_bytes", trace.bytes)
            self.count(f"{role}_blocks", trace.blocks)
            if trace.wire_bytes:
                self.count(f"{role}_wire_bytes", trace.wire_bytes)
            if trace.descriptors:
                self.observe("d_read_descriptors", trace.descriptors)
            if trace.bytes:
                self.observe(f"{role}_request_bytes", trace.bytes)
        elif trace.outcome != "cancelled":
            self.count(f"{role}_requests_failed")
        if trace.outcome not in ("ok", "cancelled"):
            self.count(f"{role}_failed_{trace.outcome}")
        for name, _, duration in trace.phases:
            self.observe(f"{role}_{name}_s", duration)
        self.observe(f"{role}_wall_s", trace.wall)

    def stats(self, take: bool = False) -> Stats:
        """A copy of the counters, totals and gauges; with `take`, also the series since the
        last take (which then start afresh)."""
        series: dict[str, list[float]] = {}
        if take:
            series, self._series = self._series, {}
        return Stats(dict(self.counters), dict(self.totals), dict(self.gauges), series)

    def traces(self) -> list[Trace]:
        """The last finished traces, oldest first."""
        return list(self._ring)
