"""One process per instance, or several: how a worker side stages, copies and agrees.

A connector's worker side picks one at construction (`for_caches`), from its
caches, and calls it wherever the two cases differ:

- `OneProcess`: this process addresses every shard of the caches. Each
  group's staging holds the piece of all units of each block, unit-major
  (`kvxfer.device.pieces`), as a process of an instance across hosts holds
  its piece: so any instance pairs with any other. What this process saw is
  the instance's view.
- `ManyProcesses`: the caches span several JAX processes (hosts). Each stages
  only its piece of every block (`kvxfer.device.pieces`) with its own agent
  (`<name>-<process>`, found through etcd), and the processes of an instance
  agree once per `get_finished` (`kvxfer.nixl.agreement.agree`): P releases a
  request's slots once every process freed its piece; D finishes a request
  once every process has it, and fails it everywhere once any failed it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import jax
import numpy as np

from kvxfer.connector.config import ConnectorConfig
from kvxfer.device.gather import host_threads
from kvxfer.device.layout import CacheLayout
from kvxfer.device.pieces import (
    Piece,
    gather_piece_into,
    piece_prints,
    piece_staging,
    precompile_piece,
    process_pieces,
    scatter_piece,
)
from kvxfer.device.seal import opened
from kvxfer.device.staging import Staging
from kvxfer.errors import InvalidInputError, LayoutMismatchError
from kvxfer.nixl.agent import TransportConfig
from kvxfer.nixl.agreement import agree, shared_instance, spans_processes
from kvxfer.nixl.wire import Source

__all__ = ["ManyProcesses", "OneProcess", "for_caches", "per_group"]

Caches = Sequence[jax.Array] | Sequence[Sequence[jax.Array]]


def per_group(caches: object, count: int | None = None, of: str = "this connector"
              ) -> tuple[list[list[jax.Array]], bool]:
    """`caches` as one list of per-layer arrays per group, and whether it came as one group.

    With `count`, raises `LayoutMismatchError` unless there are `count` groups (`of` says
    whose count it is).
    """
    if isinstance(caches, (jax.Array, np.ndarray)) or not isinstance(caches, Sequence) or not caches:
        raise InvalidInputError(
            f"caches must be a list of per-layer jax.Arrays (one group) or a list of such lists "
            f"(one per KV cache group), got {type(caches).__name__}")
    if isinstance(caches[0], jax.Array):
        groups, single = [list(caches)], True
    else:
        groups, single = [list(c) if isinstance(c, Sequence) else c for c in caches], False
    if count is not None and len(groups) != count:
        raise LayoutMismatchError(f"caches hold {len(groups)} groups, {of} {count}")
    return groups, single


def for_caches(config: object, caches: Caches) -> OneProcess:
    """The worker side's checked config, its caches' layouts and staging, as one strategy."""
    if not isinstance(config, ConnectorConfig):
        raise InvalidInputError(f"config must be a ConnectorConfig, got {config!r:.80}")
    host_threads()  # a bad KVXFER_HOST_THREADS is refused at start-up, not in a save
    groups, _ = per_group(caches)
    layouts = [CacheLayout.from_caches(c, config.kernel_ratio) for c in groups]
    if spans_processes(groups[0]):
        return ManyProcesses(config, layouts, groups)
    return OneProcess(config, layouts, groups)


class OneProcess:
    """An instance whose caches this process addresses whole: it stages the piece of all
    units of each block, cut along the axis the caches' layout names (`split_axis`), as an
    instance across hosts stages its pieces, so that the two pair."""

    agrees = False
    """Whether the processes of the instance agree on each request before acting on it."""

    def __init__(self, config: ConnectorConfig, layouts: list[CacheLayout],
                 groups: list[list[jax.Array]]):
        pieces = [Piece.local(c) for c in groups]  # per group: the same units, maybe another axis
        if any((p.units, p.lo, p.hi) != (pieces[0].units, pieces[0].lo, pieces[0].hi)
               for p in pieces):
            raise LayoutMismatchError(f"KV cache groups cut blocks into different pieces on "
                                      f"this process: {pieces}")
        self.config, self.layouts, self.pieces = config, layouts, pieces
        self.stagings = [piece_staging(layout, piece, config.staging_blocks, caches)
                         for layout, piece, caches in zip(layouts, pieces, groups)]
        first = pieces[0]
        self.piece = (first.lo, first.hi, first.units)
        """`(lo, hi, units)` this process stages of each block."""
        self.sources = [Source(self.agent_name(process), p.lo, p.hi)
                        for process, p in process_pieces(groups[0]).items()]
        """Every process of the instance and the units it stages, named in P's params."""

    def agent_name(self, process: int) -> str:
        """The agent that stages process `process`'s piece."""
        return self.config.transport.name

    @property
    def transport_config(self) -> TransportConfig:
        return self.config.transport

    @property
    def reader(self) -> tuple[int, int]:
        """`(rank, count)` of this D process among its instance's."""
        return (0, 1)

    @property
    def units(self) -> int:
        return self.pieces[0].units

    @property
    def unit_axes(self) -> list[int]:
        """Per group, the block axis its pieces cut."""
        return [p.axis for p in self.pieces]

    def instance(self, instance: str | None) -> str | None:
        """P's instance id: the scheduler side's, or None to draw one."""
        return instance

    def secret_key(self) -> str | None:
        """The key P's scheduler derives request secrets from; None: it draws its own."""
        return None

    def gather(self, g: int, caches: Sequence[jax.Array], ids: np.ndarray,
               slots: np.ndarray, into: Staging | None = None) -> None:
        """Copy this process's units of blocks `ids` of group `g` into `slots` of group `g`'s
        staging (or of `into`, laid out alike), with their sums."""
        gather_piece_into(caches, ids, self.stagings[g] if into is None else into, slots,
                          self.pieces[g])

    def scatter(self, g: int, groups: list[list[jax.Array]],
                rows_of: Mapping[str, tuple[Sequence[int], Sequence[int]]],
                bad: dict[str, str]) -> None:
        """Scatter this process's units of group `g`'s blocks from staging into
        `groups[g]`, in one scatter: `rows_of[req_id]` is `(kernel ids, staging rows)`. A
        request whose blocks as they landed do not sum as P's did goes into `bad` (request
        id -> reason). The new arrays replace the donated ones in every group (vLLM's hybrid
        allocator gives groups shared arrays)."""
        ids: list[int] = []
        rows: list[int] = []
        spans: list[tuple[str, int, int]] = []
        for req_id, (kernel_ids, slots) in rows_of.items():
            if len(kernel_ids) != len(slots):
                raise InvalidInputError(f"scatter of {req_id!r}, group {g}: {len(kernel_ids)} "
                                        f"kernel ids for {len(slots)} staging rows")
            spans.append((req_id, len(ids), len(kernel_ids)))
            ids += kernel_ids
            rows += slots
        if not ids:
            return
        piece = self.pieces[g]  # what P sealed, opened
        staging, at, unknown = opened(self.stagings[g], g, rows, piece.lo, piece.units)
        for req_id, start, count in spans:
            if any(start <= i < start + count for i in unknown):
                bad[req_id] = f"group {g}: a sealed block with no secret kept to open it"
        old = groups[g]
        groups[g], got = scatter_piece(old, staging, np.asarray(ids, np.int64), at,
                                       self.pieces[g], sums=self.config.verify_fingerprints)
        if got is not None:
            expected = piece_prints(staging, at)  # P's, read with the blocks
            for req_id, start, count in spans:
                if not np.array_equal(got[:, start : start + count],
                                      expected[:, start : start + count]):
                    bad[req_id] = f"group {g}: its blocks' word sums differ from P's"
        replaced = {id(a): b for a, b in zip(old, groups[g]) if a is not b}
        for h, caches in enumerate(groups):
            if h != g and replaced:
                caches[:] = [replaced.get(id(a), a) for a in caches]

    def precompile(self, caches: Caches, saves: bool) -> int:
        """Compile every program a save (`saves`, P) or a load (D) of any size runs (with
        `config.precompile`); returns how many. A save may gather a block more than once
        (requests sharing a prefix each have their slots), so up to every slot; a load's
        blocks are distinct."""
        if not self.config.precompile:
            return 0
        groups, _ = per_group(caches)
        return sum(precompile_piece(c, staging, piece,
                                    staging.num_slots if saves
                                    else min(staging.num_slots, layout.num_blocks),
                                    saves=saves, loads=not saves,
                                    sums=self.config.verify_fingerprints)
                   for c, staging, layout, piece in zip(groups, self.stagings, self.layouts,
                                                        self.pieces))

    def released(self, freed: list[str], held: list[str]) -> list[str]:
        """P: the requests whose slots the scheduler side may reuse, of those freed here."""
        return freed

    def agree_reads(self, done: list[str], failed: dict[str, list[int]],
                    loads: Mapping[str, Any], free: Callable[[str], None]
                    ) -> tuple[list[str], dict[str, list[int]]]:
        """D: the reads done and failed for the whole instance."""
        return done, failed

    def agree_bad(self, loads: Mapping[str, Any], bad: dict[str, str]) -> None:
        """D: a request bad on any process is bad on this one."""


