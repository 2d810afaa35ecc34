"""kvxfer's counters in vLLM: `KvxferStats` (the periodic log line) and `KvxferPromMetrics`
(`/metrics`).

Each step the worker side hands vLLM what changed since its last report
(`StatsDelta.take`: counter increments, the interval's observations, gauges
that moved), as a `KvxferStats` whose `data` is plain dicts, lists and
numbers (it crosses processes with msgspec/pickle). vLLM aggregates one per
worker and per step (`aggregate`), logs `reduce`'s summary every interval,
and hands the data to `KvxferPromMetrics.observe`. Gauges are kept per
source (a worker's agent, or the scheduler side), so summing workers and
taking a step's latest value do not mix. docs/observability.md lists every series.

Imports only vLLM's metric base classes (and prometheus_client through them),
as `kvxfer.vllm` does; no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvxfer.stats import OUTCOMES, Stats
from kvxfer.vllm.fallbacks import LOCAL, REASONS, parse_counter

__all__ = ["HISTOGRAMS", "KvxferPromMetrics", "KvxferStats", "StatsDelta", "StatsReporting"]


def _empty() -> dict[str, Any]:
    return {"counters": {}, "series": {}, "gauges": {}}


@dataclass
class KvxferStats(KVConnectorStats):
    """One or more reports: `{"counters": {name: increment}, "series": {name: [values]},
    "gauges": {source: {name: value}}}`."""

    def __post_init__(self) -> None:
        # A copy: vLLM hands one payload to several consumers, and `aggregate` adds to self.
        data = self.data
        self.data = {"counters": dict(data.get("counters", {})),
                     "series": {k: list(v) for k, v in data.get("series", {}).items()},
                     "gauges": {k: dict(v) for k, v in data.get("gauges", {}).items()}}

    def reset(self) -> None:
        self.data = _empty()

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in ("counters", "series", "gauges"))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add `other`'s counters, extend its series, and take its gauges per source (a later
        step of one source replaces its earlier values; other sources are added)."""
        theirs = other.data if isinstance(other, KVConnectorStats) else {}
        ours = self.data
        for name, n in theirs.get("counters", {}).items():
            ours["counters"][name] = ours["counters"].get(name, 0) + n
        for name, values in theirs.get("series", {}).items():
            ours["series"].setdefault(name, []).extend(values)
        for source, gauges in theirs.get("gauges", {}).items():
            ours["gauges"].setdefault(source, {}).update(gauges)
        return self

    def gauge(self, name: str) -> float:
        """A gauge summed over its sources."""
        return sum(g[name] for g in self.data["gauges"].values() if name in g)

    def reduce(self) -> dict[str, int | float]:
        """The interval in a few numbers, for vLLM's periodic log line."""
        counters, series = self.data["counters"], self.data["series"]
        out: dict[str, int | float] = {}
        for role in ("p", "d"):
            ok = counters.get(f"{role}_requests_ok", 0)
            failed = counters.get(f"{role}_requests_failed", 0)
            if ok or failed:
                out[f"{role.upper()} transfers"] = ok
                out[f"{role.upper()} failed"] = failed
                out[f"{role.upper()} MB"] = round(counters.get(f"{role}_bytes", 0) / 2**20, 3)
        for name, label in (("p_gather_s", "gather"), ("d_read_s", "read"),
                            ("d_wall_s", "KV wait")):
            values = series.get(name)
            if values:
                ordered = sorted(values)
                out[f"Avg {label} (ms)"] = round(1e3 * sum(values) / len(values), 3)
                out[f"P90 {label} (ms)"] = round(1e3 * ordered[int(0.9 * (len(ordered) - 1))], 3)
        read_s = sum(series.get("d_read_s", ()))
        if read_s > 0:
            out["Read throughput (MB/s)"] = round(counters.get("d_bytes", 0) / 2**20 / read_s, 3)
        fallbacks = {reason: 0 for reason in REASONS}
        for key, n in sorted(counters.items()):
            fallback = parse_counter(key)
            if fallback is not None:
                fallbacks[fallback[0]] += n
            elif n and "_failed_" in key:
                out[f"Failed {key.split('_failed_', 1)[1]} ({key[0].upper()})"] = n
        for reason, n in fallbacks.items():
            if n:
                out[f"Fallback {reason} (D)"] = n
        return out


