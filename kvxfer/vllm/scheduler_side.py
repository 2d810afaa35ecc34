"""`TPUConnector`'s scheduler side: vLLM's scheduler process, no caches, no device.

On P, `PrefillScheduler` turns each `SchedulerOutput` into save plans and staging slots,
and a request whose prefill completes into the params `request_finished` returns. On D it
answers `get_num_new_matched_tokens`, counts what D computes itself (`Fallbacks`) and,
after allocation, tells the worker side what to load (`DecodeLoads`). Its one message to
the workers is `KvxferMetadata`; theirs back is `WorkerReport` (`kvxfer.vllm.reports`). The protocol is
narrated in `kvxfer.vllm.connector`.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvxfer.connector.scheduler import LoadRequest, PeerAddress, PrefillScheduler, SaveMeta
from kvxfer.errors import InvalidInputError, KvxferError
from kvxfer.nixl.wire import Source, hash_hex, is_stream_id, sign_params
from kvxfer.plan.save_plan import GroupSpec, ScheduledRequest
from kvxfer.vllm.decode_loads import DecodeLoads, asks, prompt_extra
from kvxfer.vllm.events import event_labels, vllm_events
from kvxfer.vllm.fallbacks import Fallbacks
from kvxfer.vllm.reports import WorkerReport
from kvxfer.vllm.settings import Settings

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


logger = logging.getLogger(__name__)

__all__ = ["DecodeLoads", "KvxferMetadata", "SchedulerSide", "event_labels", "group_hashes", "keep",
           "scheduled_requests", "vllm_events"]


def scheduled_requests(so: SchedulerOutput) -> list[ScheduledRequest]:
    """Each request of a `SchedulerOutput`, as the save planner reads it (pre-step counts).

    New requests and resumed ones carry their whole table; running ones the
    blocks added this step (None when no group got one).
    """
    out = [ScheduledRequest(r.req_id, r.num_computed_tokens, so.num_scheduled_tokens[r.req_id],
                            tuple(map(list, r.block_ids)), full_table=True)
           for r in so.scheduled_new_reqs]
    cached = so.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        out.append(ScheduledRequest(
            req_id, cached.num_computed_tokens[i], so.num_scheduled_tokens[req_id],
            None if new_ids is None else tuple(map(list, new_ids)),
            full_table=req_id in cached.resumed_req_ids))
    return out


@dataclass
class KvxferMetadata(KVConnectorMetadata):
    """Scheduler -> worker, each step: P's saves; D's loads."""

    save: SaveMeta | None = None
    loads: dict[str, LoadRequest] = field(default_factory=dict)
    # P: requests loading their prompt's pooled blocks, per group (kernel ids, slots); None:
    # the blocks went between the match and the allocation (the worker fails the load)
    pool_loads: dict[str, list[tuple[list[int], list[int]]] | None] = field(default_factory=dict)
    expects: list[dict[str, Any]] = field(default_factory=list)  # D: accepted, not yet loaded
    cancels: list[dict[str, Any]] = field(default_factory=list)  # D: expected, then dropped


class SchedulerSide:
    """vLLM's scheduler-side calls: P's save plans, slots and params (`prefill`), the host
    pool's matches and loads on any instance with one, and on D its reads from P (`reads`)."""

    def __init__(self, settings: Settings, groups: Sequence[GroupSpec], producer: bool,
                 consumer: bool, instance: str | None = None, recompute: bool = True,
                 hash_block_size: int | None = None, events: bool = True):
        if not isinstance(events, bool):  # a truthy string would copy every prompt for nothing
            raise InvalidInputError(f"events must be a bool, got {events!r:.80}")
        self.groups = list(groups)
        self.consumer, self.producer = consumer, producer
        # a reader (D, or kv_both): requests it computes itself instead of loading, counted
        self.fallbacks = Fallbacks(recompute) if consumer else None
        config = settings.connector_config(producer)
        # with a fleet key, params are issued under its MAC and taken only with it
        self._keys, self._lease_s = config.transport.fleet_keys, config.transport.lease_s
        self.reads = (DecodeLoads(groups, settings.kv_recompute_threshold, self.fallbacks,
                                  self._keys) if consumer else None)
        # P's staging and params; on a D with a host pool, the pool alone (what it decoded)
        self.prefill = PrefillScheduler(
            groups, staging_blocks=config.staging_blocks, kernel_ratio=config.kernel_ratio,
            address=PeerAddress(config.transport.name, settings.host, settings.p_port),
            instance=instance,
            # the workers say how many slots host_pool_bytes is (WorkerReport.pool_slots)
            pool_slots=config.staging_blocks if config.host_pool_bytes else 0,
        ) if producer or config.host_pool_bytes else None
        self._hash_block = hash_block_size or self.groups[0].tokens_per_block
        if self.prefill is not None and self.prefill.pools.pools and not recompute:
            logger.warning("the host pool is on under kv_load_failure_policy 'fail': a pooled "
                           "block that fails its check fails its request instead of being "
                           "recomputed; 'recompute' computes it")
        self._pooled: dict[str, tuple[int, int]] = {}  # P: request -> (computed, pooled run)
        self._pool_loads: dict[str, list[tuple[list[int], list[int]]] | None] = {}
        self._pool_loading: set[str] = set()  # P: handed to the worker, not yet reported
        self._receiving: set[str] = set()  # loading (from P or a pool), not yet reported
        self._sources: dict[str, dict[str, int]] = {}  # request -> its loaded tokens by source
        # D: requests loaded from its pool and read from P at once; those whose pool half failed
        self._split: set[str] = set()
        self._pool_failed: set[str] = set()
        self.pool_slot_bytes: tuple[int, ...] = ()  # P: each group's bytes of a slot (workers')
        if self.prefill is not None:
            self.prefill.pools.resize(0)  # keeps nothing until the workers say how much
            # vLLM's scheduler takes them every step, and publishes them where its
            # --kv-events-config enables KV cache events (off: none are made)
            self.prefill.pools.events = events
        # P: vLLM's request id -> the transfer id P plans, stages and names in params. A
        # request id P still holds for D (a proxy that reuses X-Request-Id, a retry) gets a
        # transfer id of its own, so the two prefills never share slots or params.
        self._transfers: dict[str, str] = {}
        self._reuses = itertools.count(1)
        self._refused_sources: tuple[tuple[Source, ...], int] = ((), 0)  # P: logged already
        self._frees: dict[str, int] = {}  # P: request -> P processes that freed it so far

    def matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        """vLLM's `get_num_new_matched_tokens`: on D, the prompt P names in the params (less
        what D's device and pool hold); otherwise, and where D takes no params, the run this
        instance's host pool holds."""
        if self.reads is None:
            params = request.kv_transfer_params
            if params and params.get("kv_source") is not None:  # its peer's lease lapses
                params["kv_source"] = None
                logger.warning("request %s: kv_source ignored: this instance does not read "
                               "(kv_role %s; a reader is kv_consumer or kv_both)",
                               request.request_id, "kv_producer" if self.producer else "none")
            return self._pool_match(request, num_computed)
        return self.reads.matched(request, num_computed, self._pool_match, self.chain)

    def chain(self, request: Request, num_tokens: int) -> list[str | None]:
        """Per group, the block hash (hex) of the last full block of the request's first
        `num_tokens` tokens (None for none): what binds params to a prompt's hash chain, its
        cache salt, LoRA adapter and multimodal inputs included, beside its token digest."""
        return [None if not hashes else hash_hex(hashes[-1])
                for hashes in self._block_hashes(request, num_tokens)]

    def _pool_match(self, request: Request, num_computed: int) -> tuple[int, bool]:
        """The prompt tokens past the device hit that this instance's host pool holds (a
        hash-chain match), loaded asynchronously; the prompt's last token is always computed."""
        req_id = request.request_id
        self._pooled.pop(req_id, None)
        if self.prefill is None or not self.prefill.pools.pools:
            return 0, False
        step = math.lcm(*(g.tokens_per_block for g in self.groups))
        limit = (request.num_prompt_tokens - 1) // step * step - num_computed
        count = min(self.prefill.pools.match(self._block_hashes(request), num_computed), limit)
        if count <= 0:
            return 0, False
        self._pooled[req_id] = (num_computed, count)
        return count, True

    def _block_hashes(self, request: Request, num_tokens: int | None = None) -> list[list[Any]]:
        return group_hashes(request, self.groups, self._hash_block, num_tokens)

    def _acquire_pooled(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        req_id = request.request_id
        computed, count = self._pooled.pop(req_id)
        end = self.reads.read_end(req_id) if self.reads is not None else None
        if end is not None:  # the rest read from P (or a kv_source)
            num_external -= end - computed - count
            self._split.add(req_id)
        try:
            if num_external != count:
                raise InvalidInputError(f"vLLM allocated {num_external} external tokens for "
                                        f"{req_id}, the pool matched {count}")
            self._pool_loads[req_id] = self.prefill.pools.load(
                req_id, self._block_hashes(request), computed, count,
                [list(ids) for ids in blocks.get_block_ids()])
            self._sources[req_id] = {"host": count}
        except KvxferError as e:  # the worker fails it: vLLM computes it (or fails it)
            logger.warning("P request %s cannot load from its pool: %s", req_id, e)
            self._pool_loads[req_id] = None

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        if num_external > 0:
            self._receiving.add(request.request_id)
        if request.request_id in self._pooled and num_external > 0:
            self._acquire_pooled(request, blocks, num_external)
        params = request.kv_transfer_params
        if not params:
            return
        if self.producer and asks(params, "do_remote_decode", request.request_id):
            req_id = request.request_id
            if req_id not in self._transfers and not params.get("_kvxfer_planned"):
                transfer = req_id
                while self.prefill.holds(transfer):
                    transfer = f"{req_id}~{next(self._reuses)}"
                hashes, tokens, labels = None, None, None
                if self.prefill.pools.pools:
                    hashes = self._block_hashes(request)
                if self.prefill.pools.events:  # the events name tokens as vLLM's own do
                    tokens = list(request.all_token_ids[:request.num_prompt_tokens])
                    labels = event_labels(request, self.groups, request.num_prompt_tokens)
                extra = prompt_extra(request)  # what the prompt's digest folds in beside ids
                try:
                    self.prefill.add_request(transfer, request.num_prompt_tokens,
                                             request.prompt_token_ids, _stream(params, req_id),
                                             hashes, tokens, labels, extra)
                except InvalidInputError as e:  # a stream id another request holds (a retry)
                    logger.warning("P request %s is not streamed: %s", req_id, e)
                    self.prefill.add_request(transfer, request.num_prompt_tokens,
                                             request.prompt_token_ids, block_hashes=hashes,
                                             event_token_ids=tokens, labels=labels,
                                             prompt_extra=extra)
                self._transfers[req_id] = transfer
                params["_kvxfer_planned"] = True  # once: a resumed request is replanned in place
        if self.reads is not None:
            pooled = self._sources.get(request.request_id, {}).get("host", 0)
            sources = self.reads.after_alloc(
                request, blocks, num_external, pooled,
                lambda: [[hash_hex(h) for h in g] for g in self._block_hashes(request)])
            if sources is not None:
                self._sources[request.request_id] = sources

    def build(self, so: SchedulerOutput) -> KvxferMetadata:
        meta = KvxferMetadata()
        if self.prefill is not None:
            meta.save = self.prefill.build_connector_meta(
                [replace(s, req_id=self._transfers[s.req_id]) if s.req_id in self._transfers else s
                 for s in scheduled_requests(so)])
        if self.reads is not None:
            self.reads.take(meta)
        meta.pool_loads, self._pool_loads = self._pool_loads, {}
        self._pool_loading.update(meta.pool_loads)
        return meta

    def update_connector_output(self, output: Any) -> None:
        """The workers' news of a step (vLLM's `KVConnectorOutput`, every worker's merged):
        D's received and failed loads and verified P agents; P's freed requests and sources."""
        meta = output.kv_connector_worker_meta
        failed = set(getattr(output, "failed_recving", None) or ())
        self._receiving -= {*(output.finished_recving or ()), *failed}
        read_failed: set[str] = set()
        if isinstance(meta, WorkerReport):
            self._pool_failed.update(meta.pool_failed)
            read_failed.update(meta.read_failed)
            if meta.pool_reset and self.prefill is not None:  # its slots' bytes are gone
                logger.warning("the workers reallocated their KV caches: the host pool's %d "
                               "entries are dropped", self.prefill.pools.entries())
                self.prefill.pools.clear()
        pool_only = set()  # split requests that failed in their pool half alone: not P's
        for req_id in self._pool_loading & {*(output.finished_recving or ()), *failed}:
            self._pool_loading.discard(req_id)
            # a request also read from P failed where either half did: the pool's is told apart
            bad = req_id in self._pool_failed if req_id in self._split else req_id in failed
            if req_id in self._split and bad and req_id not in read_failed:
                pool_only.add(req_id)
            self._split.discard(req_id)
            self._pool_failed.discard(req_id)
            # a failed request is computed whole (vLLM): its pooled part was no hit either
            self.prefill.pools.loaded(req_id, failed=bad, hit=req_id not in failed)
        if self.fallbacks is not None:  # P agents verified first: this step's loads
            self.fallbacks.verified(meta.verified if isinstance(meta, WorkerReport) else ())
            self.fallbacks.loaded(output.finished_recving or (),
                                  getattr(output, "failed_recving", ()), pool_only)
        if isinstance(meta, WorkerReport):
            self.learn_sources(meta.sources, meta.units)
            if meta.pool_slots and self.prefill is not None:  # before freed requests pool
                self.prefill.pools.resize(meta.pool_slots)
                self.pool_slot_bytes = meta.slot_bytes
            self.release(meta.freed)

    def release(self, freed: Mapping[str, int]) -> None:
        """Reuse the slots of the requests every P process has freed (each worker of a P
        across hosts frees its own piece: `WorkerReport.freed` counts them)."""
        if self.prefill is None:
            return
        processes = max(1, len(self.prefill.sources))
        held = set(self.prefill.held())
        counts = {r: n for r, n in self._frees.items() if r in held}  # the rest: gone
        for req_id, n in freed.items():
            counts[req_id] = counts.get(req_id, 0) + n
        done = {r for r, n in counts.items() if n >= processes}
        self._frees = {r: n for r, n in counts.items() if r not in done}
        self.prefill.release(done)

    def learn_sources(self, sources: tuple[Source, ...], units: int) -> None:
        """Name every P process and its units in the params from now on. Until the workers'
        first output arrives (one step, two under asynchronous scheduling), params name none:
        D then reads from P's one agent, which a P in one process is; a P across hosts has
        no agent of that name, so D recomputes such a request (within its handshake
        timeout)."""
        if (self.prefill is None or not sources
                or (sources, units) in ((self.prefill.sources, self.prefill.units),
                                        self._refused_sources)):
            return
        try:
            self.prefill.use_sources(sources, units)
        except InvalidInputError as e:  # the engine goes on; D fails what it cannot read
            self._refused_sources = (sources, units)  # logged once, not at every step
            logger.error("P's workers reported sources the params cannot name: %s", e)
            return
        if len(sources) > 1 and self.producer:  # a D's pool: counted, never named
            logger.info("P spans %d processes: params name %s", len(sources),
                        [s.peer for s in sources])

    def finished(self, request: Request, block_ids: Sequence[Sequence[int]] | None = None
                 ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's `request_finished`: whether the engine keeps the request's device blocks
        until the workers report it sent (its blocks are being gathered into the host
        pool), and the params P hands D."""
        if self.reads is not None:
            self.reads.finished(request.request_id)
        self._pooled.pop(request.request_id, None)
        self._sources.pop(request.request_id, None)
        if self.prefill is None:
            return False, None
        transfer = self._transfers.pop(request.request_id, None)
        receiving = request.request_id in self._receiving
        self._receiving.discard(request.request_id)
        if transfer is None and not receiving:  # what it computed may enter the pool
            return keep(self.prefill, request, block_ids, self.groups, self._hash_block), None
        if transfer is None:
            return False, None
        params = self.prefill.request_finished(transfer)
        if params is None:
            return False, None
        params = {**params, "num_prompt_tokens": request.num_prompt_tokens,
                  "chain": self.chain(request, request.num_prompt_tokens)}
        if self._keys:  # valid while P's lease would be, had D not yet said it expects them
            params = sign_params(params, self._keys[0], self._lease_s)
        return False, {**params, "do_remote_prefill": True, "do_remote_decode": False}

    def take_events(self) -> list[Any]:
        """The host pool's stores and removals since the last call, as vLLM's KV events
        (`vllm_events`); none without a pool."""
        if self.prefill is None or not self.prefill.pools.pools:
            return []
        return vllm_events(self.prefill.pools.take_events())

    def reset_cache(self) -> bool:
        """vLLM's cache reset (new weights): the host pool lets go of every entry, and the
        workers' next step revokes everything staged or lent before it
        (`PrefillScheduler.reset`); `holding` asks vLLM for that step at once."""
        if self.prefill is not None:
            self.prefill.reset()
        return True

    def hit_sources(self, req_id: str) -> dict[str, int] | None:
        """How many of the tokens a request loads come from where (vLLM 0.33's
        `CacheHitSource` values): `host` (this instance's pool), `p2p` (D's read from P);
        None before its allocation."""
        return self._sources.get(req_id)

    def holding(self) -> bool:
        return self.prefill is not None and (bool(self.prefill.held()) or self.prefill.revoking)




def _stream(params: Mapping[str, Any], req_id: str) -> str | None:
    """The stream id a router gave P's request (its D reads the KV while P prefills), if a
    valid one; anything else is logged and ignored (D then fails the stream and recomputes)."""
    stream = params.get("stream")
    if stream is not None and not is_stream_id(stream):
        logger.warning("request %s: kv_transfer_params 'stream' must be 32 hex digits, got "
                       "%.40r; not streamed", req_id, stream)
        return None
    return stream



def group_hashes(request: Request, groups: Sequence[GroupSpec], hash_block: int,
                 num_tokens: int | None = None) -> list[list[Any]]:
    """Per group, the hashes of the full blocks of the prompt (or of the first `num_tokens`
    tokens) at the group's block size: vLLM hashes at `hash_block` tokens, and a chain's
    hash at a block's last piece stands for every token up to it."""
    hashes, out = request.block_hashes, []
    tokens = request.num_prompt_tokens if num_tokens is None else num_tokens
    for g in groups:
        k = g.tokens_per_block // hash_block
        full = min(tokens // g.tokens_per_block, len(hashes) // k)
        out.append([hashes[(i + 1) * k - 1] for i in range(full)])
    return out


def keep(prefill: PrefillScheduler, request: Request, block_ids: Sequence[Sequence[int]] | None,
         groups: Sequence[GroupSpec], hash_block: int) -> bool:
    """A request that finished (stopped, at its length, or aborted: a stop string, a client
    gone), not while waiting for its KV: its full blocks whose KV the engine computed, prompt
    and generated tokens alike, enter `prefill`'s host pool (`PrefillScheduler.keep_finished`).
    Where the pool makes KV events, they name the blocks' tokens and labels (`event_labels`).
    Returns whether vLLM must keep its device blocks until the workers gathered them."""
    status = getattr(getattr(request, "status", None), "name", "")
    if (not prefill.pools.pools or block_ids is None or status not in (
            "FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED")):
        return False
    # the last token's KV is computed only by a step that never runs (async scheduling may
    # have started it): blocks up to it, not past
    computed = min(request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0),
                   request.num_tokens - 1)
    try:
        return prefill.keep_finished(
            request.request_id, [list(ids) for ids in block_ids],
            group_hashes(request, groups, hash_block, computed),
            *((list(request.all_token_ids[:computed]), event_labels(request, groups, computed))
              if prefill.pools.events else ()))
    except KvxferError as e:  # the request is not pooled; the engine goes on
        logger.warning("request %s is not kept in the host pool: %s", request.request_id, e)
        return False
