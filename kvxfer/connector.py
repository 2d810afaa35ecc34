"""P and D put together, in the engine's terms (vLLM's `KVConnectorBase_V1`).

P (`PrefillConnector`): the scheduler hands each step to
`build_connector_meta`, which asks the `SaveTracker` which blocks to copy
and at which table positions; after the forward pass `wait_for_save` copies
them out of the device caches straight into that group's registered host
staging (one gather per KV cache group for all requests of the step, with
fingerprints), keyed by table position. When a request's prefill completes its
blocks are held under a lease and `request_finished` returns the
`kv_transfer_params` the engine forwards to D. `get_finished` reports the
requests D has read (or whose lease expired), whose blocks the engine may now
free.

D (`DecodeConnector`): `start_load_kv` checks each request's params against
D's own block table and posts the NIXL reads; `get_finished` advances them,
scatters the received blocks from staging into the device caches in place
(one scatter per group), fingerprints them there on device and checks each
request against P's fingerprints (a mismatch fails the request: the blocks it
wrote are its own, and recomputed), and returns the new caches with the
finished and failed request ids; `get_block_ids_with_load_errors` lists the
logical block ids to recompute.

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
read, once. This holds for one process per instance (one host).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from kvxfer.blocks import NULL_BLOCK, is_int
from kvxfer.errors import CorruptionError, InvalidInputError, KvxferError, LayoutMismatchError
from kvxfer.gather import compare_fingerprints, fingerprint_blocks, gather_into, scatter_blocks
from kvxfer.layout import CacheLayout
from kvxfer.scheduler import GroupSpec, SaveTracker, ScheduledRequest
from kvxfer.staging import Staging, StagingFullError
from kvxfer.transport import DecodeTransport, PrefillTransport, ReadParams, TransportConfig

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


Placed = list[tuple[int, int]]
"""`(kernel position, kernel block id)` pairs of one group."""


@dataclass
class SaveMeta:
    """One step's saves, and which requests restart or complete.

    `blocks[req_id][g]` lists group `g`'s `(kernel position, kernel id)` pairs.
    """

    blocks: dict[str, tuple[Placed, ...]] = field(default_factory=dict)
    restarted: set[str] = field(default_factory=set)
    completed: set[str] = field(default_factory=set)

    @property
    def kernel_ids(self) -> dict[str, list[int]]:
        """Kernel ids saved per request, every group's in group order."""
        return {r: [k for placed in groups for _, k in placed] for r, groups in self.blocks.items()}


def _kernel_placed(placed: Iterable[tuple[int, int]], ratio: int) -> Placed:
    return [(index * ratio + j, block * ratio + j) for index, block in placed for j in range(ratio)]


