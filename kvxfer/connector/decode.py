"""D's worker side: reads from P over NIXL, verifies, and scatters into the caches.

`start_load_kv` checks each request's params against D's block table, skips
the entries D already holds (a local prefix hit), places every block P sends
at the same position of D's table (`kvxfer.plan.blocks.kernel_placement`) and
posts the reads. `get_finished` advances them, scatters what arrived from
staging into the device caches in place (one scatter per group), checks each
request's blocks as they landed against P's fingerprints, and returns the
new caches with the finished and failed request ids. Whatever goes wrong
with one request (bad params, a table that does not cover P's positions, a
read error, a failed check) fails that request alone, in its logical block
ids (`get_block_ids_with_load_errors`), and frees every slot it took.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from kvxfer.connector._processes import Spans, for_caches, per_group
from kvxfer.connector.config import ConnectorConfig
from kvxfer.connector.scheduler import LoadRequest
from kvxfer.device.layout import CacheLayout, advertised, check_block_compatible
from kvxfer.device.staging import Staging
from kvxfer.errors import InvalidInputError, KvxferError, LayoutMismatchError
from kvxfer.nixl.decode import DecodeTransport
from kvxfer.nixl.wire import ReadParams, StreamParams
from kvxfer.plan.blocks import NULL_BLOCK, is_int, kernel_placement, table_entries
from kvxfer.stats import Recorder, Stats, Trace

__all__ = ["DecodeConnector"]

logger = logging.getLogger(__name__)


@dataclass
class _Load:
    keys: list[list[int]]  # per group, P's kernel positions (a stream's: those arrived so far)
    kernel_ids: list[list[int]]  # per group, D's kernel ids, aligned with keys
    logical_ids: list[int]  # D's logical ids, all groups: what a failure reports
    tables: list[list[int]] | None = None  # a stream's: D's table per group, to place its blocks


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
        model: what the caches hold, which P must describe alike
            (`kvxfer.device.layout.advertised`); None: nothing said.
    """

    def __init__(self, config: ConnectorConfig,
                 caches: Sequence[jax.Array] | Sequence[Sequence[jax.Array]],
                 model: Mapping[str, Any] | None = None):
        self.processes = for_caches(config, caches)
        self.config, self.layouts, self.stagings = config, self.processes.layouts, self.processes.stagings
        self.recorder = Recorder(config.stats)
        self.processes.precompile(caches, saves=False)  # before the agent: nothing to close if it fails
        self.transport = DecodeTransport(
            self.processes.transport_config, self.stagings,
            advertised(self.layouts, model, self.processes.unit_axes),
            layout_check=check_block_compatible, piece=self.processes.piece,
            reader=self.processes.reader, recorder=self.recorder)
        self._traces: dict[str, Trace] = {}  # loads under way (read, or held locally)
        self._loads: dict[str, _Load] = {}
        self._checked: list[tuple[jax.Array, ...]] = [() for _ in self.layouts]  # `_check_layouts`
        self._busy: list[dict[int, str]] = [{} for _ in self.layouts]  # per group: kernel id -> load
        self._load_errors: set[int] = set()
        self._refused: list[str] = []  # failed in start_load_kv, reported by get_finished
        self._held_locally: list[str] = []  # nothing to read, reported finished by get_finished

    @property
    def staging(self) -> Staging:
        """The first group's staging (the only one for a single-group model)."""
        return self.stagings[0]

    def start_load_kv(self, requests: Mapping[str, LoadRequest]) -> None:
        """Start reading each request: `{req_id: LoadRequest(params, table, have)}`.

        Each block P sends lands in the entry of D's table at its position. With
        `kvxfer.nixl.wire.StreamParams` as params, D reads the request while P still
        prefills it, each block as soon as P names it final, and writes it into
        the caches as it arrives (a D staging whole blocks; one in units refuses it). A
        request whose params or table are bad (or that is not a `LoadRequest`) is
        failed alone, reported by the next `get_finished`; a request id already
        loading raises `InvalidInputError` before anything starts.
        """
        if not isinstance(requests, Mapping):
            raise InvalidInputError(f"requests must be a dict, got {type(requests).__name__}")
        for req_id in requests:
            if not isinstance(req_id, str) or not req_id:
                raise InvalidInputError(f"request id must be a non-empty str, got {req_id!r}")
            if req_id in self._loads or req_id in self._refused or req_id in self._held_locally:
                raise InvalidInputError(f"request {req_id!r} is already loading")
        for req_id, request in requests.items():
            trace = Trace(req_id, "D", d=self.transport.config.name)
            try:
                if not isinstance(request, LoadRequest):
                    raise InvalidInputError(f"request {req_id!r}: expected a LoadRequest, got "
                                            f"{request!r:.80}")
                if StreamParams.given(request.params):
                    self._start_stream(req_id, request, trace)
                    continue
                p, load = self._prepare(req_id, request)
                trace.p_req_id, trace.p = p.req_id, p.peer
                self._check_free(req_id, load)
                if not any(load.keys):
                    self._held_locally.append(req_id)  # D has every block P sends
                    self._traces[req_id] = trace
                    continue
                self.transport.start_read(req_id, p, load.logical_ids, trace)
            except KvxferError as e:
                logger.warning("D refuses request %s: %s", req_id, e)
                self._refused.append(req_id)
                ids = _table_ids(getattr(request, "table", ()))
                self._load_errors.update(ids)
                self.recorder.count("d_recompute_blocks", len(ids))
                self.recorder.finish(trace, "refused")
                continue
            self._traces[req_id] = trace
            self._loads[req_id] = load
            for busy, ids in zip(self._busy, load.kernel_ids):
                busy.update(dict.fromkeys(ids, req_id))

    def _start_stream(self, req_id: str, request: LoadRequest, trace: Trace) -> None:
        """Subscribe to a streamed request: D's blocks past `have` are all reserved for it
        (P names which it sends only as it goes), and fail with it."""
        s = StreamParams.parse(request.params)
        tables, have = _tables(self.layouts, req_id, request)
        load = _reserved(self.layouts, tables, have)
        self._check_free(req_id, load)
        trace.p = s.peer
        self.transport.start_stream(req_id, s, load.logical_ids,
                                    [h * layout.kernel_ratio for h, layout in zip(have, self.layouts)],
                                    request.prompt, trace)
        self._traces[req_id] = trace
        self._loads[req_id] = load
        for busy, ids in zip(self._busy, load.kernel_ids):
            busy.update(dict.fromkeys(ids, req_id))
        load.kernel_ids = [[] for _ in tables]  # those of the blocks arrived, aligned with keys

    def _check_free(self, req_id: str, load: _Load) -> None:
        """Refuse a load into D blocks another load still in progress writes into."""
        for g, (busy, ids) in enumerate(zip(self._busy, load.kernel_ids)):
            taken = next((k for k in ids if k in busy), None)
            if taken is not None:
                raise InvalidInputError(
                    f"request {req_id!r} group {g}: D's kernel block {taken} is being loaded "
                    f"for request {busy[taken]!r}")

    def _pop_load(self, req_id: str) -> _Load | None:
        load = self._loads.pop(req_id, None)
        if load is not None:
            for busy, ids in zip(self._busy, load.kernel_ids):
                for k in ids:
                    busy.pop(k, None)
        return load

    def _prepare(self, req_id: str, request: LoadRequest) -> tuple[ReadParams, _Load]:
        """Check the params against D's table; place P's positions in D's kernel ids.

        Returns the params to read (without the blocks D already has) and the load.
        """
        p = ReadParams.parse(request.params, len(self.layouts))
        if request.prompt is not None and p.prompt != request.prompt:
            raise InvalidInputError(
                f"request {req_id!r}: its params are for "
                f"{'another prompt' if p.prompt else 'a prompt P was not given'}; D's prompt "
                f"differs from the one P computed")
        tables, have = _tables(self.layouts, req_id, request)
        load = _Load([], [], [])
        keep_keys, keep_slots = [], []
        logical: dict[int, None] = {}
        for g, (keys, slots, ours) in enumerate(zip(p.keys, p.slots, self.layouts)):
            kept = [(key, slot) for key, slot in zip(keys, slots)
                    if key // ours.kernel_ratio >= have[g]]
            kernel_ids, entries = _place(req_id, g, [k for k, _ in kept], tables[g], ours)
            logical.update(dict.fromkeys(block for _, block in entries))
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
        groups, single = per_group(caches, len(self.layouts))
        if self._loads:  # else nothing is written into them this step
            _check_layouts(self._checked, groups, self.layouts, self.config.kernel_ratio)
        done, failed = self.processes.agree_reads(*self.transport.poll(), self._loads,
                                              self.transport.free)
        # One process writes blocks as they arrive (while the ack travels, or P prefills the
        # rest of a stream); across hosts, once every process has all of them.
        early = not self.processes.agrees
        arrived = self.transport.arrived() if early else {}
        failed_ids, self._refused = self._refused, []
        local, self._held_locally = self._held_locally, []
        for req_id, logical in failed.items():
            self._load_errors.update(logical)
            self._pop_load(req_id)
            failed_ids.append(req_id)
            self._finish(req_id, None, "other_process", len(logical))
        bad: dict[str, str] = {}
        writes: dict[str, _Load] = {}
        for req_id, keys in arrived.items():
            if req_id in self._loads:
                try:
                    writes[req_id] = _arrived(self._loads[req_id], self.layouts, req_id, keys)
                except KvxferError as e:
                    bad[req_id] = str(e)
        loads = {req_id: self._pop_load(req_id) for req_id in done if req_id in self._loads}
        if not early:
            writes = dict(loads)
        start = time.monotonic()
        try:
            for g in range(len(self.layouts)):
                self._write_group(g, groups, writes, bad)
        finally:
            for req_id in loads:
                self.transport.free(req_id)
        self.processes.agree_bad(writes, bad)  # a block bad in one process is bad in every one
        if writes:
            end = time.monotonic()
            self.recorder.observe("d_step_scatter_s", end - start)
            for req_id in writes:
                if req_id in self._traces:
                    self._traces[req_id].extend("scatter", start, end)
        finished = local
        for req_id in local:
            self._finish(req_id, None, "ok")
        for req_id in [r for r in bad if r not in loads and r in self._loads]:
            logger.error("D request %s failed as its blocks arrived: %s", req_id, bad[req_id])
            self.transport.free(req_id)  # stops its read
            load = self._pop_load(req_id)
            self._load_errors.update(load.logical_ids)
            failed_ids.append(req_id)
            self._finish(req_id, load, "corruption", len(load.logical_ids))
        for req_id, load in loads.items():
            if req_id in bad:
                logger.error("D request %s failed after its read: %s", req_id, bad[req_id])
                self._load_errors.update(load.logical_ids)
                failed_ids.append(req_id)
                self._finish(req_id, load, "corruption", len(load.logical_ids))
            else:
                finished.append(req_id)
                self._finish(req_id, load, "ok", 0)
        if self._loads or loads or failed_ids or writes:  # else no slot was taken or freed since
            self.recorder.gauge("d_staging_slots_in_use",
                                sum(s.num_slots - s.num_free_slots for s in self.stagings))
        return (groups[0] if single else groups), finished, failed_ids

    def _finish(self, req_id: str, load: _Load | None, outcome: str, recompute: int = 0) -> None:
        """A load ended: its trace (whose `scatter` stages checked the fingerprints as the
        blocks landed), its bytes, and its outcome (the transport's reason, if it failed
        there) go to the recorder."""
        trace = self._traces.pop(req_id, None)
        if trace is None:
            return
        if load is not None:
            trace.blocks = sum(len(keys) for keys in load.keys)
            trace.bytes = sum(len(keys) * s.block_bytes * s.num_layers
                              for keys, s in zip(load.keys, self.stagings))
        if outcome != "ok" and trace.outcome not in (None, "cancelled"):
            outcome = trace.outcome  # why the transport failed it
        self.recorder.count("d_recompute_blocks", recompute)
        self.recorder.finish(trace, outcome)

    def stats(self, take: bool = False) -> Stats:
        """Counters, totals and gauges since start (`kvxfer.stats.Stats`; docs/observability.md lists
        them); with `take`, also the series observed since the last take."""
        return self.recorder.stats(take)

    def traces(self) -> list[Trace]:
        """The last finished loads' traces (a bounded ring), oldest first."""
        return self.recorder.traces()

    def _write_group(self, g: int, groups: list[list[jax.Array]], loads: Mapping[str, _Load],
                     bad: dict[str, str]) -> None:
        """Scatter group `g` of every read request from staging into `groups[g]`, then verify.

        One scatter straight out of the staging regions, which also fingerprints
        the blocks as they landed in the caches, checked per request against
        P's (`_processes`): a flipped bit anywhere from P's gather to here fails the
        request (its blocks are its own, and the engine recomputes them). A
        request's problem goes into `bad`. New arrays replace the donated ones everywhere."""
        staging = self.stagings[g]
        ids: list[int] = []
        slots: list[int] = []
        spans: Spans = []
        for req_id, load in loads.items():  # their D blocks are disjoint (`_check_free`)
            if req_id in bad or not load.keys[g]:
                continue
            try:
                slots += staging.slots(req_id, load.keys[g])
            except KvxferError as e:
                bad[req_id] = str(e)
                continue
            spans.append((req_id, len(ids), len(load.keys[g])))
            ids += load.kernel_ids[g]
        if not ids:
            return
        old = groups[g]
        groups[g] = self.processes.scatter(g, old, np.asarray(ids, np.int64),
                                       np.asarray(slots, np.int64), spans, bad)
        if self._checked[g] and all(map(operator.is_, self._checked[g], old)):
            self._checked[g] = tuple(groups[g])  # our scatter's output: the same layout
        _follow_donations([c for h, c in enumerate(groups) if h != g], old, groups[g])

    def expect(self, params: Any) -> None:
        """Keep P's lease alive for a request D accepted but has not started loading (waiting
        in D's queue), from now until `start_load_kv` takes it or `cancel` drops it; P's
        `kv_transfer_params`, checked (`InvalidInputError`)."""
        self.transport.expect(ReadParams.parse(params, len(self.layouts)))

    def cancel(self, params: Any) -> None:
        """D will not load this expected request (aborted, or computed locally): P may free
        its blocks now. Params not expected are ignored."""
        p = ReadParams.parse(params, len(self.layouts))
        self.transport.cancel(p.req_id, p.instance)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Logical block ids whose load failed since the last call (to recompute)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def pending(self) -> list[str]:
        return self.transport.pending()

    def close(self) -> None:
        self.transport.close()


def _check_layouts(checked: list[tuple[jax.Array, ...]], groups: list[list[jax.Array]],
                   layouts: Sequence[CacheLayout], kernel_ratio: int) -> None:
    """Caches of another layout raise before any state changes. Arrays already checked
    (`checked[g]`, or written by the connector) are not checked again: D's engine calls this
    every step, and deriving a layout costs a few microseconds per layer."""
    for g, (group_caches, layout) in enumerate(zip(groups, layouts)):
        if len(checked[g]) == len(group_caches) and all(map(operator.is_, checked[g],
                                                            group_caches)):
            continue
        got = CacheLayout.from_caches(group_caches, kernel_ratio)
        if got != layout:
            raise LayoutMismatchError(f"group {g} caches have layout {got}, the connector "
                                      f"was built for {layout}")
        checked[g] = tuple(group_caches)


def _follow_donations(others: list[list[jax.Array]], old: Sequence[jax.Array],
                      new: Sequence[jax.Array]) -> None:
    """Groups may share arrays (vLLM's hybrid allocator gives layer j of every group one
    tensor, their blocks disjoint): where another group, before or after this one, holds
    an array just donated by a scatter, it now holds the array that replaced it."""
    replaced = {id(a): b for a, b in zip(old, new) if a is not b}
    if replaced:
        for caches in others:
            caches[:] = [replaced.get(id(a), a) for a in caches]


def _reserved(layouts: Sequence[CacheLayout], tables: list[list[int]], have: list[int]) -> _Load:
    """A stream's load before any block arrived: every kernel id of D's tables past `have`
    (P names what it sends only as it goes), and their logical ids."""
    load = _Load([[] for _ in tables], [], [], tables=tables)
    for table, h, layout in zip(tables, have, layouts):
        entries = [(i, b) for i, b in enumerate(table) if i >= h and b != NULL_BLOCK]
        load.kernel_ids.append([k for _, k in kernel_placement(entries, layout.kernel_ratio)])
        load.logical_ids += [b for _, b in entries if b not in load.logical_ids]
    return load


def _arrived(load: _Load, layouts: Sequence[CacheLayout], req_id: str,
             keys: list[list[int]]) -> _Load:
    """What to write of `keys` (per group) of a load now in staging: a stream's placed in D's
    table now (and added to the load's)."""
    part = _Load([], [], load.logical_ids)
    if load.tables is None:  # placed when the read started
        for g, group_keys in enumerate(keys):
            at = dict(zip(load.keys[g], load.kernel_ids[g]))
            part.keys.append(list(group_keys))
            part.kernel_ids.append([at[k] for k in group_keys])
        return part
    for g, (group_keys, table, layout) in enumerate(zip(keys, load.tables, layouts)):
        ids, _ = _place(req_id, g, group_keys, table, layout)
        part.keys.append(list(group_keys))
        part.kernel_ids.append(ids)
        load.keys[g] += group_keys
        load.kernel_ids[g] += ids
    return part


def _place(req_id: str, g: int, keys: Sequence[int], table: Sequence[int],
           layout: CacheLayout) -> tuple[list[int], list[tuple[int, int]]]:
    """D's kernel ids of P's `keys` (kernel positions) of group `g`, placed at the same
    positions of D's `table`, and the table entries they fall in; `InvalidInputError`
    where D's table cannot hold one (too short, the null block, past D's blocks, an id twice)."""
    ratio = layout.kernel_ratio
    try:
        entries = table_entries(dict.fromkeys(k // ratio for k in keys), table)
    except InvalidInputError as e:
        raise InvalidInputError(f"request {req_id!r} group {g}: P sends a block D "
                                f"cannot place: {e}") from None
    at = dict(kernel_placement(entries, ratio))
    kernel_ids = [at[k] for k in keys]
    bad = [k for k in kernel_ids if k >= layout.num_blocks]
    if bad:
        raise InvalidInputError(f"request {req_id!r} group {g}: D block ids "
                                f"{sorted({k // ratio for k in bad})[:8]} are past D's "
                                f"{layout.num_blocks // ratio} blocks")
    if len(set(kernel_ids)) != len(kernel_ids):
        raise InvalidInputError(f"request {req_id!r} group {g}: D's table repeats a block "
                                f"id at the positions P sends")
    return kernel_ids, entries


def _tables(layouts: Sequence[CacheLayout], req_id: str, request: LoadRequest
        ) -> tuple[list[list[int]], list[int]]:
    """D's block table per group, and how many leading entries of each D holds, checked."""
    table, have = request.table, request.have
    tables = [table] if len(layouts) == 1 and _is_id_list(table) else table
    if (not isinstance(tables, (list, tuple)) or len(tables) != len(layouts)
            or not all(_is_id_list(t) for t in tables)):
        raise InvalidInputError(
            f"request {req_id!r}: D's block table must be {len(layouts)} list(s) of "
            f"non-negative int block ids, got {table!r:.120}")
    have = [0] * len(layouts) if have is None else have
    if (not isinstance(have, (list, tuple)) or len(have) != len(layouts)
            or not all(is_int(h) and h >= 0 for h in have)):
        raise InvalidInputError(f"request {req_id!r}: 'have' must be {len(layouts)} "
                                f"non-negative int(s), got {have!r:.80}")
    return [list(t) for t in tables], list(have)


def _is_id_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(is_int(b) and b >= 0 for b in value)
