"""The scheduler side: P's save plans, staging slots and params; D's loads.

`PrefillScheduler` turns each engine step into a `SaveMeta`: which blocks to
copy (the `SaveTracker`'s plan, placed at kernel positions), their staging
slots and, for a request whose prefill completes in the step, its
generation and `kv_transfer_params`. So the params exist as soon as the
completing step is planned, which is when vLLM asks for them. `LoadRequest`
is what D's scheduler side hands its worker. Imports neither JAX, numpy nor
NIXL: vLLM runs this in its scheduler process.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxfer.connector.keeper import Keeper, Tags, check_events, split_tags
from kvxfer.errors import (
    InvalidInputError,
    StagingFullError,
)
from kvxfer.nixl.wire import (
    ReadParams,
    Source,
    StreamParams,
    is_stream_id,
    new_instance,
    parse_sources,
    prompt_digest,
)
from kvxfer.plan.blocks import is_int, kernel_placement
from kvxfer.plan.pool import Pools
from kvxfer.plan.save_plan import GroupSpec, SaveTracker, ScheduledRequest
from kvxfer.plan.slots import SlotMap

__all__ = ["Keeper", "LoadRequest", "PeerAddress", "Placed", "PrefillScheduler", "SaveMeta"]

logger = logging.getLogger(__name__)


Placed = list[tuple[int, int]]
"""`(kernel position, kernel block id)` pairs of one group."""


@dataclass
class SaveMeta:
    """One step's saves, as P's scheduler side hands them to its worker side.

    - `blocks[req_id][g]`: group `g`'s `(kernel position, kernel id)` pairs;
    - `slots[req_id][g]`: the staging slot of each of those blocks;
    - `holds[req_id]`: the generation under which a request whose prefill
      completes this step is held for D, once its blocks are saved;
    - `instance`: the P instance the params name (the worker's transport is
      started under it);
    - `secrets[req_id]`: the secret of each request with blocks this step, which
      the worker derives the blocks' tags from (`kvxfer.device.staging.block_tags`);
      `entries[req_id][g]`: kernel position -> entry secret of the blocks this step
      that are whole hashed prompt blocks of a P with a host pool, whose tags come from
      that instead (`kvxfer.nixl.wire.entry_secret`: they may become pool entries).
      Tags are bound to what the block holds (`kvxfer.nixl.wire.bound_secret`):
      `prompts[req_id]`, the digest of the prompt of a request given its token ids, and
      `hashes[req_id][g]`, kernel position -> the block hash (hex) of each entry block.
    - `streams[req_id]`: `[stream id, prompt digest or None]` of a streamed request
      with blocks this step; `final[req_id][g]`: the kernel positions of group `g`,
      among this step's, that no later step copies again (the worker names them to
      D now); `cancels`: streamed requests P gave up on (aborted, or preempted)
      whose slots the worker frees once their D let go of them.
    - `keeps`: finished requests whose blocks this step gathers straight into the host pool
      (`PrefillScheduler.keep_finished`): no D reads them, so the worker frees them once
      gathered, and the engine may then free their device blocks.
    - `revoke`: a cache reset came before this step (`PrefillScheduler.reset`): before it
      stages anything, the worker voids every slot's tags and ends every lease, so no
      block staged or pooled before the reset is read as good again.

    Plain data (ints, strs, lists): it crosses vLLM's scheduler -> worker
    boundary as `KVConnectorMetadata`.
    """

    instance: str = ""
    blocks: dict[str, tuple[Placed, ...]] = field(default_factory=dict)
    slots: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    holds: dict[str, int] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
    entries: dict[str, tuple[dict[int, str], ...]] = field(default_factory=dict)
    prompts: dict[str, str] = field(default_factory=dict)
    hashes: dict[str, tuple[dict[int, str], ...]] = field(default_factory=dict)
    streams: dict[str, list[str | None]] = field(default_factory=dict)
    final: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    cancels: list[str] = field(default_factory=list)
    keeps: list[str] = field(default_factory=list)
    revoke: bool = False

    @property
    def completed(self) -> set[str]:
        return set(self.holds)

    @property
    def kernel_ids(self) -> dict[str, list[int]]:
        """Kernel ids saved per request, every group's in group order."""
        return {r: [k for placed in groups for _, k in placed] for r, groups in self.blocks.items()}


