"""P and D put together, in the engine's terms (vLLM's `KVConnectorBase_V1`).

P is split the way vLLM splits a connector, by role:

- `PrefillScheduler` (scheduler side, no caches, no device): each step goes
  to `build_connector_meta`, which asks the `SaveTracker` which blocks to
  copy and at which table positions, assigns their staging slots, and, for a
  request whose prefill completes in the step, its generation and its
  `kv_transfer_params`. So the params exist as soon as the completing step is
  planned: vLLM asks for them (`request_finished`) before the worker's output
  for that step is processed. Its `SaveMeta` is plain data.
- `PrefillWorker` (worker side, owns the registered staging and the NIXL
  agent): after the forward pass `save` copies the planned blocks out of the
  device caches straight into their slots (one gather per KV cache group for
  all requests of the step) and writes their fingerprints into the staging's
  fingerprint rows, which D reads with the blocks; then holds the completed
  requests under a lease. `poll` reports the requests D has read (or whose
  lease expired), whose slots the scheduler side may reuse (`release`).
- `PrefillConnector`: the two side by side in one process.

Since P's blocks sit in host staging once saved, the engine may free P's
device blocks as soon as the request finishes; only the staging waits for D.

D (`DecodeConnector`, worker side): `start_load_kv` checks each request's
params against D's own block table, skips the entries D already holds (a
local prefix hit), and posts the NIXL reads; `get_finished` advances them,
scatters the received blocks from staging into the device caches in place
(one scatter per group), fingerprints them there on device and checks each
request against P's fingerprints, read from P with the blocks (a mismatch
fails the request: the blocks it wrote are its own, and recomputed), and
returns the new caches with the finished and failed request ids;
`get_block_ids_with_load_errors` lists the logical block ids to recompute.

Blocks travel with their positions. For every block P sends, the params say
which entry of the request's block table (which token range) it holds, in
kernel positions (`table index * kernel_ratio + j`). D writes it into the
entry of its own table at that position, whatever P skipped (null blocks,
blocks outside a sliding window) and however D's table is laid out, and
fails the request if its table does not cover a position (too short, or the
null block there).

KV cache groups. Hybrid models have several groups (full attention, sliding
window, mamba), each with its own caches and block size. `caches` is one list
of per-layer arrays per group, in the order of the `GroupSpec`s (a plain
list of arrays is one group); each group has its own staging and its own
plan, and a request's groups travel in one READ.

Per-request isolation on D. Whatever goes wrong with one request (bad
params, a table that does not cover P's positions, a read error, a failed
fingerprint check) fails that request alone, in its logical block ids, and
frees every slot it took; every other request in the same call finishes or
fails on its own merits. Errors of the call itself (caches of another
layout, a request id already loading) raise before any state changes.

Heterogeneous TP: each side stages whole (global) blocks, gathered from all
of its process's shards, so P and D may shard their caches differently (TP 4
on P, TP 2 or 8 on D, MLA replicated): D checks only what fixes a block's
bytes (block shape, dtype, layers, kernel ratio) and `scatter_blocks`
re-shards to D's mesh. An MLA block replicated over `model` is staged, and
read, once.

Across hosts: where the caches span several processes, each process stages
only its piece of every block (`kvxfer.pieces`) with its own agent
(`<name>-<process>`, found through etcd), and the processes of each side
agree once per `get_finished` (`kvxfer.pieces.agree`, through JAX's
coordination service): P releases a request's slots once every process has
freed its piece, D finishes a request once every process has it and fails
it everywhere once any process failed it (see the README's "Across hosts").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np

from kvxfer.blocks import NULL_BLOCK, is_int
from kvxfer.errors import CorruptionError, InvalidInputError, KvxferError, LayoutMismatchError
from kvxfer.gather import compare_fingerprints, gather_into, scatter_blocks
from kvxfer.layout import CacheLayout
from kvxfer.pieces import (
    Piece,
    agree,
    gather_piece_into,
    piece_staging,
    process_pieces,
    scatter_piece,
    shared_instance,
    spans_processes,
    unit_sums,
)
from kvxfer.scheduler import GroupSpec, SaveTracker, ScheduledRequest
from kvxfer.staging import SlotMap, Staging, StagingFullError
from kvxfer.transport import (
    DecodeTransport,
    PrefillTransport,
    ReadParams,
    Source,
    TransportConfig,
    _parse_sources,
    new_instance,
)

logger = logging.getLogger(__name__)

_BLOCK_FIELDS = ("block_shape", "dtype", "num_layers", "kernel_ratio")


@dataclass(frozen=True)
class ConnectorConfig:
    """What a connector reads, in one place.

    - `transport`: the NIXL agent's settings (name, ports, deadlines, lease).
    - `staging_blocks`: kernel blocks per layer each group's host staging holds.
    - `kernel_ratio`: kernel blocks per logical (engine) block, for every group.
    - `verify_fingerprints`: D checks every received block against P's fingerprints.
    """

    transport: TransportConfig
    staging_blocks: int = 4096
    kernel_ratio: int = 1
    verify_fingerprints: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.transport, TransportConfig):
            raise InvalidInputError(
                f"ConnectorConfig transport must be a TransportConfig, got {self.transport!r:.80}")
        for name in ("staging_blocks", "kernel_ratio"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise InvalidInputError(f"ConnectorConfig {name} must be a positive int, got {value!r}")
        if not isinstance(self.verify_fingerprints, bool):
            raise InvalidInputError(
                f"ConnectorConfig verify_fingerprints must be a bool, got {self.verify_fingerprints!r}")


def _per_group(caches: object) -> tuple[list[list[jax.Array]], bool]:
    """`caches` as one list of per-layer arrays per group, and whether it came as one group."""
    if isinstance(caches, (jax.Array, np.ndarray)) or not isinstance(caches, Sequence) or not caches:
        raise InvalidInputError(
            f"caches must be a list of per-layer jax.Arrays (one group) or a list of such lists "
            f"(one per KV cache group), got {type(caches).__name__}")
    if isinstance(caches[0], jax.Array):
        return [list(caches)], True
    return [list(c) if isinstance(c, Sequence) else c for c in caches], False


def _layouts(caches: Sequence[Sequence[jax.Array]], kernel_ratio: int) -> list[CacheLayout]:
    return [CacheLayout.from_caches(c, kernel_ratio) for c in caches]


def _block_fields(layout: CacheLayout) -> dict[str, Any]:
    return {
        "block_shape": list(layout.block_shape),
        "dtype": layout.dtype,
        "num_layers": layout.num_layers,
        "kernel_ratio": layout.kernel_ratio,
    }


def _advertised(layouts: Sequence[CacheLayout]) -> dict[str, Any]:
    """The layout fields a peer checks at handshake (`check_block_compatible`), per group.

    P's full layouts travel with each request's params instead.
    """
    return {"groups": [_block_fields(layout) for layout in layouts]}


def check_block_compatible(local: Mapping[str, Any], remote: Mapping[str, Any]) -> None:
    """Peer check for connectors: every group's blocks must have the same bytes; sharding may differ."""
    ours, theirs = local.get("groups"), remote.get("groups")
    if not isinstance(theirs, list) or len(theirs) != len(ours):
        raise LayoutMismatchError(
            f"peer has {len(theirs) if isinstance(theirs, list) else theirs!r} KV cache groups, "
            f"local has {len(ours)}")
    diffs = [
        f"group {g} {key}: peer={t.get(key)!r} local={o.get(key)!r}"
        for g, (o, t) in enumerate(zip(ours, theirs))
        for key in _BLOCK_FIELDS
        if not isinstance(t, Mapping) or o.get(key) != t.get(key)
    ]
    if diffs:
        raise LayoutMismatchError("peer cache layout differs: " + "; ".join(diffs))


