"""P and D put together, in the engine's terms (vLLM's `KVConnectorBase_V1`).

P (`PrefillConnector`): the scheduler hands each step to
`build_connector_meta`, which asks the `SaveTracker` which blocks to copy;
after the forward pass `wait_for_save` gathers them out of the device caches
(one dispatch for all layers and requests, with fingerprints) into the
registered host staging. When a request's prefill completes its blocks are
held under a lease and `request_finished` returns the `kv_transfer_params`
the engine forwards to D. `get_finished` reports the requests D has read (or
whose lease expired), whose blocks the engine may now free.

D (`DecodeConnector`): `start_load_kv` posts the NIXL reads; `get_finished`
advances them, checks each received request against P's fingerprints,
scatters it into the device caches (one dispatch) and returns the new caches
with the finished and failed request ids; `get_block_ids_with_load_errors`
lists the logical block ids to recompute.

Heterogeneous TP: each side stages whole (global) blocks, gathered from all
of its process's shards, so P and D may shard their caches differently (TP 4
on P, TP 2 or 8 on D, MLA replicated): D checks only what fixes a block's
bytes (block shape, dtype, layers, kernel ratio) and `scatter_blocks`
re-shards to D's mesh. An MLA block replicated over `model` is staged, and
read, once. This holds for one process per instance (one host); a P spread
over several hosts would stage per-host shards, which is not handled here.

One KV cache group: the caches passed in are the layers of one group (the
tracker may know several; `group` picks the one these caches hold).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from kvxfer.blocks import cdiv, to_kernel_ids, to_logical_ids
from kvxfer.errors import CorruptionError, InvalidInputError, LayoutMismatchError
from kvxfer.gather import bucket_size, check_fingerprints, gather_blocks, scatter_blocks
from kvxfer.layout import CacheLayout
from kvxfer.scheduler import GroupSpec, SaveTracker, ScheduledRequest
from kvxfer.staging import Staging
from kvxfer.transport import DecodeTransport, PrefillTransport, TransportConfig

logger = logging.getLogger(__name__)

_BLOCK_FIELDS = ("block_shape", "dtype", "num_layers", "kernel_ratio")


@dataclass(frozen=True)
class ConnectorConfig:
    """What a connector reads, in one place.

    - `transport`: the NIXL agent's settings (name, ports, deadlines, lease).
    - `staging_blocks`: kernel blocks per layer the host staging holds.
    - `kernel_ratio`: kernel blocks per logical (engine) block.
    - `group`: which of the tracker's KV cache groups the caches hold.
    - `verify_fingerprints`: D checks every received block against P's fingerprints.
    """

    transport: TransportConfig
    staging_blocks: int = 4096
    kernel_ratio: int = 1
    group: int = 0
    verify_fingerprints: bool = True


def _advertised(layout: CacheLayout) -> dict[str, Any]:
    """The layout fields a peer checks at handshake (`check_block_compatible`).

    P's full layout, which says how its fingerprints cut a block into shards,
    travels with each request's params instead.
    """
    return {
        "block_shape": list(layout.block_shape),
        "dtype": layout.dtype,
        "num_layers": layout.num_layers,
        "kernel_ratio": layout.kernel_ratio,
    }


def check_block_compatible(local: Mapping[str, Any], remote: Mapping[str, Any]) -> None:
    """Peer check for connectors: blocks must have the same bytes; sharding may differ."""
    diffs = [
        f"{key}: peer={remote.get(key)!r} local={local.get(key)!r}"
        for key in _BLOCK_FIELDS
        if local.get(key) != remote.get(key)
    ]
    if diffs:
        raise LayoutMismatchError("peer cache layout differs: " + "; ".join(diffs))


def _staging_for(layout: CacheLayout, config: ConnectorConfig) -> Staging:
    return Staging(layout.num_layers, config.staging_blocks, layout.block_shape, layout.np_dtype)


@dataclass
class SaveMeta:
    """One step's saves: kernel ids per request, and which requests restart or complete."""

    kernel_ids: dict[str, list[int]] = field(default_factory=dict)
    restarted: set[str] = field(default_factory=set)
    completed: set[str] = field(default_factory=set)