@dataclass(frozen=True)
class LoadRequest:
    """One request D loads, as D's scheduler side hands it to `DecodeConnector.start_load_kv`.

    - `params`: P's `kv_transfer_params`, as P made them: `parse_params` checks them on D.
    - `table`: D's block table, per group its logical block ids in token order
      (a plain list of ids when there is one group); entries past the prompt
      (allocated for decode) are ignored.
    - `have`: per group, how many leading table entries D already holds (a local
      prefix-cache hit): blocks P sends for those entries are not read. None: none.
    - `prompt`: the `kvxfer.nixl.wire.prompt_digest` of D's prompt, when D knows it: params
      P made for another prompt (or without one) are then refused.
    - `upto`: per group, the table entries below which blocks are read (a prefix of the
      params' blocks, `kv_source`); None: every block they name.
    - `hashes`: per group, D's block hashes (`kvxfer.nixl.wire.hash_hex`) of its table
      entries in order, which the tags of the host pool entries P names are checked
      under: params naming an entry for another block fail. None: D knows no hashes, and
      no pool entry is read as good.
    - `need`: per group, the table entries `[lo, hi)` D told its engine it loads: params
      whose blocks (or a stream whose chunks) leave one of them out fail the load instead
      of leaving it whatever the block held before. None: not checked (the caller says
      nothing of what it counts as loaded).

    Plain data, defined here rather than beside `DecodeConnector` so that vLLM's
    scheduler process, which builds it, loads no JAX.
    """

    params: Any
    table: Any
    have: Any = None
    prompt: str | None = None
    upto: Any = None
    need: Any = None
    hashes: Any = None

    @staticmethod
    def parse_params(params: object, num_groups: int) -> ReadParams | StreamParams:
        """P's params checked, the one place D parses them: `StreamParams` where they name a
        stream (P still prefills the request), else `ReadParams` of `num_groups` groups;
        `InvalidInputError` naming the first bad field. They pass through the engine and
        its proxies, and may come from a client."""
        if StreamParams.given(params):
            return StreamParams.parse(params)
        return ReadParams.parse(params, num_groups)


