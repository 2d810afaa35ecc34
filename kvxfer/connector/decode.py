"""D's worker side: reads from P over NIXL, verifies, and scatters into the caches.

`start_load_kv` parses each request's params once (`LoadRequest.parse_params`),
checks them against D's block table, skips the entries D already holds (a local
prefix hit), places every block P sends at the same position of D's table
(`kvxfer.connector.loads`) and posts the reads. `get_finished` advances them,
scatters what arrived from staging into the device caches in place (one scatter
per group), checks each request's blocks as they landed against P's
fingerprints, and returns the new caches with the finished and failed request
ids. Whatever goes wrong with one request (bad params, a table that does not
cover P's positions, a read error, a failed check) fails that request alone, in
its logical block ids (`get_block_ids_with_load_errors`), and frees every slot
and every D block it took.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from kvxfer.connector._processes import for_caches, per_group
from kvxfer.connector.config import ConnectorConfig
from kvxfer.connector.loads import Load, Loads, kernel_hashes, table_ids
from kvxfer.connector.scheduler import LoadRequest
from kvxfer.device.layout import CacheLayout, advertised, check_block_compatible
from kvxfer.device.staging import Staging
from kvxfer.errors import InvalidInputError, KvxferError, LayoutMismatchError
from kvxfer.nixl.decode import DecodeTransport
from kvxfer.nixl.wire import ReadParams, StreamParams
from kvxfer.stats import Recorder, Stats, Trace

__all__ = ["DecodeConnector"]

logger = logging.getLogger(__name__)


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
        self._loads = Loads(len(self.layouts))
        self._checked: list[tuple[jax.Array, ...]] = [() for _ in self.layouts]  # `_check_layouts`
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
        the caches as it arrives (a D in one process; one across hosts refuses it). A
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
                load = self._start(req_id, request, trace)
            except KvxferError as e:
                logger.warning("D refuses request %s: %s", req_id, e)
                self._refused.append(req_id)
                ids = table_ids(getattr(request, "table", ()))
                self._load_errors.update(ids)
                self.recorder.count("d_recompute_blocks", len(ids))
                self.recorder.finish(trace, "refused")
                continue
            self._traces[req_id] = trace
            if load is None:
                self._held_locally.append(req_id)  # D has every block P sends
            else:
                self._loads.add(req_id, load)

    def _start(self, req_id: str, request: object, trace: Trace) -> Load | None:
        """Check one request, place P's blocks in D's table (`Load`) and post its read (or
        subscribe to its stream); None: D holds every block P sends. `KvxferError` fails
        it alone."""
        if not isinstance(request, LoadRequest):
            raise InvalidInputError(f"request {req_id!r}: expected a LoadRequest, got "
                                    f"{request!r:.80}")
        params = LoadRequest.parse_params(request.params, len(self.layouts))
        if isinstance(params, StreamParams):
            load, have = Load.stream(self.layouts, req_id, request)
            self._loads.check(req_id, load)
            trace.p = params.peer
            self.transport.start_stream(req_id, params, load.logical_ids, have, request.prompt,
                                        trace, kernel_hashes(self.layouts, req_id, request))
            return load
        params, load = Load.read(self.layouts, req_id, request, params)
        trace.p_req_id, trace.p = params.req_id, params.peer
        self._loads.check(req_id, load)
        if not any(load.keys):
            return None
        self.transport.start_read(req_id, params, load.logical_ids, trace, request.prompt,
                                  kernel_hashes(self.layouts, req_id, request))
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
            self._loads.pop(req_id)
            failed_ids.append(req_id)
            self._finish(req_id, None, "other_process", len(logical))
        bad: dict[str, str] = {}
        writes: dict[str, Load] = {}
        for req_id, keys in arrived.items():
            if req_id in self._loads:
                try:
                    writes[req_id] = self._loads[req_id].arrived(self.layouts, req_id, keys)
                except KvxferError as e:
                    bad[req_id] = str(e)
        loads = {req_id: self._loads.pop(req_id) for req_id in done if req_id in self._loads}
        for req_id, load in loads.items():  # a stream's chunks named its blocks as they went
            why = load.uncovered(self.layouts, req_id) if load.tables is not None else None
            if why is not None:
                bad[req_id] = why
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
            load = self._loads.pop(req_id)
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

    def _finish(self, req_id: str, load: Load | None, outcome: str, recompute: int = 0) -> None:
        """A load ended: its trace (whose `scatter` phases checked the fingerprints as the
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

    def _write_group(self, g: int, groups: list[list[jax.Array]], loads: Mapping[str, Load],
                     bad: dict[str, str]) -> None:
        """Scatter group `g` of every read request from staging into `groups[g]`, then verify.

        One scatter straight out of the staging regions, which also fingerprints
        the blocks as they landed in the caches, checked per request against
        P's (`_processes`): a flipped bit anywhere from P's gather to here fails the
        request (its blocks are its own, and the engine recomputes them). A
        request's problem goes into `bad`. New arrays replace the donated ones everywhere."""
        staging = self.stagings[g]
        rows_of = {}
        for req_id, load in loads.items():  # their D blocks are disjoint (`Loads.check`)
            if req_id in bad or not load.keys[g]:
                continue
            try:
                rows_of[req_id] = (load.kernel_ids[g], staging.slots(req_id, load.keys[g]))
            except KvxferError as e:
                bad[req_id] = str(e)
        old = groups[g]
        self.processes.scatter(g, groups, rows_of, bad)
        if self._checked[g] and all(map(operator.is_, self._checked[g], old)):
            self._checked[g] = tuple(groups[g])  # our scatter's output: the same layout

    def expect(self, params: Any) -> None:
        """Keep P's lease alive for a request D accepted but has not started loading (waiting
        in D's queue), from now until `start_load_kv` takes it or `cancel` drops it; P's
        `kv_transfer_params`, checked (`InvalidInputError`)."""
        self.transport.expect(self._finished_params(params))

    def cancel(self, params: Any) -> None:
        """D will not load this expected request (aborted, or computed locally): P may free
        its blocks now. Params not expected are ignored."""
        p = self._finished_params(params)
        self.transport.cancel(p.req_id, p.instance)

    def _finished_params(self, params: Any) -> ReadParams:
        p = LoadRequest.parse_params(params, len(self.layouts))
        if not isinstance(p, ReadParams):  # a stream's P holds it for D while it prefills
            raise InvalidInputError(f"expect and cancel take P's params of a prefilled "
                                    f"request, got a stream's: {params!r:.80}")
        return p

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
