"""`TPUConnector`'s worker side: tpu-inference's runner, its caches, the transfers.

`register_runner` starts P's `PrefillWorker` and D's `DecodeConnector` on the runner's
`kv_caches` (JAX and NIXL load here); each step it carries out the scheduler side's
`KvxferMetadata` (P saves, D loads) and reports back in a `WorkerReport`. The protocol is
narrated in `kvxfer.vllm.connector`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvxfer.errors import InvalidInputError, KvxferError
from kvxfer.vllm.reports import VERIFIED_PER_REPORT, WorkerReport
from kvxfer.vllm.settings import Settings

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvxfer.vllm.scheduler_side import KvxferMetadata


logger = logging.getLogger(__name__)

__all__ = ["SPOILED", "WorkerSide"]

SPOILED = 0xA5A5A5A5
"""What a staging slot's fingerprints are set to when the caches are reallocated: no block's
(an all-zero block's are 0), so whatever the slot held fails its check."""


class WorkerSide:
    """vLLM's worker-side calls on P (`PrefillWorker`) and D (`DecodeConnector`)."""

    def __init__(self, settings: Settings, kv_cache_config: KVCacheConfig,
                 model: Mapping[str, Any], producer: bool, consumer: bool,
                 instance: str | None = None):
        self.settings = settings
        self.kv_cache_config = kv_cache_config
        self.model = model
        self.producer, self.consumer = producer, consumer
        self.runner: Any = None
        self._indices: list[list[int]] = []
        self.instance = instance
        self._prefill: Any = None  # PrefillWorker, started with the runner
        self._decode: Any = None  # DecodeConnector
        self._freed: set[str] = set()
        self._kept: set[str] = set()  # gathered into the pool, the engine not yet told
        self._pool_loads: dict[str, Any] = {}  # P: this step's loads from the pool
        # D: requests loaded from its pool and read from P at once -> halves done (failed?)
        self._halves: dict[str, dict[str, bool]] = {}
        self._pool_failed: set[str] = set()  # of those, reported, their pool half failed
        self._read_failed: set[str] = set()  # of those, reported, their read from P failed
        self._verified: set[str] = set()  # D: P agents named in a report already
        self._pool_reset = False  # the caches were reallocated since the last report
        self._registered: list[Any] = []  # the caches' layouts at the first register_runner

    def register_runner(self, runner: Any) -> None:
        """Start P's and D's worker parts on the runner's caches. Called again when
        tpu-inference reallocates the caches (`reinitialize_kv_cache`, after a weight sync):
        the parts stay (their agents, staging and peers), the new caches must be laid out as
        the first were, and what the host pool held is dropped (`_drop_pool`)."""
        index = runner.layer_name_to_kvcache_index
        indices = []
        for g, group in enumerate(self.kv_cache_config.kv_cache_groups):
            missing = [n for n in group.layer_names if n not in index]
            if missing:
                raise InvalidInputError(f"KV cache group {g} layers {missing[:4]} are not in the "
                                        f"runner's layer_name_to_kvcache_index")
            indices.append(list(dict.fromkeys(index[n] for n in group.layer_names)))
        again = self.runner is not None
        self.runner, self._indices = runner, indices
        if again:
            now = self._layouts()
            if now != self._registered:
                raise InvalidInputError(f"the runner was registered again with caches laid out "
                                        f"otherwise: {now!r:.300}, were {self._registered!r:.300}; "
                                        f"restart the engine to change the KV cache layout")
            self._drop_pool()
            return
        self._registered = self._layouts()
        config = self.settings.connector_config(self.producer)
        pool = bool((self.model.get("hashing") or {}).get("pool"))  # what kinds of group allow
        if self.producer or (config.host_pool_bytes and pool):  # at start-up: a bad setting fails the
            from kvxfer.connector.prefill import PrefillWorker  # engine's start, not a step

            # P's staging, served to D; a D's host pool alone (what it decoded), served to none
            self._prefill = PrefillWorker(config, self._caches(), self.instance,
                                          model=self.model, serve=self.producer)
        if self.consumer:
            from kvxfer.connector.decode import DecodeConnector

            self._decode = DecodeConnector(self.settings.connector_config(False), self._caches(),
                                           model=self.model)

    def _layouts(self) -> list[Any]:
        from kvxfer.device.layout import CacheLayout

        ratio = self.settings.connector_config(self.producer).kernel_ratio
        return [CacheLayout.from_caches(group, ratio) for group in self._caches()]

    def _drop_pool(self) -> None:
        """The caches were reallocated (a weight sync, as a rule): no block staged before may
        reach a cache again. Every staging slot's fingerprints are spoiled, so a load or read
        of one fails its check (the request is computed), and the next report has the
        scheduler side clear the pool's index (`WorkerReport.pool_reset`)."""
        for side in (self._prefill, self._decode):
            for staging in getattr(side, "stagings", None) or ():
                staging.prints[...] = SPOILED
        if self._prefill is not None and self._prefill.pool_slots:
            self._pool_reset = True
            logger.warning("the KV caches were reallocated: the host pool's %d slots are "
                           "dropped", self._prefill.pool_slots)

    def _caches(self) -> list[list[Any]]:
        caches = self.runner.kv_caches  # donated by every forward: read afresh at each use
        return [[caches[i] for i in indices] for indices in self._indices]

    def _store(self, per_group: list[list[Any]]) -> None:
        caches = list(self.runner.kv_caches)
        for indices, arrays in zip(self._indices, per_group):
            for i, array in zip(indices, arrays):
                caches[i] = array
        self.runner.kv_caches = caches

    def start_load(self, meta: KvxferMetadata) -> None:
        self._pool_loads.update(meta.pool_loads)  # loaded after the forward, in poll
        self._halves.update((r, {}) for r in meta.pool_loads if r in meta.loads)
        for what, params in [*(("expect", p) for p in meta.expects),
                             *(("cancel", p) for p in meta.cancels)]:
            try:
                getattr(self._decode, what)(params)
            except KvxferError as e:  # the load itself fails the request, by its own rules
                logger.warning("D cannot %s a request's params: %s", what, e)
        if meta.loads:
            self._decode.start_load_kv(meta.loads)

    def save(self, meta: KvxferMetadata) -> None:
        save = meta.save
        if save is None:
            return
        if save.blocks or save.holds or save.cancels or save.revoke:  # a cancel frees slots
            self._prefill.save(self._caches(), save)
            self._kept.update(save.keeps)

    def poll(self) -> tuple[set[str], set[str], set[str]]:
        """This step's finished transfers: the finished requests whose blocks went into the
        host pool (`SaveMeta.keeps`: the engine may free their device blocks), the requests
        whose loads finished, and those of them that failed: from the pool (loaded here,
        after the forward: those requests wait, the engine does not), D's from P."""
        sent, received, failed = set(), set(), set()
        if self._prefill is not None:
            freed = self._prefill.poll()
            self._freed.update(freed)
            sent = self._kept & set(freed)
            self._kept -= sent
            received, failed = self._load_pooled()
        if self._decode is None:
            return sent, received, failed
        caches, finished, bad = self._decode.get_finished(self._caches())
        self._store(caches)  # the old arrays are donated once anything was scattered
        received, failed = self._whole(received, failed, set(finished), set(bad))
        return sent, received, failed

    def _whole(self, pooled: set[str], pool_failed: set[str], read: set[str],
               read_failed: set[str]) -> tuple[set[str], set[str]]:
        """D: the requests whose loads finished, and those that failed, once both halves of a
        request loaded from D's pool and read from P are done (failed if either failed)."""
        pooled, read = pooled | pool_failed, read | read_failed
        received = (pooled | read) - self._halves.keys()
        failed = (pool_failed | read_failed) - self._halves.keys()
        for r in (pooled | read) & self._halves.keys():
            halves = self._halves[r]
            if r in pooled:
                halves["pool"] = r in pool_failed
            if r in read:
                halves["read"] = r in read_failed
            if len(halves) == 2:
                del self._halves[r]
                received.add(r)
                if halves["pool"]:
                    self._pool_failed.add(r)  # the scheduler side drops its entries
                if halves["read"]:
                    self._read_failed.add(r)  # what the failure is counted against: P
                if any(halves.values()):
                    failed.add(r)
        return received, failed

    def _load_pooled(self) -> tuple[set[str], set[str]]:
        loads, self._pool_loads = self._pool_loads, {}
        gone = {r for r, load in loads.items() if load is None}
        loads = {r: load for r, load in loads.items() if load is not None}
        bad: list[str] = []
        if loads:
            caches, bad = self._prefill.load(self._caches(), loads)
            self._store(caches)
        return set(loads) | gone, set(bad) | gone

    def load_errors(self) -> set[int]:
        return self._decode.get_block_ids_with_load_errors() if self._decode else set()

    def report(self) -> WorkerReport | None:
        """This step's news for the scheduler: the requests freed since the last report;
        on a P across hosts, every step, every P process's agent and units; on D, the P
        agents it completed a handshake with since (what labels fallbacks)."""
        freed, self._freed = self._freed, set()
        pool_failed, self._pool_failed = tuple(sorted(self._pool_failed)), set()
        read_failed, self._read_failed = tuple(sorted(self._read_failed)), set()
        reset, self._pool_reset = self._pool_reset, False
        prefill = self._prefill
        counts = dict.fromkeys(freed, 1)  # this worker's: the aggregate adds every worker's
        names = self._decode.transport.peers.verified_names() if self._decode else ()
        verified = tuple(n for n in names if n not in self._verified)[:VERIFIED_PER_REPORT]
        self._verified.update(verified)  # the rest: in the next reports
        pool = (prefill.pool_slots, tuple(prefill.slot_bytes)) if prefill is not None else (0, ())
        if prefill is not None and (prefill.sources or prefill.pool_slots):
            return WorkerReport(counts, tuple(prefill.sources), prefill.units, verified, *pool,
                                pool_failed=pool_failed, read_failed=read_failed,
                                pool_reset=reset)
        return WorkerReport(counts, verified=verified) if counts or verified else None

    def close(self) -> None:
        for side in (self._prefill, self._decode):
            if side is not None:
                side.close()