def _staging_for(layout: CacheLayout, config: ConnectorConfig) -> Staging:
    return Staging(layout.num_layers, config.staging_blocks, layout.block_shape, layout.np_dtype)


@dataclass
class _WorkerState:
    """A worker side's checked config, its caches' layouts, one staging per group, and,
    where the caches span several processes (hosts), this process's piece of every block."""

    config: ConnectorConfig
    layouts: list[CacheLayout]
    stagings: list[Staging]
    pieces: list[Piece] | None = None  # per group: the same units, maybe another axis

    @property
    def piece(self) -> Piece | None:
        return None if self.pieces is None else self.pieces[0]

    @property
    def transport_config(self) -> TransportConfig:
        """This process's agent settings: one agent per process, named `name-<process>`."""
        if self.piece is None:
            return self.config.transport
        return replace(self.config.transport,
                       name=f"{self.config.transport.name}-{jax.process_index()}")

    @property
    def transport_piece(self) -> tuple[int, int, int] | None:
        return None if self.piece is None else (self.piece.lo, self.piece.hi, self.piece.units)


def _worker_state(config: object, caches: object) -> _WorkerState:
    """A worker side's config (checked), its caches' layouts and one staging per group.

    Caches that span several processes are staged in pieces (`kvxfer.pieces`):
    every group must cut its blocks into the same units, and the agents find
    each other through etcd.
    """
    if not isinstance(config, ConnectorConfig):
        raise InvalidInputError(f"config must be a ConnectorConfig, got {config!r:.80}")
    per_group, _ = _per_group(caches)
    layouts = _layouts(per_group, config.kernel_ratio)
    if not spans_processes(per_group[0]):
        return _WorkerState(config, layouts, [_staging_for(layout, config) for layout in layouts])
    if not config.transport.uses_etcd:
        raise InvalidInputError(
            f"caches span {jax.process_count()} processes: their agents find each other "
            f"through etcd; give the TransportConfig etcd_endpoints")
    pieces = [Piece.local(c) for c in per_group]
    if any((p.units, p.lo, p.hi) != (pieces[0].units, pieces[0].lo, pieces[0].hi)
           for p in pieces):
        raise LayoutMismatchError(f"KV cache groups cut blocks into different pieces on this "
                                  f"process: {pieces}")
    return _WorkerState(config, layouts, [piece_staging(layout, piece, config.staging_blocks)
                                          for layout, piece in zip(layouts, pieces)], pieces)


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
      started under it).

    Plain data (ints, strs, lists): it crosses vLLM's scheduler -> worker
    boundary as `KVConnectorMetadata`.
    """

    instance: str = ""
    blocks: dict[str, tuple[Placed, ...]] = field(default_factory=dict)
    slots: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    holds: dict[str, int] = field(default_factory=dict)

    @property
    def completed(self) -> set[str]:
        return set(self.holds)

    @property
    def kernel_ids(self) -> dict[str, list[int]]:
        """Kernel ids saved per request, every group's in group order."""
        return {r: [k for placed in groups for _, k in placed] for r, groups in self.blocks.items()}