class StatsDelta:
    """What changed in a connector's `Stats` since the last `take`: a `KvxferStats` payload.

    `source` names the gauges' owner (one per worker, or the scheduler side).
    """

    def __init__(self, source: str):
        self.source = source
        self._counters: dict[str, int] = {}
        self._gauges: dict[str, float] = {}

    def take(self, stats: Stats) -> KvxferStats | None:
        """The increments, the series (taken already) and the gauges that moved; None if
        nothing did."""
        counters = {k: v - self._counters.get(k, 0) for k, v in stats.counters.items()
                    if v != self._counters.get(k, 0)}
        gauges = {k: v for k, v in stats.gauges.items() if self._gauges.get(k) != v}
        self._counters, self._gauges = dict(stats.counters), dict(stats.gauges)
        if not (counters or gauges or stats.series):
            return None
        return KvxferStats({"counters": counters, "series": dict(stats.series),
                            "gauges": {self.source: gauges} if gauges else {}})


_TIMES = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
          30.0]
_BYTES = [2 ** (10 + i) for i in range(0, 25, 2)]  # 1 KiB to 4 GiB
_COUNTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]

HISTOGRAMS = {
    # metric (without the "vllm:kvxfer_" prefix): (series, buckets, documentation)
    "gather_time_seconds": ("p_gather_s", _TIMES, "P: time a request's blocks took to copy "
                            "from the device caches into host staging (summed over its chunks)"),
    "staged_time_seconds": ("p_staged_s", _TIMES, "P: time a request stayed staged, from its "
                            "hold until D's done (or its lease expiry)"),
    "handshake_time_seconds": ("d_handshake_s", _TIMES, "D: time a handshake with a P agent took"),
    "connect_time_seconds": ("d_connect_s", _TIMES, "D: time a request waited for its P to be "
                             "connected before its READ was posted"),
    "post_time_seconds": ("d_post_s", _TIMES, "D: time posting one READ took (on D's poster "
                          "thread; over UCX cma the copy itself)"),
    "read_time_seconds": ("d_read_s", _TIMES, "D: time from a request's first READ post until "
                          "every READ of it was done"),
    "ack_time_seconds": ("d_ack_s", _TIMES, "D: time from D's done until every P acked"),
    "scatter_time_seconds": ("d_scatter_s", _TIMES, "D: time the step's scatter of the request "
                             "into the device caches took, fingerprints checked"),
    "kv_wait_time_seconds": ("d_wall_s", _TIMES, "D: time a request waited for its KV, from "
                             "start_load_kv until reported finished or failed"),
    "bytes_transferred": ("d_request_bytes", _BYTES, "D: KV bytes read per request (blocks x "
                          "block bytes, every layer)"),
    "bytes_staged": ("p_request_bytes", _BYTES, "P: KV bytes staged per request (re-copied "
                     "blocks included)"),
    "num_descriptors": ("d_read_descriptors", _COUNTS, "D: NIXL descriptors per request"),
    "pool_load_time_seconds": ("p_pool_load_s", _TIMES, "P, or a D with a host pool: time a "
                               "step's loads from the pool into the device caches took, "
                               "fingerprints checked"),
}

_GAUGES = {
    "staging_slots_in_use": ("p_staging_slots_in_use", "d_staging_slots_in_use",
                             "Host staging slots holding a request's blocks"),
    "requests_held": ("p_requests_held", None, "P: requests held for D (staged, lease live)"),
    "requests_waiting": (None, "d_requests_waiting", "D: requests waiting for their KV "
                         "(accepted, or being read)"),
    "pool_blocks": ("p_pool_blocks", "d_pool_blocks", "Blocks the host pool holds (every "
                    "group's)"),
    "pool_bytes": ("p_pool_bytes", "d_pool_bytes", "Host staging bytes the pool's blocks hold"),
    "pool_capacity_tokens": ("p_pool_capacity_tokens", "d_pool_capacity_tokens",
                             "Tokens of a prompt the host pool can hold at most (its budget)"),
}