class PrefillConnector:
    """P side: save plans, gathers into registered staging, leases for D.

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
        self.config = config
        self.tracker = SaveTracker(groups)
        per_group, _ = _per_group(caches)
        if len(per_group) != len(self.tracker.groups):
            raise InvalidInputError(f"caches hold {len(per_group)} groups, the GroupSpecs "
                                    f"{len(self.tracker.groups)}")
        self.layouts = _layouts(per_group, config.kernel_ratio)
        self.stagings = [_staging_for(layout, config) for layout in self.layouts]
        self.transport = PrefillTransport(config.transport, self.stagings, _advertised(self.layouts))
        # req -> per group: kernel position -> uint32[layers]
        self._fingerprints: dict[str, list[dict[int, np.ndarray]]] = {}
        self._params: dict[str, dict[str, Any]] = {}

    @property
    def staging(self) -> Staging:
        """The first group's staging (the only one for a single-group model)."""
        return self.stagings[0]

    # -- scheduler side

    def add_request(self, req_id: str, num_prompt_tokens: int) -> None:
        """A request whose prompt KV must reach D (vLLM: `do_remote_decode`).

        Refused while P still holds a request of that id (being prefilled,
        staged, or waiting for D): its params could otherwise read the new
        prefill's blocks.
        """
        if not isinstance(req_id, str) or not req_id:
            raise InvalidInputError(f"request id must be a non-empty str, got {req_id!r}")
        if (req_id in self.transport.held() or req_id in self._params
                or any(req_id in s for s in self.stagings)):
            raise InvalidInputError(
                f"request {req_id!r} is still held on P for D; it cannot be added again until "
                f"D has read it or its lease expired (get_finished reports it)")
        self.tracker.add(req_id, num_prompt_tokens)

    def build_connector_meta(self, scheduled: Iterable[ScheduledRequest]) -> SaveMeta:
        """This step's saves, in kernel block ids and kernel positions of every group."""
        scheduled = list(scheduled)
        meta = SaveMeta()
        tracked = {s.req_id: s for s in scheduled if s.req_id in self.tracker}
        ratio = self.config.kernel_ratio
        for req_id, groups in self.tracker.plan_placed(scheduled).items():
            meta.blocks[req_id] = tuple(_kernel_placed(placed, ratio) for placed in groups)
            if tracked[req_id].full_table:
                meta.restarted.add(req_id)
            if req_id not in self.tracker:
                meta.completed.add(req_id)
        return meta

    # -- worker side

    def wait_for_save(self, caches: Sequence[jax.Array] | Sequence[Sequence[jax.Array]],
                      meta: SaveMeta) -> None:
        """Copy this step's planned blocks from the caches into staging.

        One gather per group for every request of the step; a block copied
        again by a later chunk replaces its earlier copy (same position, same
        slot). Completed requests are then held for D under a lease.
        """
        per_group, _ = _per_group(caches)
        if len(per_group) != len(self.layouts):
            raise InvalidInputError(
                f"caches hold {len(per_group)} groups, this connector {len(self.layouts)}")
        for req_id in meta.restarted:
            for staging in self.stagings:  # resumed after preemption: start over
                if req_id in staging:
                    staging.free(req_id)
            self._fingerprints.pop(req_id, None)
        for g, (group_caches, staging) in enumerate(zip(per_group, self.stagings)):
            placed = [(req_id, groups[g]) for req_id, groups in meta.blocks.items() if groups[g]]
            ids, slots, assigned, full = [], [], [], None
            for req_id, blocks in placed:
                try:
                    slots += staging.assign(req_id, [pos for pos, _ in blocks])
                except StagingFullError as e:
                    full = e  # stage the requests that fit, then raise
                    break
                ids += [k for _, k in blocks]
                assigned.append((req_id, blocks))
            # Straight from the caches into the slots NIXL reads: no host copy between.
            prints = gather_into(group_caches, np.asarray(ids, np.int64), staging.regions,
                                 np.asarray(slots, np.int64))
            start = 0
            for req_id, blocks in assigned:
                per_block = self._fingerprints.setdefault(
                    req_id, [{} for _ in self.stagings])[g]
                for i, (pos, _) in enumerate(blocks):
                    per_block[pos] = prints[:, start + i]
                start += len(blocks)
            if full is not None:
                raise full
        for req_id in meta.completed:
            self._hold(req_id)

    def _hold(self, req_id: str) -> None:
        if not any(req_id in s for s in self.stagings):
            logger.warning("P request %s completed with nothing staged", req_id)
            return
        params = self.transport.hold(req_id)
        prints = self._fingerprints.pop(req_id)
        for g, group in enumerate(params["groups"]):
            num_layers = self.layouts[g].num_layers
            group["fingerprints"] = (
                np.stack([prints[g][k] for k in group["keys"]], axis=1) if group["keys"]
                else np.zeros((num_layers, 0), np.uint32)).tolist()
            group["layout"] = self.layouts[g].to_dict()
        self._params[req_id] = params

    def request_finished(self, req_id: str) -> dict[str, Any] | None:
        """The `kv_transfer_params` D needs, once the request's prefill is saved.

        A request finished before its prefill completed has nothing for D: its
        plan state and staged blocks are dropped and None is returned.
        """
        if req_id in self.tracker:
            self.abort(req_id)
            return None
        return self._params.pop(req_id, None)

    def abort(self, req_id: str) -> None:
        """Drop an aborted request's plan state and staged blocks (not those D may be reading)."""
        self.tracker.abort(req_id)
        self._params.pop(req_id, None)
        self._fingerprints.pop(req_id, None)
        if req_id not in self.transport.held():
            for staging in self.stagings:
                if req_id in staging:
                    staging.free(req_id)

    def get_finished(self) -> list[str]:
        """Requests D has read, or whose lease expired: their blocks may be freed."""
        return self.transport.poll()

    def close(self) -> None:
        self.transport.close()


