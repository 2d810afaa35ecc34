"""What P's and D's worker sides share: caches per group, layouts, staging, pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import jax
import numpy as np

from kvxfer.connector.config import ConnectorConfig
from kvxfer.errors import InvalidInputError, LayoutMismatchError
from kvxfer.layout import CacheLayout
from kvxfer.multihost import spans_processes
from kvxfer.nixl.agent import TransportConfig
from kvxfer.pieces import Piece, piece_staging
from kvxfer.staging import Staging


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
