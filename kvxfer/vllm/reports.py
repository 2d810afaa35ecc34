"""What vLLM's workers report to its scheduler about kvxfer's transfers, and how many report.

Under a multi-process executor (tpu-inference's Ray executor: one worker per host), vLLM's
`KVOutputAggregator` merges every worker's output before the scheduler sees it: a request's
load is finished once as many workers as `get_finished_count` says have reported it, and
the workers' metadata are merged by `WorkerReport.aggregate`. kvxfer's own state never acts
on one worker's report alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvxfer.errors import InvalidInputError
from kvxfer.nixl.wire import Source
from kvxfer.plan.blocks import is_int

__all__ = ["VERIFIED_PER_REPORT", "WorkerReport", "worker_processes"]

VERIFIED_PER_REPORT = 16
"""P agents one worker's report names at most (more wait for its next reports)."""


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step it has news: P requests whose staging D has read (or
    whose lease expired), each with how many workers freed it; and, from every worker of a
    P whose caches span several processes (hosts), every P process's agent and the units of
    each block it stages (each worker knows them all, from the caches' sharding), which the
    scheduler names in the params. vLLM aggregates the workers' metadata (`aggregate`): the
    counts add up, so the scheduler reuses a request's slots only once every worker has
    freed its piece (one worker's report alone would hand slots another worker still
    serves to D to the next request).

    On D, `verified`: the P agents the worker completed a handshake with since its last
    report (a handshake proves an agent of that name answered; params name any), which
    D's scheduler side labels fallbacks with (`kvxfer.vllm.fallbacks`); each worker's are
    bounded (`VERIFIED_PER_REPORT`), the aggregate is their union.

    On a P with a host pool, every step, `pool_slots`: the staging slots its
    `host_pool_bytes` buys, and `slot_bytes`, each group's bytes of one slot; the
    aggregate takes the smallest budget, so an entry fits every worker's piece of it; and
    `pool_failed`: requests loaded from the pool and read from P at once, reported failed,
    whose pool half failed (its entries are dropped; a failed read from P alone keeps them),
    and `read_failed`, those whose read from P failed (a failure of the pool half alone is
    not P's: D's fallbacks count it apart). Their aggregates are unions. `pool_reset`: the
    worker's caches were reallocated (tpu-inference's `reinitialize_kv_cache`) and its host
    pool's slots dropped: the scheduler side clears the pool's index (any worker's says so)."""

    freed: dict[str, int] = field(default_factory=dict)
    sources: tuple[Source, ...] = ()
    units: int = 0
    verified: tuple[str, ...] = ()
    pool_slots: int = 0
    slot_bytes: tuple[int, ...] = ()
    pool_failed: tuple[str, ...] = ()
    read_failed: tuple[str, ...] = ()
    pool_reset: bool = False

    def __post_init__(self) -> None:
        # The scheduler adds the counts up to the number of P processes: a count of 0 or
        # below would hold a request's slots for ever (no worker frees it twice), one that
        # is no int would fail vLLM's scheduler at the next aggregate, far from the worker.
        if not isinstance(self.freed, dict) or not all(
                isinstance(r, str) and is_int(n) and n >= 1 for r, n in self.freed.items()):
            raise InvalidInputError(f"WorkerReport freed must map request ids (str) to "
                                    f"positive ints, got {self.freed!r:.120}")
        if not isinstance(self.sources, tuple) or not all(
                isinstance(s, Source) for s in self.sources):
            raise InvalidInputError(f"WorkerReport sources must be a tuple of Source, got "
                                    f"{self.sources!r:.120}")
        if not isinstance(self.slot_bytes, tuple) or not all(
                is_int(b) and b > 0 for b in self.slot_bytes):
            raise InvalidInputError(f"WorkerReport slot_bytes must be a tuple of positive ints, "
                                    f"got {self.slot_bytes!r:.80}")
        for name in ("units", "pool_slots"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise InvalidInputError(f"WorkerReport {name} must be an int >= 0, got "
                                        f"{getattr(self, name)!r}")
        if not isinstance(self.pool_reset, bool):
            raise InvalidInputError(f"WorkerReport pool_reset must be a bool, got "
                                    f"{self.pool_reset!r:.80}")
        for name in ("pool_failed", "read_failed"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(isinstance(r, str) for r in ids):
                raise InvalidInputError(f"WorkerReport {name} must be a tuple of request ids, "
                                        f"got {ids!r:.120}")
        if not isinstance(self.verified, tuple) or not all(
                isinstance(n, str) and n for n in self.verified):
            raise InvalidInputError(f"WorkerReport verified must be a tuple of P agent names "
                                    f"(non-empty str), got {self.verified!r:.120}")

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, WorkerReport):
            return self
        sources, units = (self.sources, self.units) if self.sources else (other.sources,
                                                                          other.units)
        freed = dict(self.freed)
        for req_id, n in other.freed.items():
            freed[req_id] = freed.get(req_id, 0) + n
        verified = tuple(dict.fromkeys(self.verified + other.verified))  # each name once
        pool = min((r.pool_slots, r.slot_bytes) for r in (self, other) if r.pool_slots) if (
            self.pool_slots or other.pool_slots) else (0, ())
        pool_failed = tuple(dict.fromkeys(self.pool_failed + other.pool_failed))
        read_failed = tuple(dict.fromkeys(self.read_failed + other.read_failed))
        return WorkerReport(freed, sources, units, verified, *pool, pool_failed=pool_failed,
                            read_failed=read_failed,
                            pool_reset=self.pool_reset or other.pool_reset)


def worker_processes(vllm_config: Any) -> int | None:
    """How many workers report each transfer: under a Ray executor, the placement group's
    bundles that hold the platform's devices (tpu-inference's executors place one worker
    per such bundle: one per host); None where vLLM's default (its world size, TP x PP)
    holds, or where no aggregator runs (one process)."""
    group = getattr(vllm_config.parallel_config, "placement_group", None)
    if group is None or os.environ.get("VLLM_RAY_BUNDLE_INDICES"):
        return None  # no Ray; or bundles chosen per rank: one worker per rank, the default
    from vllm.platforms import current_platform

    key = current_platform.ray_device_key
    workers = sum(1 for bundle in group.bundle_specs if key and bundle.get(key, 0))
    return workers or None