@dataclass
class _Load:
    layouts: list[CacheLayout]  # P's, per group
    fingerprints: list[np.ndarray]  # per group, uint32[layers, n]
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
        if not isinstance(config, ConnectorConfig):
            raise InvalidInputError(f"config must be a ConnectorConfig, got {config!r:.80}")
        self.config = config
        per_group, _ = _per_group(caches)
        self.layouts = _layouts(per_group, config.kernel_ratio)
        self.stagings = [_staging_for(layout, config) for layout in self.layouts]
        self.transport = DecodeTransport(
            config.transport, self.stagings, _advertised(self.layouts),
            layout_check=check_block_compatible,
        )
        self._loads: dict[str, _Load] = {}
        self._load_errors: set[int] = set()
        self._refused: list[str] = []  # failed in start_load_kv, reported by get_finished

    @property
    def staging(self) -> Staging:
        """The first group's staging (the only one for a single-group model)."""
        return self.stagings[0]

    def start_load_kv(self, requests: Mapping[str, tuple[Mapping[str, Any], Any]]) -> None:
        """Start reading each request: `{req_id: (kv_transfer_params, D's block table)}`.

        D's table is, per group, its logical block ids in token order (a plain
        list of ids when there is one group); entries past the prompt
        (allocated for decode) are ignored. Each block P sends lands in the
        entry at its position. A request whose params or table are bad is
        failed alone (reported by the next `get_finished`); a request id
        already loading raises `InvalidInputError` before anything starts.
        """
        if not isinstance(requests, Mapping):
            raise InvalidInputError(f"requests must be a dict, got {type(requests).__name__}")
        for req_id in requests:
            if not isinstance(req_id, str) or not req_id:
                raise InvalidInputError(f"request id must be a non-empty str, got {req_id!r}")
            if req_id in self._loads or req_id in self._refused:
                raise InvalidInputError(f"request {req_id!r} is already loading")
        for req_id, entry in requests.items():
            pair = isinstance(entry, (tuple, list)) and len(entry) == 2
            params, table = entry if pair else (None, ())
            try:
                if not pair:
                    raise InvalidInputError(
                        f"request {req_id!r}: expected (kv_transfer_params, block table), "
                        f"got {entry!r:.80}")
                load = self._prepare(req_id, params, table)
                self.transport.start_read(req_id, params, load.logical_ids)
            except KvxferError as e:
                logger.warning("D refuses request %s: %s", req_id, e)
                self._refused.append(req_id)
                self._load_errors.update(_table_ids(table))
                continue
            self._loads[req_id] = load

    def _prepare(self, req_id: str, params: Any, table: Any) -> _Load:
        """Check `params` against D's table and layouts; map P's positions to D's kernel ids."""
        p = ReadParams.parse(params, len(self.layouts))
        tables = [table] if len(self.layouts) == 1 and _is_id_list(table) else table
        if (not isinstance(tables, (list, tuple)) or len(tables) != len(self.layouts)
                or not all(_is_id_list(t) for t in tables)):
            raise InvalidInputError(
                f"request {req_id!r}: D's block table must be {len(self.layouts)} list(s) of "
                f"non-negative int block ids, got {table!r:.120}")
        load = _Load([], [], [], [], [])
        logical: dict[int, None] = {}
        for g, (keys, ours, group) in enumerate(zip(p.keys, self.layouts, params["groups"])):
            try:
                theirs = CacheLayout.from_dict(group["layout"])
                prints = np.asarray(group["fingerprints"])
            except (KeyError, TypeError, ValueError) as e:
                raise InvalidInputError(f"request {req_id!r} group {g}: params lack a valid "
                                        f"layout or fingerprints: {e!r:.120}") from None
            check_block_compatible({"groups": [_block_fields(ours)]},
                                   {"groups": [_block_fields(theirs)]})
            want = (theirs.num_layers, len(keys))
            if (prints.shape != want or not np.issubdtype(prints.dtype, np.integer)
                    or (prints.size and (prints.min() < 0 or prints.max() >= 1 << 32))):
                raise InvalidInputError(
                    f"request {req_id!r} group {g}: fingerprints of shape {prints.shape} "
                    f"(dtype {prints.dtype}); expected uint32 {list(want)}")
            ratio, d_table = ours.kernel_ratio, tables[g]
            kernel_ids = []
            for key in keys:
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
            load.layouts.append(theirs)
            load.fingerprints.append(prints.astype(np.uint32))
            load.keys.append(list(keys))
            load.kernel_ids.append(kernel_ids)
        load.logical_ids = list(logical)
        return load

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
        failed_ids, self._refused = self._refused, []
        for req_id, logical in failed.items():
            self._load_errors.update(logical)
            self._loads.pop(req_id, None)
            failed_ids.append(req_id)
        loads = {req_id: self._loads.pop(req_id) for req_id in done if req_id in self._loads}
        bad: dict[str, str] = {}
        try:
            for g in range(len(self.layouts)):
                per_group[g] = self._write_group(g, per_group[g], loads, bad)
        finally:
            for req_id in loads:
                self.transport.free(req_id)
        finished = []
        for req_id, load in loads.items():
            if req_id in bad:
                logger.error("D request %s failed after its read: %s", req_id, bad[req_id])
                self._load_errors.update(load.logical_ids)
                failed_ids.append(req_id)
            else:
                finished.append(req_id)
        return (per_group[0] if single else per_group), finished, failed_ids

    def _write_group(self, g: int, caches: list[jax.Array], loads: Mapping[str, _Load],
                     bad: dict[str, str]) -> list[jax.Array]:
        """Scatter group `g` of every read request from staging into `caches`, then verify.

        One scatter straight out of the staging regions, then one on-device
        fingerprint of the blocks as they landed, checked per request against
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
        ids_array = np.asarray(ids, np.int64)
        caches = scatter_blocks(caches, staging.regions, ids_array, rows=np.asarray(slots, np.int64))
        if self.config.verify_fingerprints:
            got = fingerprint_blocks(caches, ids_array)
            for req_id, start, count in spans:
                try:
                    compare_fingerprints(got[:, start : start + count],
                                         loads[req_id].fingerprints[g])
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


def _is_id_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(is_int(b) and b >= 0 for b in value)