def _kernel_placed(placed: Iterable[tuple[int, int]], ratio: int) -> Placed:
    return [(index * ratio + j, block * ratio + j) for index, block in placed for j in range(ratio)]


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
    """

    def __init__(self, groups: Sequence[GroupSpec], *, staging_blocks: int, kernel_ratio: int,
                 address: PeerAddress, instance: str | None = None,
                 sources: Sequence[Source] = (), units: int = 0):
        self.tracker = SaveTracker(groups)
        if not isinstance(address, PeerAddress):
            raise InvalidInputError(f"address must be a PeerAddress, got {address!r:.80}")
        for name, value in (("staging_blocks", staging_blocks), ("kernel_ratio", kernel_ratio)):
            if not is_int(value) or value <= 0:
                raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
        self.kernel_ratio = kernel_ratio
        self.address = address
        if sources or units:  # checked as D will check the params that name them
            if not all(isinstance(x, Source) for x in sources):
                raise InvalidInputError(f"sources must be Source entries, got {sources!r:.80}")
            _parse_sources([{"peer": x.peer, "units": [x.lo, x.hi]} for x in sources], units)
        self.sources, self.units = tuple(sources), units
        self.instance = instance or new_instance()
        self.slot_maps = [SlotMap(staging_blocks) for _ in self.tracker.groups]
        self._next_generation = 1
        self._params: dict[str, dict[str, Any]] = {}  # completed, not yet asked for
        self._held: set[str] = set()  # params handed out, slots not yet freed by the worker

    def add_request(self, req_id: str, num_prompt_tokens: int) -> None:
        """A request whose prompt KV must reach D (vLLM: `do_remote_decode`).

        Refused while P still holds a request of that id (being prefilled,
        staged, or waiting for D): its params could otherwise read the new
        prefill's blocks.
        """
        if not isinstance(req_id, str) or not req_id:
            raise InvalidInputError(f"request id must be a non-empty str, got {req_id!r}")
        if req_id in self._held or req_id in self._params or any(req_id in m for m in self.slot_maps):
            raise InvalidInputError(
                f"request {req_id!r} is still held on P for D; it cannot be added again until "
                f"D has read it or its lease expired (get_finished reports it)")
        self.tracker.add(req_id, num_prompt_tokens)

    def build_connector_meta(self, scheduled: Iterable[ScheduledRequest]) -> SaveMeta:
        """This step's saves: kernel ids, kernel positions and staging slots of every group."""
        scheduled = list(scheduled)
        meta = SaveMeta(instance=self.instance)
        restarted = {s.req_id for s in scheduled if s.full_table and s.req_id in self.tracker}
        for req_id, groups in self.tracker.plan_placed(scheduled).items():
            if req_id in restarted:  # new, or resumed after preemption: staged afresh
                self._free_slots(req_id)
            placed = tuple(_kernel_placed(g, self.kernel_ratio) for g in groups)
            try:
                slots = tuple(m.assign(req_id, [pos for pos, _ in blocks])
                              for m, blocks in zip(self.slot_maps, placed))
            except StagingFullError as e:
                logger.warning("P drops request %s: %s; D will compute its prompt", req_id, e)
                self.abort(req_id)
                continue
            meta.blocks[req_id], meta.slots[req_id] = placed, slots
            if req_id not in self.tracker:  # its prefill completes this step
                self._complete(req_id, meta)
        return meta

    def _complete(self, req_id: str, meta: SaveMeta) -> None:
        a = self.address
        params = ReadParams.staged(self.slot_maps, req_id, peer=a.name, instance=self.instance,
                                   host=a.host, port=a.port, generation=self._next_generation,
                                   sources=self.sources, units=self.units)
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
        """Drop an aborted request's plan state and slots (not those D may be reading)."""
        self.tracker.abort(req_id)
        self._params.pop(req_id, None)
        if req_id not in self._held:
            self._free_slots(req_id)

    def release(self, freed: Iterable[str]) -> None:
        """The worker freed these requests (read by D, or lease expired): reuse their slots."""
        for req_id in freed:
            self._held.discard(req_id)
            self._free_slots(req_id)

    def held(self) -> list[str]:
        """Requests handed to D whose slots the worker has not yet freed."""
        return sorted(self._held)

    def _free_slots(self, req_id: str) -> None:
        for m in self.slot_maps:
            if req_id in m:
                m.free(req_id)


