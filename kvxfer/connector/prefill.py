"""P's worker side (`PrefillWorker`), and P in one process (`PrefillConnector`).

After each forward pass `PrefillWorker.save` copies the blocks the scheduler
side planned straight out of the device caches into their staging slots (one
gather per KV cache group for every request of the step), with their
fingerprints beside them, then holds the requests that completed under a
lease. `poll` reports the requests D has read (or whose lease expired), whose
slots the scheduler side may reuse. Since P's blocks sit in host staging once
saved, the engine may free P's device blocks as soon as a request finishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from kvxfer.connector._processes import for_caches, per_group
from kvxfer.connector.config import ConnectorConfig
from kvxfer.connector.scheduler import PeerAddress, PrefillScheduler, SaveMeta
from kvxfer.device.layout import CacheLayout, advertised
from kvxfer.device.seal import scratch, seal
from kvxfer.device.staging import TAG_WORDS, Staging, tags_of
from kvxfer.errors import InvalidInputError
from kvxfer.nixl.prefill import PrefillTransport
from kvxfer.nixl.wire import Source, bound_secret, new_instance
from kvxfer.plan.save_plan import GroupSpec, SaveTracker, ScheduledRequest
from kvxfer.plan.slots import SlotMap
from kvxfer.stats import Recorder, Stats, Trace

__all__ = ["PrefillConnector", "PrefillWorker"]

logger = logging.getLogger(__name__)


class PrefillWorker:
    """P's worker side: copies planned blocks into staging and holds them for D's reads.

    Arguments:
        config: `ConnectorConfig` (`staging_blocks` must be the scheduler side's).
        caches: the current per-layer caches of each group (a plain list of
            arrays when there is one group); only their layouts are kept.
        instance: the scheduler side's P instance (`new_instance()` when None).
        model: what the caches hold, which D must describe alike
            (`kvxfer.device.layout.advertised`); None: nothing said.
        serve: start the NIXL agent D reads from; False keeps the host pool alone (a D's:
            its saves are only `SaveMeta.keeps`, which no peer reads).
    """

    def __init__(self, config: ConnectorConfig,
                 caches: Sequence[jax.Array] | Sequence[Sequence[jax.Array]],
                 instance: str | None = None, model: Mapping[str, Any] | None = None,
                 serve: bool = True):
        if not isinstance(serve, bool):  # a truthy string would start an agent nobody asked for
            raise InvalidInputError(f"serve must be a bool, got {serve!r:.80}")
        available = available_memory()
        if available is not None and config.host_pool_bytes > available:
            raise InvalidInputError(f"host_pool_bytes {config.host_pool_bytes} is more than this "
                                    f"host's available memory ({available} bytes, MemAvailable)")
        self.processes = for_caches(config, caches)
        self.config, self.layouts, self.stagings = config, self.processes.layouts, self.processes.stagings
        self.recorder = Recorder(config.stats)
        self.slot_bytes = [s.block_bytes * s.num_layers for s in self.stagings]  # per group
        self.pool_slots = _pool_slots(config, sum(self.slot_bytes))  # before the agent starts
        logger.info("host pool: %d bytes (host_pool_bytes; 0, the default, keeps none): "
                    "%d staging slots of %d bytes", config.host_pool_bytes, self.pool_slots,
                    sum(self.slot_bytes))
        self.processes.precompile(caches, saves=True)  # before the agent: nothing to close if it fails
        if self.pool_slots:
            self.processes.precompile(caches, saves=False)  # loads from the pool
        self.name = self.processes.transport_config.name
        given = self.processes.instance(instance)
        if given is not None and (not isinstance(given, str) or not given):
            raise InvalidInputError(f"instance must be a non-empty str, got {given!r:.80}")
        self.instance = given or new_instance()
        self.transport: PrefillTransport | None = None
        if serve:
            self.transport = PrefillTransport(
                self.processes.transport_config, self.stagings,
                advertised(self.layouts, model, self.processes.unit_axes),
                instance=self.instance, piece=self.processes.piece, recorder=self.recorder)
            self.transport.answer_in_background()  # D's acks do not wait for the engine's step
        self._traces: dict[str, Trace] = {}  # requests being staged, not yet held
        self._kept: list[str] = []  # gathered into the pool since the last poll
        self._saves = 0  # saves so far: the nonce of what a save seals (`seal_kv`)
        self._clear: dict[int, Staging] = {}  # per group, where a save gathers what it seals

    @property
    def address(self) -> PeerAddress:
        t = self.transport
        return PeerAddress(t.config.name, t.config.host, t.port)

    @property
    def sources(self) -> list[Source]:
        """Every process of P (its agent, the units it stages of each block)."""
        return self.processes.sources

    @property
    def units(self) -> int:
        """The units a block is cut into (`sources` name ranges of them)."""
        return self.processes.units

    def save(self, caches: Sequence[jax.Array] | Sequence[Sequence[jax.Array]],
             meta: SaveMeta) -> None:
        """Copy `meta`'s blocks from the caches into their slots, with their fingerprints
        and their tags (from each request's secret and the blocks' positions).

        One gather per group for every request of the step, straight into the
        regions NIXL reads; a block copied again by a later chunk goes back to
        its slot. Requests completing this step are then held for D; those the step keeps
        in the pool (`meta.keeps`) are freed, as `poll` says next.
        """
        if meta.instance != self.instance:
            raise InvalidInputError(
                f"metadata is for P instance {meta.instance!r}, this worker is "
                f"{self.instance!r}")
        if self.transport is None and (meta.cancels or meta.holds or meta.streams):
            raise InvalidInputError("this worker keeps a host pool only (serve=False): it holds "
                                    "nothing for D")
        groups, _ = per_group(caches, len(self.layouts))
        if meta.revoke:  # a cache reset: nothing staged before it is read as good again
            for staging in self.stagings:
                staging.tags[...] = 0
                staging.secrets.clear()
            if self.transport is not None:
                self.transport.revoke()
        for req_id in meta.cancels:
            self.transport.cancel_stream(req_id)
        start = time.monotonic()
        self._saves += 1  # every process of the instance counts alike: the nonces match
        for g, group_caches in enumerate(groups):
            ids = np.asarray([k for placed in meta.blocks.values() for _, k in placed[g]],
                             np.int64)
            if len(ids):
                slots = [s for slots in meta.slots.values() for s in slots[g]]
                positions = [pos for placed in meta.blocks.values() for pos, _ in placed[g]]
                secrets = [s for req_id, placed in meta.blocks.items()
                           for s in _bound(meta, req_id, g, [pos for pos, _ in placed[g]])]
                if self.config.seal_kv and self.transport is not None:  # else none reads it
                    clear, piece = self._scratch(g, len(ids)), self.processes.pieces[g]
                    self.processes.gather(g, group_caches, ids, np.arange(len(ids)), into=clear)
                    seal(self.stagings[g], g, slots, secrets, self._saves, clear, piece.lo,
                         piece.units)
                else:
                    self.processes.gather(g, group_caches, ids, np.asarray(slots, np.int64))
                self.stagings[g].tags[slots, :TAG_WORDS] = tags_of(secrets, g, positions)
        if meta.blocks:
            self._trace_gathers(meta, start)
        for req_id in meta.keeps:  # no D reads them: no trace waits to be finished
            self._traces.pop(req_id, None)
        self._kept.extend(meta.keeps)
        for req_id, generation in meta.holds.items():
            self.transport.lease(req_id, generation, meta.secrets[req_id],
                                 trace=self._traces.pop(req_id, None))
        for req_id, (stream, prompt) in meta.streams.items():
            final = meta.final[req_id]
            slot_of = [dict(zip([pos for pos, _ in placed], slots))
                       for placed, slots in zip(meta.blocks[req_id], meta.slots[req_id])]
            entries = meta.entries.get(req_id) or ({},) * len(final)
            self.transport.publish(req_id, stream, meta.secrets[req_id], prompt, final,
                                   [[at[k] for k in keys] for at, keys in zip(slot_of, final)],
                                   last=req_id in meta.holds,
                                   entries=[{k: e[k] for k in keys if k in e}
                                            for e, keys in zip(entries, final)])

    def _scratch(self, g: int, n: int) -> Staging:
        """Group `g`'s scratch of at least `n` slots, kept between saves: its pages are
        touched once, not at every save."""
        have = self._clear.get(g)
        if have is None or have.num_slots < n:
            grown = min(2 * have.num_slots, self.stagings[g].num_slots) if have else n
            have = self._clear[g] = scratch(self.stagings[g], max(n, grown))
        return have

    def load(self, caches: Sequence[jax.Array] | Sequence[Sequence[jax.Array]],
             loads: Mapping[str, tuple[Sequence[int], Sequence[int]] | Sequence]
             ) -> tuple[Any, list[str]]:
        """Write pooled blocks from staging into the caches (in place, donated), checked
        against the sums P took when it staged them: `loads[req_id][g]` is `(kernel ids,
        slots)` of group `g` (the scheduler side's `Pools.load`). Returns the new
        caches, in the form given, and the requests whose blocks did not check out (the
        engine computes them instead)."""
        start = time.monotonic()
        groups, single = per_group(caches, len(self.layouts))
        bad: dict[str, str] = {}
        for batch in _disjoint(loads):  # requests sharing pooled blocks: one scatter each
            for g in range(len(self.layouts)):
                self.processes.scatter(g, groups, {r: load[g] for r, load in batch.items()},
                                       bad)
        self.processes.agree_bad(loads, bad)
        for req_id, why in bad.items():
            logger.warning("the pooled blocks of %s did not check out (%s): it is computed",
                           req_id, why)
        self.recorder.count("p_pool_load_blocks", sum(len(ids) for load in loads.values()
                                                      for ids, _ in load))
        self.recorder.observe("p_pool_load_s", time.monotonic() - start)
        return (groups[0] if single else groups), sorted(bad)

    def _trace_gathers(self, meta: SaveMeta, start: float) -> None:
        """Each request of the step waited for the step's gather: one `gather` stage per
        request (summed over its steps), with its blocks and bytes."""
        end = time.monotonic()
        self.recorder.observe("p_step_gather_s", end - start)
        for req_id, placed in meta.blocks.items():
            trace = self._traces.get(req_id)
            if trace is None:
                trace = self._traces[req_id] = Trace(req_id, "P", req_id, p=self.name)
                while len(self._traces) > self.config.staging_blocks:  # aborted ones
                    del self._traces[next(iter(self._traces))]
            trace.extend("gather", start, end)
            for g, staging in enumerate(self.stagings):
                trace.blocks += len(placed[g])
                trace.bytes += len(placed[g]) * staging.block_bytes * staging.num_layers

    def stats(self, take: bool = False) -> Stats:
        """Counters, totals and gauges since start (`kvxfer.stats.Stats`; docs/observability.md lists
        them); with `take`, also the series observed since the last take."""
        return self.recorder.stats(take)

    def traces(self) -> list[Trace]:
        """The last finished transfers' traces (a bounded ring), oldest first."""
        return self.recorder.traces()

    def poll(self) -> list[str]:
        """Requests D has read, or whose lease expired, and those gathered into the pool
        (`SaveMeta.keeps`): their slots may be reused."""
        kept, self._kept = self._kept, []
        return (self.transport.poll() if self.transport is not None else []) + kept

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class PrefillConnector:
    """P in one process: a `PrefillScheduler` and a `PrefillWorker` side by side.

    For engines that plan and run in one process (and for kvxfer's own demo
    and tests); vLLM splits the two across processes (`kvxfer.vllm`).

    Arguments:
        config: `ConnectorConfig`.
        groups: the engine's KV cache groups (for the save plans).
        caches: the current per-layer caches of each group, one list per
            `GroupSpec` in order (a plain list of arrays when there is one
            group); only their layouts are kept (the model donates them every step).
        model: what the caches hold (see `PrefillWorker`).
    """

    def __init__(self, config: ConnectorConfig, groups: Sequence[GroupSpec],
                 caches: Sequence[jax.Array] | Sequence[Sequence[jax.Array]],
                 model: Mapping[str, Any] | None = None):
        if not isinstance(config, ConnectorConfig):
            raise InvalidInputError(f"config must be a ConnectorConfig, got {config!r:.80}")
        groups = list(groups)
        per_group(caches, len(groups), of="the GroupSpecs")
        SaveTracker(groups)  # checks the specs before a NIXL agent starts
        self.config = config
        self.worker = PrefillWorker(config, caches, model=model)
        try:
            self.scheduler = PrefillScheduler(
                groups, staging_blocks=config.staging_blocks, kernel_ratio=config.kernel_ratio,
                address=self.worker.address, instance=self.worker.instance,
                sources=self.worker.sources,
                units=self.worker.processes.units, secret_key=self.worker.processes.secret_key(),
                pool_slots=self.worker.pool_slots)
        except BaseException:
            self.worker.close()
            raise

    @property
    def tracker(self) -> SaveTracker:
        return self.scheduler.tracker

    @property
    def layouts(self) -> list[CacheLayout]:
        return self.worker.layouts

    @property
    def stagings(self) -> list[Staging]:
        return self.worker.stagings

    @property
    def staging(self) -> Staging:
        """The first group's staging (the only one for a single-group model)."""
        return self.worker.stagings[0]

    @property
    def transport(self) -> PrefillTransport:
        return self.worker.transport

    @property
    def slot_map(self) -> SlotMap:
        """The first group's slot bookkeeping (which request's blocks sit in which slots)."""
        return self.scheduler.slot_maps[0]

    def add_request(self, req_id: str, num_prompt_tokens: int,
                    prompt_token_ids: Sequence[int] | None = None,
                    stream: str | None = None,
                    block_hashes: Sequence[Sequence[Hashable]] | None = None) -> None:
        """See `PrefillScheduler.add_request`."""
        self.scheduler.add_request(req_id, num_prompt_tokens, prompt_token_ids, stream,
                                   block_hashes)

    def pooled_tokens(self, block_hashes: Sequence[Sequence[Hashable]],
                      num_computed_tokens: int = 0) -> int:
        """See `kvxfer.plan.pool.Pools.match`."""
        return self.scheduler.pools.match(block_hashes, num_computed_tokens)

    def load_pooled(self, caches: Sequence[jax.Array] | Sequence[Sequence[jax.Array]],
                    req_id: str, block_hashes: Sequence[Sequence[Hashable]],
                    num_computed_tokens: int, num_tokens: int,
                    tables: Sequence[Sequence[int]]) -> tuple[Any, bool]:
        """Load the pooled blocks of tokens `[num_computed_tokens, +num_tokens)` into the
        request's device blocks (`tables[g]`: group `g`'s block table, logical ids in token
        order) instead of prefilling them; returns the new caches and whether the blocks
        checked out (else the engine computes them)."""
        loads = self.scheduler.pools.load(req_id, block_hashes, num_computed_tokens,
                                          num_tokens, tables)
        failed = [req_id]  # until the load returns
        try:
            caches, failed = self.worker.load(caches, {req_id: loads})
        finally:
            self.scheduler.pools.loaded(req_id, failed=bool(failed))
        return caches, not failed

    def build_connector_meta(self, scheduled: Iterable[ScheduledRequest]) -> SaveMeta:
        """See `PrefillScheduler.build_connector_meta`."""
        return self.scheduler.build_connector_meta(scheduled)

    def wait_for_save(self, caches: Sequence[jax.Array] | Sequence[Sequence[jax.Array]],
                      meta: SaveMeta) -> None:
        """See `PrefillWorker.save`."""
        self.worker.save(caches, meta)

    def request_finished(self, req_id: str) -> dict[str, Any] | None:
        """See `PrefillScheduler.request_finished`."""
        return self.scheduler.request_finished(req_id)

    def keep_finished(self, req_id: str, tables: Sequence[Sequence[int]],
                      block_hashes: Sequence[Sequence[Hashable]],
                      token_ids: Sequence[int] | None = None) -> bool:
        """See `PrefillScheduler.keep_finished`: the next `wait_for_save` gathers the blocks,
        and `get_finished` then reports the request (its device blocks may be freed)."""
        return self.scheduler.keep_finished(req_id, tables, block_hashes, token_ids)

    def abort(self, req_id: str) -> None:
        """See `PrefillScheduler.abort`."""
        self.scheduler.abort(req_id)

    def get_finished(self) -> list[str]:
        """Requests D has read, or whose lease expired: their blocks may be freed.

        Across hosts (every process runs the same scheduler, SPMD) a request is
        released once every process has freed its piece, so that every
        process's scheduler reuses the same slots at the same step.
        """
        released = self.worker.processes.released(self.worker.poll(), self.scheduler.held())
        self.scheduler.release(released)
        return released

    def stats(self, take: bool = False) -> Stats:
        """See `PrefillWorker.stats`; with the scheduler side's staging slots in use."""
        stats = self.worker.stats(take)
        stats.gauges.update(self.scheduler.gauges(self.worker.slot_bytes))
        return stats

    def traces(self) -> list[Trace]:
        """See `PrefillWorker.traces`."""
        return self.worker.traces()

    def close(self) -> None:
        self.worker.close()


def _disjoint(loads: Mapping[str, Sequence]) -> list[dict[str, Sequence]]:
    """`loads` in batches that read no slot twice (a scatter's rows are distinct): requests
    loading the same pooled blocks go in different batches."""
    batches: list[tuple[dict[str, Sequence], list[set[int]]]] = []
    for req_id, load in loads.items():
        slots = [set(group_slots) for _, group_slots in load]
        for batch, taken in batches:
            if all(not (s & t) for s, t in zip(slots, taken)):
                batch[req_id] = load
                for s, t in zip(slots, taken):
                    t |= s
                break
        else:
            batches.append(({req_id: load}, slots))
    return [batch for batch, _ in batches]


def _bound(meta: SaveMeta, req_id: str, g: int, positions: Sequence[int]) -> list[str]:
    """The secrets the tags of `req_id`'s blocks at `positions` of group `g` come from (and,
    with `seal_kv`, their keys): its secret bound to its prompt's digest, or for a whole
    hashed prompt block of a P with a pool, the block's entry secret bound to the block's
    hash (`bound_secret`)."""
    shared = meta.entries.get(req_id, ({},) * (g + 1))[g]
    hashes = meta.hashes.get(req_id, ({},) * (g + 1))[g]
    own = bound_secret(meta.secrets[req_id], meta.prompts.get(req_id))
    return [bound_secret(shared[pos], hashes[pos]) if pos in shared else own
            for pos in positions]


def available_memory() -> int | None:
    """The host's available memory in bytes (Linux's MemAvailable; None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _pool_slots(config: ConnectorConfig, per_slot: int) -> int:
    """`host_pool_bytes` as slots of every group's staging (`per_slot`: this process's bytes
    of a slot in each), refused by name where the staging cannot hold it."""
    slots = config.host_pool_bytes // per_slot
    if config.host_pool_bytes and not slots:
        raise InvalidInputError(
            f"host_pool_bytes {config.host_pool_bytes} is less than one staging slot of "
            f"{per_slot} bytes (a block of every layer and group): it would pool nothing; "
            f"give at least {per_slot}, or 0 for no pool")
    if slots > config.staging_blocks:
        raise InvalidInputError(
            f"host_pool_bytes {config.host_pool_bytes} is {slots} staging slots of "
            f"{per_slot} bytes, more than staging_blocks {config.staging_blocks}: the pool "
            f"lives in the staging (raise staging_blocks, or lower host_pool_bytes)")
    return slots