@dataclass(frozen=True)
class PeerAddress:
    """Where D reaches P's worker: its agent name, host and NIXL listener port (0: P has no
    listener; D finds it by name in etcd)."""

    name: str
    host: str
    port: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidInputError(f"P agent name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.host, str) or not self.host:
            raise InvalidInputError(f"P host must be a non-empty str, got {self.host!r}")
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            raise InvalidInputError(f"P port must be an int in [0, 65535], got {self.port!r}")


class PrefillScheduler:
    """P's scheduler side: save plans, staging slots, transfer identity and params.

    Needs no caches and touches no device (it runs in vLLM's scheduler process): the
    worker side (`PrefillWorker`) copies what `build_connector_meta` says into
    the slots it says. Because the slots and the generation are decided here,
    the params D needs are known as soon as the completing step is planned,
    which is when vLLM asks for them (`request_finished` runs before the
    worker's output for that step is processed).

    A request whose blocks do not fit the staging is dropped (logged): it
    gets no params, so D computes its prompt itself; raising here would stop
    the engine.

    Arguments:
        groups: the engine's KV cache groups.
        staging_blocks: kernel blocks per layer of each group's staging (the
            worker's must be the same).
        kernel_ratio: kernel blocks per logical block.
        address: where D reaches P's worker.
        instance: P's identity for this start (`new_instance()` when None).
        sources: for a P whose workers span several processes, every
            process's agent and the units of each block it stages
            (`PrefillWorker.sources`), named in the params; empty for one.
        units: the units a block is cut into, with `sources`.
        secret_key: the key (64 hex digits) request secrets are derived from, the same
            for every process of a P across hosts; None draws one.
        pool_slots: each group's host pool budget, in staging slots (`kvxfer.plan.pool`):
            a request added with its block hashes leaves its full prompt blocks in
            staging once released, for later prompts to load (`pools`). 0: none.
    """

    def __init__(self, groups: Sequence[GroupSpec], *, staging_blocks: int, kernel_ratio: int,
                 address: PeerAddress, instance: str | None = None,
                 sources: Sequence[Source] = (), units: int = 0, secret_key: str | None = None,
                 pool_slots: int = 0):
        self.tracker = SaveTracker(groups)
        if not isinstance(address, PeerAddress):
            raise InvalidInputError(f"address must be a PeerAddress, got {address!r:.80}")
        for name, value in (("staging_blocks", staging_blocks), ("kernel_ratio", kernel_ratio)):
            if not is_int(value) or value <= 0:
                raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
        self.kernel_ratio = kernel_ratio
        self.address = address
        self.sources: tuple[Source, ...] = ()
        self.units = 0
        self.use_sources(sources, units)
        self.instance = instance or new_instance()
        self.slot_maps = [SlotMap(staging_blocks) for _ in self.tracker.groups]
        if not is_int(pool_slots) or not 0 <= pool_slots <= staging_blocks:
            raise InvalidInputError(f"pool_slots must be an int in [0, staging_blocks="
                                    f"{staging_blocks}], got {pool_slots!r}")
        self.pools = Pools(self.tracker.groups, self.slot_maps, kernel_ratio, pool_slots)
        self._entries: dict[str, Tags] = {}  # request -> its blocks' pool entry tags
        self._next_generation = 1
        self._params: dict[str, dict[str, Any]] = {}  # completed, not yet asked for
        self._held: set[str] = set()  # params handed out, slots not yet freed by the worker
        self._secrets: dict[str, str] = {}  # added, not yet freed
        self.keeper = Keeper(self.slot_maps, self.pools, kernel_ratio, secret_key)
        self._prompts: dict[str, str] = {}  # the prompt digest of those given their prompt
        self._streams: dict[str, tuple[str, int]] = {}  # streamed: (stream id, prompt tokens)
        self._cancels: list[str] = []  # streams given up on, for the next meta
        self.revoking = False  # a reset waits for the next meta to reach the worker

    def reset(self) -> None:
        """A cache reset (new weights): the pool lets go of every entry (`SaveMeta.revoke`)."""
        self.pools.clear()
        self.revoking = True

    def use_sources(self, sources: Sequence[Source], units: int) -> None:
        """Name these P processes and units in the params of requests completed from now on
        (a scheduler that learns them from its workers: `kvxfer.vllm`). Checked as D will
        check the params that name them; `()` and 0 for a P of one process."""
        if sources or units:
            if not all(isinstance(x, Source) for x in sources):
                raise InvalidInputError(f"sources must be Source entries, got {sources!r:.80}")
            parse_sources([{"peer": x.peer, "units": [x.lo, x.hi]} for x in sources], units)
        self.sources, self.units = tuple(sources), units

    def add_request(self, req_id: str, num_prompt_tokens: int,
                    prompt_token_ids: Sequence[int] | None = None,
                    stream: str | None = None,
                    block_hashes: Sequence[Sequence[Hashable]] | None = None,
                    event_token_ids: Sequence[int] | None = None,
                    labels: Mapping[str, Any] | None = None, prompt_extra: object = None) -> None:
        """A request whose prompt KV must reach D (vLLM: `do_remote_decode`).

        With `block_hashes` (per group, the hashes of its full prompt blocks: vLLM's
        `request.block_hashes` at the group's block size) and a pool, its full blocks
        stay in staging once D has read them, for later prompts (`pools`: `Pools.match`).

        With `prompt_token_ids`, its params carry their `prompt_digest` (folding in
        `prompt_extra`), and a D that knows its own prompt refuses params computed for
        another one. The pool's events
        name the blocks' tokens as `event_token_ids` gives them (vLLM's `all_token_ids`: 0
        where a prompt embedding stands), else as `prompt_token_ids`, labelled with `labels`
        (`Pools.remember`).
        With `stream` (a `kvxfer.nixl.wire.new_stream_id` the router also gave D), D
        may read each block as soon as it is final, while P still prefills the
        rest (`kvxfer.nixl.wire.StreamParams`); its params are made as usual, for a D
        that does not stream. Refused while P still holds a request of that id
        (being prefilled, staged, or waiting for D): its params could otherwise
        read the new prefill's blocks.
        """
        if not isinstance(req_id, str) or not req_id:
            raise InvalidInputError(f"request id must be a non-empty str, got {req_id!r}")
        if stream is not None and not is_stream_id(stream):
            raise InvalidInputError(f"request {req_id!r}: stream must be None or 32 hex digits "
                                    f"(kvxfer.nixl.wire.new_stream_id), got {stream!r:.80}")
        if stream is not None and any(s == stream for s, _ in self._streams.values()):
            raise InvalidInputError(f"request {req_id!r}: stream {stream} is another request's")
        if self.holds(req_id):
            raise InvalidInputError(
                f"request {req_id!r} is still held on P for D; it cannot be added again until "
                f"D has read it or its lease expired (get_finished reports it)")
        digest = None
        if prompt_token_ids is not None:
            if len(prompt_token_ids) != num_prompt_tokens:
                raise InvalidInputError(
                    f"request {req_id!r}: {len(prompt_token_ids)} prompt token ids for "
                    f"{num_prompt_tokens!r} prompt tokens")
            digest = prompt_digest(prompt_token_ids, prompt_extra)
        check_events(req_id, num_prompt_tokens, event_token_ids, labels)
        hashes = (None if block_hashes is None
                  else self.pools.check(block_hashes, num_prompt_tokens))  # before any change
        self.tracker.add(req_id, num_prompt_tokens)
        if hashes is not None and self.pools.pools:
            self.pools.remember(req_id, hashes, prompt_token_ids if event_token_ids is None
                                else event_token_ids, labels)
            self._entries[req_id] = self.keeper.tags(
                hashes, [range(len(h) * self.kernel_ratio) for h in hashes])
        self._secrets[req_id] = self.keeper.secret(req_id)
        if digest is not None:
            self._prompts[req_id] = digest
        if stream is not None:
            self._streams[req_id] = (stream, num_prompt_tokens)

    def keep_finished(self, req_id: str, tables: Sequence[Sequence[int]],
                      block_hashes: Sequence[Sequence[Hashable]],
                      token_ids: Sequence[int] | None = None,
                      labels: Mapping[str, Any] | None = None) -> bool:
        """See `Keeper.keep`; never a request P still holds for D."""
        return not self.holds(req_id) and self.keeper.keep(req_id, tables, block_hashes,
                                                            token_ids, labels)

    def holds(self, req_id: str) -> bool:
        """Whether P still holds a request of this id (being prefilled, staged, or waiting
        for D): `add_request` refuses the id until then."""
        if not isinstance(req_id, str):
            raise InvalidInputError(f"request id must be a str, got {req_id!r:.80}")
        return (req_id in self._held or req_id in self._params or req_id in self.tracker
                or any(req_id in m for m in self.slot_maps))

    def build_connector_meta(self, scheduled: Iterable[ScheduledRequest]) -> SaveMeta:
        """This step's saves: kernel ids, kernel positions and staging slots of every group."""
        scheduled = list(scheduled)
        meta = SaveMeta(instance=self.instance, revoke=self.revoking)
        self.revoking = False
        restarted = {s.req_id for s in scheduled if s.full_table and s.req_id in self.tracker}
        for req_id in restarted & self._held:  # D may have read its blocks: it cannot restage
            logger.warning("P drops streamed request %s, preempted mid-prefill; D will compute "
                           "its prompt", req_id)
            self.abort(req_id)
        ends = {s.req_id: s.num_computed_tokens + s.num_scheduled_tokens for s in scheduled}
        for req_id, groups in self.tracker.plan_placed(scheduled).items():
            if req_id in restarted:  # new, or resumed after preemption: staged afresh
                self._free_slots(req_id, forget=False)
                if req_id not in self._streams:  # a stream's chunks name the blocks it copies
                    self.pools.lend(req_id)  # the pooled run of its prompt: named, not copied
            lent = self.pools.lent(req_id) or [0] * len(groups)
            placed = tuple([(pos, k) for pos, k in kernel_placement(g, self.kernel_ratio)
                            if pos // self.kernel_ratio >= n] for g, n in zip(groups, lent))
            try:
                slots = tuple(m.assign(req_id, [pos for pos, _ in blocks])
                              for m, blocks in zip(self.slot_maps, placed))
            except StagingFullError as e:
                logger.warning("P drops request %s: %s; D will compute its prompt", req_id, e)
                self.abort(req_id)
                continue
            meta.blocks[req_id], meta.slots[req_id] = placed, slots
            meta.secrets[req_id] = self._secrets[req_id]
            if req_id in self._prompts:
                meta.prompts[req_id] = self._prompts[req_id]
            if req_id in self._entries:
                meta.entries[req_id], meta.hashes[req_id] = _whole(
                    placed, self._entries[req_id], self.tracker.groups, self.kernel_ratio, ends[req_id])
            if req_id in self._streams and (any(placed) or (
                    req_id in self._held and req_id not in self.tracker)):
                self._stream_step(req_id, placed, ends[req_id], meta)
            if req_id not in self.tracker:  # its prefill completes this step
                self._complete(req_id, meta)
        meta.cancels, self._cancels = self._cancels, []
        self.keeper.add_to(meta)
        return meta

    def _stream_step(self, req_id: str, placed: tuple[Placed, ...], end: int,
                     meta: SaveMeta) -> None:
        """Name the blocks of a streamed request no later step copies again: whole blocks
        before the chunk's end (the straddling one waits for the chunk that completes
        it), every block once the prompt is done. From its first staged block D may read
        its slots, so they are held for D from then on."""
        stream, prompt = self._streams[req_id]
        done = req_id not in self.tracker
        final = []
        for spec, blocks in zip(self.tracker.groups, placed):
            tpb = spec.tokens_per_block
            final.append([pos for pos, _ in blocks if done or (
                spec.kind != "mamba" and (pos // self.kernel_ratio + 1) * tpb <= min(end, prompt))])
        meta.streams[req_id] = [stream, self._prompts.get(req_id)]
        meta.final[req_id] = tuple(final)
        self._held.add(req_id)

    def _complete(self, req_id: str, meta: SaveMeta) -> None:
        a = self.address
        params = ReadParams.staged(self.slot_maps, req_id, peer=a.name, instance=self.instance,
                                   host=a.host, port=a.port, generation=self._next_generation,
                                   secret=self._secrets[req_id],
                                   prompt=self._prompts.get(req_id), sources=self.sources,
                                   units=self.units,
                                   entries=split_tags(self._entries.get(req_id, ()))[0])
        if params is None:
            logger.warning("P request %s completed with nothing staged", req_id)
            return
        self._next_generation += 1
        meta.holds[req_id] = params.generation
        self._held.add(req_id)
        self._params[req_id] = params.to_dict()

    def request_finished(self, req_id: str) -> dict[str, Any] | None:
        """The `kv_transfer_params` D needs, once the request's prefill is planned to completion.

        A request finished before its prefill completed has nothing for D: its
        plan state and slots are dropped and None is returned; so is a request
        dropped for want of staging.
        """
        if req_id in self.tracker:
            self.abort(req_id)
            return None
        return self._params.pop(req_id, None)

    def abort(self, req_id: str) -> None:
        """Drop an aborted request's plan state and slots (not those D may be reading: a
        streamed request's are freed once the worker says its D let go of them)."""
        streaming = req_id in self.tracker and req_id in self._held
        self.tracker.abort(req_id)
        self._params.pop(req_id, None)
        self._streams.pop(req_id, None)
        if streaming:  # a block it staged may be half written: none of it enters the pool
            self.pools.forget(req_id)
            self._entries.pop(req_id, None)
            self._cancels.append(req_id)
        elif req_id not in self._held:
            self._free_slots(req_id)

    def release(self, freed: Iterable[str]) -> None:
        """The worker freed these requests (read by D, or lease expired): reuse their slots.

        Only a request handed to D can have been freed: any other id (one still being
        prefilled, or unknown) is ignored, so its staged blocks stay where its params
        will name them. A streamed request freed while still being prefilled is one its
        D gave up on: none of it is staged from then on, and it has no params.
        """
        for req_id in self.keeper.release(freed):
            if req_id not in self._held:
                logger.debug("P ignores the release of %s, which it does not hold for D", req_id)
                continue
            if req_id in self.tracker:  # never completed: not every block is written
                self.tracker.abort(req_id)
                self.pools.forget(req_id)
            self._params.pop(req_id, None)  # they would name freed slots
            self._held.discard(req_id)
            self.pools.keep(req_id)
            self._free_slots(req_id)

    def held(self) -> list[str]:
        """Requests handed to D, and finished ones kept in the pool (`keep_finished`), whose
        slots the worker has not yet freed."""
        return sorted(self._held | self.keeper.held)

    def gauges(self, slot_bytes: Sequence[int] = ()) -> dict[str, float]:
        """`p_staging_slots_in_use` (every group's) and `p_requests_held_for_d` now; with a
        pool, its `p_pool_blocks`, `p_pool_slots` and, given each group's bytes of a slot,
        `p_pool_bytes` (`Pools.gauges`)."""
        used = sum(m.num_slots - m.num_free_slots for m in self.slot_maps)
        return {"p_staging_slots_in_use": used, "p_requests_held_for_d": len(self._held),
                **(self.pools.gauges(slot_bytes) if self.pools.pools else {})}

    def _free_slots(self, req_id: str, forget: bool = True) -> None:
        """Free a request's slots and, unless it is restarted (staged afresh under its
        secret), forget it."""
        self.pools.unlend(req_id)
        if forget:
            self.pools.forget(req_id)
            self._entries.pop(req_id, None)
            self._secrets.pop(req_id, None)
            self._prompts.pop(req_id, None)
            self._streams.pop(req_id, None)
        for m in self.slot_maps:
            if req_id in m:
                m.free(req_id)


def _whole(placed: tuple[Placed, ...], entries: Tags, groups: Sequence[GroupSpec], ratio: int,
           end: int) -> tuple[tuple[dict[int, str], ...], tuple[dict[int, str], ...]]:
    """Per group, the entry secrets and hashes of the placed hashed blocks that are whole
    once the step ends at token `end`: a block staged in part (the step ends inside it) is
    tagged as its request's until the step that completes it, so that stale params naming
    that entry's slot never read it as good."""
    return split_tags(tuple({pos: e[pos] for pos, _ in p
                         if pos in e and (pos // ratio + 1) * spec.tokens_per_block <= end}
                        for p, e, spec in zip(placed, entries, groups)))
