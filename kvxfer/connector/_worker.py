"""What P's and D's worker sides share: caches per group, layouts, staging, pieces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from kvxfer.connector.config import ConnectorConfig
from kvxfer.errors import InvalidInputError, LayoutMismatchError
from kvxfer.layout import CacheLayout
from kvxfer.multihost import spans_processes
from kvxfer.nixl.agent import TransportConfig
from kvxfer.pieces import Piece, piece_staging
from kvxfer.staging import Staging

_BLOCK_FIELDS = ("block_shape", "dtype", "num_layers", "kernel_ratio")


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