class PrefillWorker:
    """P's worker side: copies planned blocks into staging and serves them to D.

    Arguments:
        config: `ConnectorConfig` (`staging_blocks` must be the scheduler side's).
        caches: the current per-layer caches of each group (a plain list of
            arrays when there is one group); only their layouts are kept.
        instance: the scheduler side's P instance (`new_instance()` when None).
    """

    def __init__(self, config: ConnectorConfig,
                 caches: Sequence[jax.Array] | Sequence[Sequence[jax.Array]],
                 instance: str | None = None):
        state = _worker_state(config, caches)
        self.config, self.layouts, self.stagings, self.pieces = (
            state.config, state.layouts, state.stagings, state.pieces)
        self.piece = state.piece
        if self.piece is not None and instance is None:
            instance = shared_instance()  # one identity for every process of this P
        self._sources = [] if self.piece is None else [
            Source(f"{config.transport.name}-{process}", p.lo, p.hi)
            for process, p in process_pieces(_per_group(caches)[0][0]).items()]
        self.transport = PrefillTransport(state.transport_config, self.stagings,
                                          _advertised(self.layouts), instance=instance,
                                          piece=state.transport_piece)

    @property
    def address(self) -> PeerAddress:
        t = self.transport
        return PeerAddress(t.config.name, t.config.host, t.port)

    @property
    def sources(self) -> list[Source]:
        """Every process of a P that spans several (its agent, the units it stages); else []."""
        return list(self._sources)

    def save(self, caches: Sequence[jax.Array] | Sequence[Sequence[jax.Array]],
             meta: SaveMeta) -> None:
        """Copy `meta`'s blocks from the caches into their slots, with their fingerprints.

        One gather per group for every request of the step, straight into the
        regions NIXL reads; a block copied again by a later chunk goes back to
        its slot. Requests completing this step are then held for D.
        """
        if meta.instance != self.transport.instance:
            raise InvalidInputError(
                f"metadata is for P instance {meta.instance!r}, this worker serves "
                f"{self.transport.instance!r}")
        per_group, _ = _per_group(caches)
        if len(per_group) != len(self.layouts):
            raise InvalidInputError(
                f"caches hold {len(per_group)} groups, this connector {len(self.layouts)}")
        for g, (group_caches, staging) in enumerate(zip(per_group, self.stagings)):
            ids = [k for groups in meta.blocks.values() for _, k in groups[g]]
            if not ids:
                continue
            slots = np.asarray([s for groups in meta.slots.values() for s in groups[g]], np.int64)
            if self.piece is not None:  # this process's units, with their sums
                gather_piece_into(group_caches, np.asarray(ids, np.int64), staging, slots,
                                  self.pieces[g])
                continue
            prints = gather_into(group_caches, np.asarray(ids, np.int64), staging.regions, slots)
            staging.prints[slots] = prints.T
        for req_id, generation in meta.holds.items():
            self.transport.lease(req_id, generation)

    def poll(self) -> list[str]:
        """Requests D has read, or whose lease expired: their slots may be reused."""
        return self.transport.poll()

    def close(self) -> None:
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
    """

    def __init__(self, config: ConnectorConfig, groups: Sequence[GroupSpec],
                 caches: Sequence[jax.Array] | Sequence[Sequence[jax.Array]]):
        if not isinstance(config, ConnectorConfig):
            raise InvalidInputError(f"config must be a ConnectorConfig, got {config!r:.80}")
        groups = list(groups)
        per_group, _ = _per_group(caches)
        if len(per_group) != len(groups):
            raise InvalidInputError(f"caches hold {len(per_group)} groups, the GroupSpecs "
                                    f"{len(groups)}")
        SaveTracker(groups)  # checks the specs before a NIXL agent starts
        self.config = config
        self.worker = PrefillWorker(config, caches)
        try:
            self.scheduler = PrefillScheduler(
                groups, staging_blocks=config.staging_blocks, kernel_ratio=config.kernel_ratio,
                address=self.worker.address, instance=self.worker.transport.instance,
                sources=self.worker.sources,
                units=self.worker.piece.units if self.worker.piece else 0)
        except BaseException:
            self.worker.close()
            raise
        self._freed_here: set[str] = set()  # multi-host: freed here, not yet everywhere

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

    def add_request(self, req_id: str, num_prompt_tokens: int) -> None:
        """See `PrefillScheduler.add_request`."""
        self.scheduler.add_request(req_id, num_prompt_tokens)

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

    def abort(self, req_id: str) -> None:
        """See `PrefillScheduler.abort`."""
        self.scheduler.abort(req_id)

    def get_finished(self) -> list[str]:
        """Requests D has read, or whose lease expired: their blocks may be freed.

        Across hosts (every process runs the same scheduler, SPMD) a request is
        released once every process has freed its piece, so that every
        process's scheduler reuses the same slots at the same step.
        """
        freed = self.worker.poll()
        if self.worker.piece is None:
            self.scheduler.release(freed)
            return freed
        self._freed_here.update(freed)
        held = self.scheduler.held()
        if not held:
            return []
        everywhere = agree([r in self._freed_here for r in held]).all(axis=0)
        released = [r for r, ok in zip(held, everywhere) if ok]
        self._freed_here.difference_update(released)
        self.scheduler.release(released)
        return released

    def close(self) -> None:
        self.worker.close()


@dataclass
class _Load:
    keys: list[list[int]]  # per group, P's kernel positions
    kernel_ids: list[list[int]]  # per group, D's kernel ids, aligned with keys
    logical_ids: list[int]  # D's logical ids, all groups: what a failure reports


def _table_ids(table: object) -> list[int]:
    """Every plausible block id in a (possibly malformed) table: what a failure reports."""
    ids: dict[int, None] = {}
    stack = [table]
    while stack:
        item = stack.pop()
        if is_int(item) and item > NULL_BLOCK:
            ids.setdefault(item, None)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return list(ids)


class DecodeConnector:
    """D side: reads from P over NIXL, verifies, and scatters into the caches.

    Arguments:
        config: `ConnectorConfig`.
        caches: the current per-layer caches of each group (a plain list of
            arrays when there is one group); only their layouts are kept.
    """

    def __init__(self, config: ConnectorConfig,
                 caches: Sequence[jax.Array] | Sequence[Sequence[jax.Array]]):
        state = _worker_state(config, caches)
        self.config, self.layouts, self.stagings, self.pieces = (
            state.config, state.layouts, state.stagings, state.pieces)
        self.piece = state.piece
        self.transport = DecodeTransport(
            state.transport_config, self.stagings, _advertised(self.layouts),
            layout_check=check_block_compatible, piece=state.transport_piece,
            reader=(jax.process_index(), jax.process_count()) if self.piece else (0, 1),
        )
        self._read_here: set[str] = set()  # multi-host: read here, not yet agreed
        self._loads: dict[str, _Load] = {}
        self._load_errors: set[int] = set()
        self._refused: list[str] = []  # failed in start_load_kv, reported by get_finished
        self._held_locally: list[str] = []  # nothing to read, reported finished by get_finished

    @property
    def staging(self) -> Staging:
        """The first group's staging (the only one for a single-group model)."""
        return self.stagings[0]

    def start_load_kv(self, requests: Mapping[str, tuple[Any, ...]]) -> None:
        """Start reading each request: `{req_id: (kv_transfer_params, D's block table[, have])}`.

        D's table is, per group, its logical block ids in token order (a plain
        list of ids when there is one group); entries past the prompt
        (allocated for decode) are ignored. Each block P sends lands in the
        entry at its position. `have` (optional), per group, counts the
        leading table entries D already holds (a local prefix-cache hit):
        blocks P sends for those entries are not read. A request whose params
        or table are bad is failed alone (reported by the next
        `get_finished`); a request id already loading raises
        `InvalidInputError` before anything starts.
        """
        if not isinstance(requests, Mapping):
            raise InvalidInputError(f"requests must be a dict, got {type(requests).__name__}")
        for req_id in requests:
            if not isinstance(req_id, str) or not req_id:
                raise InvalidInputError(f"request id must be a non-empty str, got {req_id!r}")
            if req_id in self._loads or req_id in self._refused or req_id in self._held_locally:
                raise InvalidInputError(f"request {req_id!r} is already loading")
        for req_id, entry in requests.items():
            ok = isinstance(entry, (tuple, list)) and len(entry) in (2, 3)
            params, table, have = (*entry, None)[:3] if ok else (None, (), None)
            try:
                if not ok:
                    raise InvalidInputError(
                        f"request {req_id!r}: expected (kv_transfer_params, block table[, have]), "
                        f"got {entry!r:.80}")
                p, load = self._prepare(req_id, params, table, have)
                if not any(load.keys):
                    self._held_locally.append(req_id)  # D has every block P sends
                    continue
                self.transport.start_read(req_id, p.to_dict(), load.logical_ids)
            except KvxferError as e:
                logger.warning("D refuses request %s: %s", req_id, e)
                self._refused.append(req_id)
                self._load_errors.update(_table_ids(table))
                continue
            self._loads[req_id] = load

    def _prepare(self, req_id: str, params: Any, table: Any,
                 have: Any) -> tuple[ReadParams, _Load]:
        """Check `params` against D's table; map P's positions to D's kernel ids.

        Returns the params to read (without the blocks D already has) and the load.
        """
        p = ReadParams.parse(params, len(self.layouts))
        tables = [table] if len(self.layouts) == 1 and _is_id_list(table) else table
        if (not isinstance(tables, (list, tuple)) or len(tables) != len(self.layouts)
                or not all(_is_id_list(t) for t in tables)):
            raise InvalidInputError(
                f"request {req_id!r}: D's block table must be {len(self.layouts)} list(s) of "
                f"non-negative int block ids, got {table!r:.120}")
        have = [0] * len(self.layouts) if have is None else have
        if (not isinstance(have, (list, tuple)) or len(have) != len(self.layouts)
                or not all(is_int(h) and h >= 0 for h in have)):
            raise InvalidInputError(f"request {req_id!r}: 'have' must be {len(self.layouts)} "
                                    f"non-negative int(s), got {have!r:.80}")
        load = _Load([], [], [])
        keep_keys, keep_slots = [], []
        logical: dict[int, None] = {}
        for g, (keys, slots, ours) in enumerate(zip(p.keys, p.slots, self.layouts)):
            ratio, d_table = ours.kernel_ratio, tables[g]
            kept = [(key, slot) for key, slot in zip(keys, slots) if key // ratio >= have[g]]
            kernel_ids = []
            for key, _ in kept:
                entry, j = divmod(key, ratio)
                if entry >= len(d_table):
                    raise InvalidInputError(
                        f"request {req_id!r} group {g}: P sends the block at table entry {entry}, "
                        f"D's table has {len(d_table)} entries")
                if d_table[entry] == NULL_BLOCK:
                    raise InvalidInputError(
                        f"request {req_id!r} group {g}: D's table holds the null block at entry "
                        f"{entry}, where P sends a block")
                kernel_ids.append(d_table[entry] * ratio + j)
                logical.setdefault(d_table[entry], None)
            bad = [k for k in kernel_ids if k >= ours.num_blocks]
            if bad:
                raise InvalidInputError(f"request {req_id!r} group {g}: D block ids "
                                        f"{sorted({k // ratio for k in bad})[:8]} are past D's "
                                        f"{ours.num_blocks // ratio} blocks")
            if len(set(kernel_ids)) != len(kernel_ids):
                raise InvalidInputError(f"request {req_id!r} group {g}: D's table repeats a block "
                                        f"id at the positions P sends")
            keep_keys.append(tuple(k for k, _ in kept))
            keep_slots.append(tuple(s for _, s in kept))
            load.keys.append([k for k, _ in kept])
            load.kernel_ids.append(kernel_ids)
        load.logical_ids = list(logical)
        return replace(p, keys=tuple(keep_keys), slots=tuple(keep_slots)), load

    def get_finished(self, caches: Sequence[jax.Array] | Sequence[Sequence[jax.Array]]
                     ) -> tuple[Any, list[str], list[str]]:
        """Advance reads; scatter the completed ones into the caches.

        Returns `(caches, finished, failed)`: the new caches, in the form they
        were given (the input ones are donated when anything was scattered
        into them), the requests whose KV is now in them, and the requests
        that failed (their logical ids are in `get_block_ids_with_load_errors`).
        Never raises for a per-request problem; caches of another layout raise
        `LayoutMismatchError` before any state changes.
        """
        per_group, single = _per_group(caches)
        if len(per_group) != len(self.layouts):
            raise LayoutMismatchError(
                f"caches hold {len(per_group)} groups, this connector {len(self.layouts)}")
        for g, (group_caches, layout) in enumerate(zip(per_group, self.layouts)):
            got = CacheLayout.from_caches(group_caches, self.config.kernel_ratio)
            if got != layout:
                raise LayoutMismatchError(f"group {g} caches have layout {got}, the connector "
                                          f"was built for {layout}")
        done, failed = self.transport.poll()
        if self.piece is not None:
            done, failed = self._agree_reads(done, failed)
        failed_ids, self._refused = self._refused, []
        local, self._held_locally = self._held_locally, []
        for req_id, logical in failed.items():
            self._load_errors.update(logical)
            self._loads.pop(req_id, None)
            failed_ids.append(req_id)
        loads = {req_id: self._loads.pop(req_id) for req_id in done if req_id in self._loads}
        bad: dict[str, str] = {}
        try:
            for g in range(len(self.layouts)):
                old = per_group[g]
                per_group[g] = self._write_group(g, old, loads, bad)
                _follow_donations(per_group[g + 1:], old, per_group[g])
        finally:
            for req_id in loads:
                self.transport.free(req_id)
        if self.piece is not None and loads:  # a block bad on one host is bad on every host
            everywhere = agree([r in bad for r in loads]).any(axis=0)
            for req_id, is_bad in zip(list(loads), everywhere):
                if is_bad and req_id not in bad:
                    bad[req_id] = "its blocks failed verification on another process"
        finished = local
        for req_id, load in loads.items():
            if req_id in bad:
                logger.error("D request %s failed after its read: %s", req_id, bad[req_id])
                self._load_errors.update(load.logical_ids)
                failed_ids.append(req_id)
            else:
                finished.append(req_id)
        return (per_group[0] if single else per_group), finished, failed_ids

    def _agree_reads(self, done: list[str], failed: dict[str, list[int]]
                     ) -> tuple[list[str], dict[str, list[int]]]:
        """Across hosts: a read is done once it is done on every process of this D, and failed
        everywhere once it failed on any (every process loads the same requests, SPMD)."""
        self._read_here.update(done)
        pending = sorted(self._loads)
        if not pending:
            return [], failed
        here = [2 if r in failed else 1 if r in self._read_here else 0 for r in pending]
        states = agree(here)
        agreed_done, agreed_failed = [], dict(failed)
        for req_id, column in zip(pending, states.T):
            if (column == 2).any():
                if req_id not in agreed_failed:
                    agreed_failed[req_id] = list(self._loads[req_id].logical_ids)
                    self.transport.free(req_id)  # read here, failed elsewhere
                self._read_here.discard(req_id)
            elif (column == 1).all():
                agreed_done.append(req_id)
                self._read_here.discard(req_id)
        return agreed_done, agreed_failed

    def _write_group(self, g: int, caches: list[jax.Array], loads: Mapping[str, _Load],
                     bad: dict[str, str]) -> list[jax.Array]:
        """Scatter group `g` of every read request from staging into `caches`, then verify.

        One scatter straight out of the staging regions, which also fingerprints
        the blocks as they landed in the caches, checked per request against
        P's: a flipped bit anywhere from P's gather to here fails the request
        (its blocks are its own, and the engine recomputes them). A request's
        problem goes into `bad` (request id -> reason).
        """
        staging = self.stagings[g]
        ids: list[int] = []
        slots: list[int] = []
        spans: list[tuple[str, int, int]] = []  # (request, first row in ids, count)
        taken: set[int] = set()
        for req_id, load in loads.items():
            if req_id in bad or not load.keys[g]:
                continue
            if taken.intersection(load.kernel_ids[g]):
                bad[req_id] = f"group {g}: its D blocks overlap another request's in this step"
                continue
            try:
                slots += staging.slots(req_id, load.keys[g])
            except KvxferError as e:
                bad[req_id] = str(e)
                continue
            taken.update(load.kernel_ids[g])
            spans.append((req_id, len(ids), len(load.keys[g])))
            ids += load.kernel_ids[g]
        if not ids:
            return caches
        ids_array, rows = np.asarray(ids, np.int64), np.asarray(slots, np.int64)
        if self.piece is not None:  # this process's units, checked against P's sums of them
            verify = self.config.verify_fingerprints
            caches, got = scatter_piece(caches, staging, ids_array, rows, self.pieces[g],
                                        sums=verify)
            if got is not None:
                expected = unit_sums(staging, rows)
                for req_id, start, count in spans:
                    if not np.array_equal(got[:, start : start + count],
                                          expected[:, start : start + count]):
                        bad[req_id] = f"group {g}: its blocks' word sums differ from P's"
            return caches
        if not self.config.verify_fingerprints:
            return scatter_blocks(caches, staging.regions, ids_array, rows=rows)
        caches, got = scatter_blocks(caches, staging.regions, ids_array, rows=rows,
                                     fingerprints=True)
        expected = staging.prints[slots].T  # P's, read with the blocks
        for req_id, start, count in spans:
            try:
                compare_fingerprints(got[:, start : start + count],
                                     expected[:, start : start + count])
            except CorruptionError as e:
                bad[req_id] = f"group {g}: {e}"
        return caches

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Logical block ids whose load failed since the last call (to recompute)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def pending(self) -> list[str]:
        return self.transport.pending()

    def close(self) -> None:
        self.transport.close()


def _follow_donations(later: list[list[jax.Array]], old: Sequence[jax.Array],
                      new: Sequence[jax.Array]) -> None:
    """Groups may share arrays (vLLM's hybrid allocator gives layer j of every group one
    tensor, their blocks disjoint): where a later group holds an array just donated by
    a scatter, it now holds the array that replaced it."""
    replaced = {id(a): b for a, b in zip(old, new) if a is not b}
    if replaced:
        for caches in later:
            caches[:] = [replaced.get(id(a), a) for a in caches]


def _is_id_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(is_int(b) and b >= 0 for b in value)