class ManyProcesses(OneProcess):
    """An instance whose caches span several processes: each stages its piece of every block."""

    agrees = True

    def __init__(self, config: ConnectorConfig, layouts: list[CacheLayout],
                 groups: list[list[jax.Array]]):
        if not config.transport.uses_etcd:
            raise InvalidInputError(
                f"caches span {jax.process_count()} processes: their agents find each other "
                f"through etcd; give the TransportConfig etcd_endpoints")
        super().__init__(config, layouts, groups)
        self._freed_here: set[str] = set()  # P: freed here, not yet everywhere
        self._read_here: set[str] = set()  # D: read here, not yet agreed

    def agent_name(self, process: int) -> str:
        return _agent_name(self.config, process)

    @property
    def transport_config(self) -> TransportConfig:
        """One agent per process, named `name-<process>`."""
        return replace(self.config.transport, name=_agent_name(self.config, jax.process_index()))

    @property
    def reader(self) -> tuple[int, int]:
        return (jax.process_index(), jax.process_count())

    def instance(self, instance: str | None) -> str | None:
        return instance if instance is not None else shared_instance()  # one for every process

    def secret_key(self) -> str | None:
        return shared_instance(32)  # every process's scheduler derives the same secrets

    def released(self, freed: list[str], held: list[str]) -> list[str]:
        """Once every process has freed a request's piece, so that every process's scheduler
        (SPMD) reuses the same slots at the same step."""
        self._freed_here.update(freed)
        if not held:
            return []
        everywhere = agree([r in self._freed_here for r in held]).all(axis=0)
        released = [r for r, ok in zip(held, everywhere) if ok]
        self._freed_here.difference_update(released)
        return released

    def agree_reads(self, done: list[str], failed: dict[str, list[int]],
                    loads: Mapping[str, Any], free: Callable[[str], None]
                    ) -> tuple[list[str], dict[str, list[int]]]:
        """A read is done once it is done on every process of this D, and failed everywhere
        once it failed on any (every process loads the same requests, SPMD)."""
        self._read_here.update(done)
        pending = sorted(loads)
        if not pending:
            return [], failed
        here = [2 if r in failed else 1 if r in self._read_here else 0 for r in pending]
        states = agree(here)
        agreed_done, agreed_failed = [], dict(failed)
        for req_id, column in zip(pending, states.T):
            if (column == 2).any():
                if req_id not in agreed_failed:
                    agreed_failed[req_id] = list(loads[req_id].logical_ids)
                    free(req_id)  # read (or still reading) here, failed elsewhere
                self._read_here.discard(req_id)
            elif (column == 1).all():
                agreed_done.append(req_id)
                self._read_here.discard(req_id)
        return agreed_done, agreed_failed

    def agree_bad(self, loads: Mapping[str, Any], bad: dict[str, str]) -> None:
        if not loads:
            return
        everywhere = agree([r in bad for r in loads]).any(axis=0)
        for req_id, is_bad in zip(list(loads), everywhere):
            if is_bad and req_id not in bad:
                bad[req_id] = "its blocks failed verification on another process"


def _agent_name(config: ConnectorConfig, process: int) -> str:
    """The agent of one process of an instance across hosts: `<name>-<process index>`."""
    return f"{config.transport.name}-{process}"