class KvxferPromMetrics(KVConnectorPromMetrics):
    """kvxfer's Prometheus series (`vllm:kvxfer_*`), with the engine's labels; counters and
    gauges add a `role` label (`P`, `D`), failures a `reason` (`kvxfer.stats.OUTCOMES`)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.histograms = {
            series: self._histogram_cls(name=f"vllm:kvxfer_{name}", documentation=doc,
                                        buckets=buckets, labelnames=labelnames)
            for name, (series, buckets, doc) in HISTOGRAMS.items()}
        role = [*labelnames, "role"]
        self.transfers = self._counter_cls(
            name="vllm:kvxfer_num_transfers", labelnames=role,
            documentation="Requests whose KV was delivered (D) or read by D (P)")
        self.failed = self._counter_cls(
            name="vllm:kvxfer_num_failed_transfers", labelnames=[*role, "reason"],
            documentation="Requests whose transfer failed, by reason: peer_gone, deadline, "
                          "corruption, binding, refused, lease_expired, other_process")
        self.kv_bytes = self._counter_cls(
            name="vllm:kvxfer_kv_bytes", labelnames=role,
            documentation="KV bytes of finished transfers, blocks x block bytes: read into D's "
                          "caches (D); staged, re-copied straddling blocks included (P)")
        self.recomputed = self._counter_cls(
            name="vllm:kvxfer_num_recomputed_blocks", labelnames=labelnames,
            documentation="D: blocks reported for recomputation (failed loads)")
        self.dropped = self._counter_cls(
            name="vllm:kvxfer_num_dropped_messages", labelnames=role,
            documentation="Messages from peers dropped: malformed, of a type this side does "
                          "not take, or that it could not answer (each peer's logged at most "
                          "once a minute per reason)")
        self.pool_hits = self._counter_cls(
            name="vllm:kvxfer_pool_hit_tokens", labelnames=[*role, "source"],
            documentation="Prompt tokens loaded instead of computed, by where they came from "
                          "(own_pool: this instance's host pool); vLLM's own "
                          "vllm:prefix_cache_hits counts the device's")
        self.evictions = self._counter_cls(
            name="vllm:kvxfer_pool_evicted_blocks", labelnames=role,
            documentation="Blocks evicted from the host pool (least recently used first)")
        self.handshakes = self._counter_cls(
            name="vllm:kvxfer_num_failed_handshakes", labelnames=labelnames,
            documentation="D: handshakes with a P agent that failed")
        self.local_prefills = self._counter_cls(
            name="vllm:kvxfer_num_local_prefills", labelnames=labelnames,
            documentation="D: requests a router sent to D alone to prefill (kvxfer proxy's "
                          "local choice: D held all but a short suffix of the prompt); no "
                          "fallback")
        self.fallbacks = self._counter_cls(
            name="vllm:kvxfer_num_fallbacks", labelnames=[*labelnames, "reason", "p_engine"],
            documentation="D: requests whose prompt D computed itself instead of loading P's "
                          "KV, by reason (no_params, below_threshold, other_prompt, forged, "
                          "load_failed, pool_failed) and P engine (P's agent name once D "
                          "completed a handshake with it, else unverified; none without "
                          "params or for D's own pool)")
        self.gauges = {
            name: self._gauge_cls(name=f"vllm:kvxfer_{name}", documentation=doc,
                                  multiprocess_mode="mostrecent", labelnames=role)
            for name, (_, _, doc) in _GAUGES.items()}
        self._gauge_sources: dict[int, dict[str, dict[str, float]]] = {}  # engine -> source

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        stats = KvxferStats(transfer_stats_data)
        for series, values in stats.data.get("series", {}).items():
            histogram = self.histograms.get(series)
            if histogram is not None:
                child = histogram.labels(*labels)
                for value in values:
                    child.observe(value)
        counters = stats.data.get("counters", {})
        for role in ("p", "d"):
            r = role.upper()
            _inc(self.transfers, [*labels, r], counters.get(f"{role}_requests_ok", 0))
            _inc(self.kv_bytes, [*labels, r], counters.get(f"{role}_bytes", 0))
            _inc(self.dropped, [*labels, r], counters.get(f"{role}_messages_dropped", 0))
            for reason in OUTCOMES:
                _inc(self.failed, [*labels, r, reason], counters.get(f"{role}_failed_{reason}", 0))
        _inc(self.recomputed, labels, counters.get("d_recompute_blocks", 0))
        for role in ("p", "d"):  # each instance's own pool (a D's: what it decoded)
            r = role.upper()
            _inc(self.pool_hits, [*labels, r, "own_pool"], counters.get(f"{role}_pool_hit_tokens", 0))
            _inc(self.evictions, [*labels, r], counters.get(f"{role}_pool_evicted_blocks", 0))
        _inc(self.handshakes, labels, counters.get("d_handshake_failures", 0))
        _inc(self.local_prefills, labels, counters.get(LOCAL, 0))
        for key, n in counters.items():
            fallback = parse_counter(key)
            if fallback is not None:
                _inc(self.fallbacks, [*labels, *fallback], n)
        sources = self._gauge_sources.setdefault(engine_idx, {})
        for source, gauges in stats.data.get("gauges", {}).items():
            sources.setdefault(source, {}).update(gauges)
        for name, (p_name, d_name, _) in _GAUGES.items():
            for r, key in (("P", p_name), ("D", d_name)):
                values = [g[key] for g in sources.values() if key in g]
                if values:
                    self.gauges[name].labels(*labels, r).set(sum(values))


def _inc(counter: Any, labels: list[object], n: float) -> None:
    if n > 0:
        counter.labels(*labels).inc(n)


class StatsReporting:
    """`TPUConnector`'s stats methods (a base class of it, before vLLM's).

    Worker side: what each of the worker's connectors (P's `PrefillWorker`, D's
    `DecodeConnector`) changed since the last step; scheduler side: P's staging
    slots in use and requests held for D (`PrefillScheduler.gauges`), and D's
    fallbacks (`kvxfer.vllm.fallbacks`).
    """

    def get_kv_connector_stats(self) -> KvxferStats | None:
        deltas: dict[str, StatsDelta] = self.__dict__.setdefault("_kvxfer_deltas", {})
        out = None
        for source, stats in _sources(self):
            delta = deltas.setdefault(source, StatsDelta(source)).take(stats)
            if delta is not None:
                out = delta if out is None else out.aggregate(delta)
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvxferStats:
        return KvxferStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KvxferPromMetrics:
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _sources(connector: Any) -> list[tuple[str, Stats]]:
    """`(source, stats)` of a `TPUConnector`'s side (`kvxfer.vllm`'s `_WorkerSide` or
    `_SchedulerSide`), series taken."""
    worker = getattr(connector, "_worker", None)
    if worker is not None:  # a D with a pool (or kv_both) runs both, maybe under one agent name
        return [(f"{name}/{role}", side.stats(take=True)) for role, name, side in (
            ("prefill", worker._prefill and worker._prefill.name, worker._prefill),
            ("decode", worker._decode and worker._decode.transport.config.name, worker._decode))
            if side is not None]
    scheduler = getattr(connector, "_scheduler", None)
    if scheduler is None:
        return []
    prefill, fallbacks = scheduler.prefill, getattr(scheduler, "fallbacks", None)
    if prefill is None and fallbacks is None:
        return []
    counters = dict(fallbacks.counters) if fallbacks else {}
    gauges = {}
    if prefill is not None:
        counters.update(prefill.pools.counters())
        gauges = prefill.gauges(scheduler.pool_slot_bytes)
        gauges.pop("p_pool_slots", None)  # as p_pool_bytes
        if not scheduler.producer:  # a D's host pool alone: its series are D's
            counters = {k.replace("p_pool_", "d_pool_"): v for k, v in counters.items()}
            gauges = {k.replace("p_pool_", "d_pool_"): v for k, v in gauges.items()
                      if k.startswith("p_pool_")}
    return [("scheduler", Stats(counters=counters, gauges=gauges))]