class PrefillConnector:
    """P side: save plans, gathers into registered staging, leases for D.

    Arguments:
        config: `ConnectorConfig`.
        groups: the engine's KV cache groups (for the save plans).
        caches: the current per-layer caches of `groups[config.group]`; only
            their layout is kept (the model donates them every step).
    """

    def __init__(self, config: ConnectorConfig, groups: Sequence[GroupSpec],
                 caches: Sequence[jax.Array]):
        if not 0 <= config.group < len(groups):
            raise InvalidInputError(f"group {config.group} not in the {len(groups)} groups")
        self.config = config
        self.tracker = SaveTracker(groups)
        self.layout = CacheLayout.from_caches(caches, config.kernel_ratio)
        self.staging = _staging_for(self.layout, config)
        self.transport = PrefillTransport(config.transport, self.staging, _advertised(self.layout))
        self._fingerprints: dict[str, dict[int, np.ndarray]] = {}
        self._params: dict[str, dict[str, Any]] = {}

    # -- scheduler side

    def add_request(self, req_id: str, num_prompt_tokens: int) -> None:
        """A request whose prompt KV must reach D (vLLM: `do_remote_decode`)."""
        self.tracker.add(req_id, num_prompt_tokens)

    def build_connector_meta(self, scheduled: Iterable[ScheduledRequest]) -> SaveMeta:
        """This step's saves, in kernel block ids of the cached group."""
        scheduled = list(scheduled)
        meta = SaveMeta()
        tracked = {s.req_id: s for s in scheduled if s.req_id in self.tracker}
        for req_id, groups in self.tracker.plan(scheduled).items():
            meta.kernel_ids[req_id] = to_kernel_ids(groups[self.config.group],
                                                    self.config.kernel_ratio)
            if tracked[req_id].full_table:
                meta.restarted.add(req_id)
            if req_id not in self.tracker:
                meta.completed.add(req_id)
        return meta

    # -- worker side

    def wait_for_save(self, caches: Sequence[jax.Array], meta: SaveMeta) -> None:
        """Copy this step's planned blocks from the caches into staging.

        One gather for every request of the step; a block copied again by a
        later chunk replaces its earlier copy. Completed requests are then held
        for D under a lease.
        """
        for req_id in meta.restarted:
            if req_id in self.staging:  # resumed after preemption: start over
                self.staging.free(req_id)
            self._fingerprints.pop(req_id, None)
        ids = [k for req_id in meta.kernel_ids for k in meta.kernel_ids[req_id]]
        if ids:
            gathered = gather_blocks(caches, np.asarray(ids, np.int64), fingerprints=True)
            rows = [np.asarray(b) for b in gathered.blocks]
            prints = np.asarray(gathered.fingerprints)
            start = 0
            for req_id, kernel_ids in meta.kernel_ids.items():
                stop = start + len(kernel_ids)
                if kernel_ids:
                    self.staging.stage(req_id, kernel_ids, [r[start:stop] for r in rows])
                    per_block = self._fingerprints.setdefault(req_id, {})
                    for i, k in enumerate(kernel_ids):
                        per_block[k] = prints[:, start + i]
                start = stop
        for req_id in meta.completed:
            self._hold(req_id)

    def _hold(self, req_id: str) -> None:
        if req_id not in self.staging:
            logger.warning("P request %s completed with nothing staged", req_id)
            return
        params = self.transport.hold(req_id)
        prints = self._fingerprints.pop(req_id)
        params["fingerprints"] = np.stack(
            [prints[k] for k in params["kernel_ids"]], axis=1).tolist()
        params["layout"] = self.layout.to_dict()
        self._params[req_id] = params

    def request_finished(self, req_id: str) -> dict[str, Any] | None:
        """The `kv_transfer_params` D needs, once the request's prefill is saved."""
        self.tracker.finish(req_id)
        return self._params.pop(req_id, None)

    def abort(self, req_id: str) -> None:
        """Drop an aborted request's plan state and staged blocks."""
        self.tracker.abort(req_id)
        self._params.pop(req_id, None)
        self._fingerprints.pop(req_id, None)
        if req_id in self.staging and req_id not in self.transport.held():
            self.staging.free(req_id)

    def get_finished(self) -> list[str]:
        """Requests D has read, or whose lease expired: their blocks may be freed."""
        return self.transport.poll()

    def close(self) -> None:
        self.transport.close()


@dataclass
class _Load:
    params: dict[str, Any]
    kernel_ids: list[int]


class DecodeConnector:
    """D side: reads from P over NIXL, verifies, and scatters into the caches.

    Arguments:
        config: `ConnectorConfig`.
        caches: the current per-layer caches; only their layout is kept.
    """

    def __init__(self, config: ConnectorConfig, caches: Sequence[jax.Array]):
        self.config = config
        self.layout = CacheLayout.from_caches(caches, config.kernel_ratio)
        self.staging = _staging_for(self.layout, config)
        self.transport = DecodeTransport(
            config.transport, self.staging, _advertised(self.layout),
            kernel_ratio=config.kernel_ratio, layout_check=check_block_compatible,
        )
        self._loads: dict[str, _Load] = {}
        self._load_errors: set[int] = set()

    def start_load_kv(self, requests: Mapping[str, tuple[Mapping[str, Any], Sequence[int]]]) -> None:
        """Start reading each request: `{req_id: (kv_transfer_params, D's logical block ids)}`.

        D's ids are its table for the prompt, in token order; extra trailing
        ids (allocated for decode) are ignored.
        """
        for req_id, (params, logical_ids) in requests.items():
            n = len(params["kernel_ids"])
            kernel_ids = to_kernel_ids(logical_ids[: cdiv(n, self.config.kernel_ratio)],
                                       self.config.kernel_ratio)[:n]
            if len(kernel_ids) != n:
                raise InvalidInputError(
                    f"request {req_id!r}: P sends {n} kernel blocks, D gave "
                    f"{len(logical_ids)} logical blocks ({len(kernel_ids)} kernel blocks)"
                )
            self._loads[req_id] = _Load(dict(params), kernel_ids)
            self.transport.start_read(req_id, params, kernel_ids)

    def get_finished(self, caches: Sequence[jax.Array]) -> tuple[list[jax.Array], list[str], list[str]]:
        """Advance reads; scatter the completed ones into the caches.

        Returns `(caches, finished, failed)`: the new caches (the input ones
        are donated when anything was scattered), the requests whose KV is now
        in them, and the requests that failed (their logical ids are in
        `get_block_ids_with_load_errors`).
        """
        done, failed = self.transport.poll()
        failed_ids = list(failed)
        for req_id, logical in failed.items():
            self._load_errors.update(logical)
            self._loads.pop(req_id, None)
        # Copy each read request out of staging once, straight into bucket-sized
        # rows that scatter_blocks takes as they are.
        loads = [(req_id, self._loads.pop(req_id)) for req_id in done]
        total = sum(len(load.kernel_ids) for _, load in loads)
        rows = [np.empty((bucket_size(total), *self.layout.block_shape), self.layout.np_dtype)
                for _ in range(self.layout.num_layers)]
        finished, ids = [], []
        for req_id, load in loads:
            slots = self.staging.slots(req_id, load.kernel_ids)
            start, stop = len(ids), len(ids) + len(slots)
            for region, out in zip(self.staging.regions, rows):
                np.take(region, slots, axis=0, out=out[start:stop])
            self.staging.free(req_id)
            try:
                if self.config.verify_fingerprints:
                    check_fingerprints(CacheLayout.from_dict(load.params["layout"]),
                                       [r[start:stop] for r in rows], len(slots),
                                       np.asarray(load.params["fingerprints"], np.uint32))
            except CorruptionError as e:
                logger.error("D request %s failed its fingerprint check: %s", req_id, e)
                self._load_errors.update(to_logical_ids(load.kernel_ids, self.config.kernel_ratio))
                failed_ids.append(req_id)
                continue  # its rows are overwritten by the next request's, or left unused
            finished.append(req_id)
            ids.extend(load.kernel_ids)
        caches = list(caches)
        if ids:
            caches = scatter_blocks(caches, rows, np.asarray(ids, np.int64))
        return caches, finished, failed_ids

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Logical block ids whose load failed since the last call (to recompute)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def pending(self) -> list[str]:
        return self.transport.pending()

    def close(self) -> None:
        self.transport.close()
