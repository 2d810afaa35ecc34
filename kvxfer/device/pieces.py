"""Staging: a process's piece of every block, gathered into it and scattered out of it.

Every instance stages pieces. One in a single process stages the piece of
every unit of each block; one on several hosts is several JAX processes
sharing one mesh, each addressing only its own shards, so each stages,
registers and moves only its piece, and nothing crosses between the hosts
of one instance:

    piece = Piece.local(caches)                     # this process's units of each block
    staging = piece_staging(layout, piece, slots)   # registered with this process's agent
    gather_piece_into(caches, ids, staging, slots, piece)              # P
    caches, prints = scatter_piece(caches, staging, ids, slots, piece)  # D

A block is cut into `units` along its unit axis (`split_axis`: the last inner
axis the caches' spec names); a process holds units `[lo, hi)`. Slots are
unit-major, so any range of units of a block is one run of bytes on both
sides. Each unit's words are summed with the fingerprint's weights
(`kvxfer.device.fingerprint`), so P and D may cut blocks differently and
still compare.

Both backends of `kvxfer.device.gather` are built, chosen as it chooses them
(`KVXFER_BACKEND`): the numpy backend copies and sums with numpy on the
buffers of XLA:CPU shards, whatever their sharding; the XLA backend (TPU,
GPU, or XLA:CPU selected) runs jitted programs on a mesh of this process's
own devices (`kvxfer.device._xla_pieces`) where those split blocks along the
unit axis alone, and otherwise (data parallel or DCP caches, in one process)
the whole-block programs of `kvxfer.device._xla` with the copy into unit-major
slots and the units' sums on the host.
"""


from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from kvxfer.device import _xla, _xla_pieces
from kvxfer.device._numpy import (
    BufferHashes,
    buffer_view,
    copy_then_hash,
    host_threads,
    own_buffers,
    run_per_shard,
)
from kvxfer.device._rows import RowCopies
from kvxfer.device.fingerprint import SUMS, fmix32, piece_weights, reduce_sums, sums_words, word_sums
from kvxfer.device.gather import (
    backend_for,
    check_block_ids,
    check_flag,
    check_precompile_args,
    staging_regions,
)
from kvxfer.device.layout import CacheLayout
from kvxfer.device.staging import Staging
from kvxfer.errors import InvalidInputError, LayoutMismatchError
from kvxfer.plan.blocks import coalesce, is_int

__all__ = ["Piece", "gather_piece_into", "piece_shape", "piece_staging", "precompile_piece",
           "piece_prints", "process_pieces", "scatter_piece", "split_axis"]


@dataclass(frozen=True)
class Piece:
    """Units `[lo, hi)` of a block's unit axis `axis` (an index into `block_shape`)."""

    axis: int
    units: int
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not (all(is_int(v) for v in (self.axis, self.units, self.lo, self.hi))
                and self.axis >= 0 and 0 <= self.lo < self.hi <= self.units):
            raise InvalidInputError(f"a piece needs 0 <= lo < hi <= units and an axis >= 0, "
                                    f"got {self!r}")

    @property
    def count(self) -> int:
        return self.hi - self.lo

    def overlap(self, other: Piece) -> tuple[int, int] | None:
        """The units both pieces hold, `(lo, hi)`, or None."""
        lo, hi = max(self.lo, other.lo), min(self.hi, other.hi)
        return (lo, hi) if lo < hi else None

    @classmethod
    def local(cls, caches: Sequence[jax.Array]) -> Piece:
        """This process's piece of the caches' blocks."""
        return process_pieces(caches)[jax.process_index()]


def split_axis(layout: CacheLayout) -> int:
    """The block axis (index into `block_shape`) a piece cuts: the last inner axis the
    caches' spec names, else 0.

    From the names alone, not the sizes of the mesh axes they name, so instances that
    shard alike-named caches differently (TP 1 against TP 8, one host or several) cut
    alike and pair: tpu-inference names the heads at any TP (`P('data', None, 'model')`)
    and the tokens too where DCP splits them (`P(BATCH, KV_CONTEXT, KV_HEAD)`: the heads
    are last). Caches that name no inner axis (replicated, `P()`) cut along axis 0.
    """
    named = [a for a, entry in enumerate(layout.spec[1:]) if entry]
    return named[-1] if named else 0


def process_pieces(caches: Sequence[jax.Array]) -> dict[int, Piece]:
    """Every process's piece of the caches' blocks, by `process_index`.

    From the sharding alone, so every process (and the scheduler side on any of them)
    computes the same map. Raises `LayoutMismatchError` where a process's shards do not
    make one contiguous range of units, or miss part of the blocks of its units (the
    caches split the blocks across processes along another axis).
    """
    layout = CacheLayout.from_caches(caches)
    axis = split_axis(layout)
    units = layout.block_shape[axis]
    rest = layout.num_blocks * math.prod(layout.block_shape) // units  # one unit of every block
    boxes: dict[int, dict[tuple[int, int], set[tuple[tuple[int, int], ...]]]] = {}
    for device, index in caches[0].sharding.devices_indices_map(layout.shape).items():
        box = tuple(s.indices(n)[:2] for s, n in zip(index, layout.shape))
        span = box[1 + axis]
        boxes.setdefault(device.process_index, {}).setdefault(span, set()).add(
            box[: 1 + axis] + box[2 + axis :])
    pieces = {}
    for process, held in sorted(boxes.items()):
        if any(sum(math.prod(hi - lo for lo, hi in box) for box in others) != rest
               for others in held.values()):
            raise LayoutMismatchError(
                f"process {process} holds part of the blocks of its units (spec "
                f"{layout.spec}): an instance across hosts splits blocks across processes "
                f"along block axis {axis} only (the last one its spec names)")
        spans = sorted(held)
        if any(a[1] != b[0] and a != b for a, b in zip(spans, spans[1:])):
            raise LayoutMismatchError(
                f"process {process} holds units {spans} of block axis {axis}, not one "
                f"contiguous range: order the mesh's devices process by process")
        pieces[process] = Piece(axis, units, spans[0][0], spans[-1][1])
    return pieces


def piece_shape(layout: CacheLayout, piece: Piece) -> tuple[int, ...]:
    """One staged slot of `piece`: `[units held, *the other block axes]` (unit-major)."""
    rest = [d for a, d in enumerate(layout.block_shape) if a != piece.axis]
    return (piece.count, *rest)


def piece_staging(layout: CacheLayout, piece: Piece, num_slots: int,
                  caches: Sequence[jax.Array] | None = None) -> Staging:
    """Host staging for `piece` of each block: unit-major slots, per-unit fingerprint sums.

    With `caches` (this process's), on the XLA backend, where one device holds the piece
    (one replica), the regions are pinned-host buffers that `gather_piece_into` writes in
    place, with no host copy (`kvxfer.device.pinned`); else numpy.
    """
    route = _route(layout, piece)
    shape = piece_shape(layout, piece)
    if caches is not None and (isinstance(caches, (str, bytes)) or not isinstance(caches, Sequence)
                               or not caches
                               or not all(isinstance(c, jax.Array) for c in caches)):
        raise InvalidInputError(f"piece_staging caches must be this process's per-layer "
                                f"jax.Arrays, got {caches!r:.80}")
    regions = None
    if caches is not None:
        mesh = (_xla_pieces.local_mesh(_one_replica(caches[0], piece), piece)
                if route == _VIEW else caches[0].sharding.mesh)
        regions = staging_regions(mesh, layout.num_layers, num_slots, shape, layout.np_dtype)
    return Staging(layout.num_layers, num_slots, shape, layout.np_dtype,
                   prints_per_layer=piece.count, regions=regions)


def gather_piece_into(caches: Sequence[jax.Array], block_ids: Sequence[int] | np.ndarray,
                      staging: Staging, slots: Sequence[int] | np.ndarray, piece: Piece) -> None:
    """Copy this process's piece of each block into its slot, with its per-unit sums.

    `staging` is `piece_staging(...)`'s; `slots[i]` receives block `block_ids[i]`.
    Reads only this process's shards (one replica of each unit range).
    """
    layout = CacheLayout.from_caches(caches)
    ids, dst, route = _check_piece_call(layout, block_ids, staging, slots, piece,
                                        distinct_ids=False)
    if len(ids) == 0:
        return
    if route == _VIEW:
        view = _xla_pieces.local_view(caches, [_one_replica(c, piece) for c in caches], piece)
        _xla_pieces.gather(layout, view, ids, piece.axis, _unit_weights(layout, piece),
                           staging.regions, staging.prints, dst)
        return
    if route == _WHOLE:  # blocks split otherwise too, in this one process: whole blocks
        mesh = caches[0].sharding.mesh
        sources = [[(s, np.asarray(s.data)) for s in rows.addressable_shards if s.replica_id == 0]
                   for rows in _xla.gather(layout, mesh, caches, ids, False)]
        copies = RowCopies(np.arange(len(ids)), dst, ids_are_dst=False)
    else:
        jax.block_until_ready(list(caches))
        sources = [[(s, buffer_view(s.data)) for s in _one_replica(c, piece)] for c in caches]
        copies = RowCopies(ids, dst, ids_are_dst=False)
    runs = coalesce(np.sort(dst).tolist())

    def copy_layer(layer: int, shards: list, region: np.ndarray) -> None:
        view = _block_order(region, piece)
        for shard, data in shards:
            copies.copy(shard, view[_local_index(shard, piece)], data)
        _sum_units(layout, staging, layer, runs, piece)  # the rows just copied, while in cache

    run_per_shard([functools.partial(copy_layer, layer, shards, region)
                   for layer, (shards, region) in enumerate(zip(sources, staging.regions))])


def scatter_piece(caches: Sequence[jax.Array], staging: Staging,
                  block_ids: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray,
                  piece: Piece, sums: bool = True) -> tuple[list[jax.Array], np.ndarray | None]:
    """Write this process's piece of each block from its slot into the caches, in place.

    The caches are donated. On the numpy backend every process of the instance calls
    this with the same block ids (the donation is one program over the whole mesh); on
    the XLA backend each process donates and writes only its own shards. Returns the
    new caches and `uint32[num_layers, n, 3]`: the fingerprints of what landed in this
    process's shards of the piece (one replica of each), to compare with P's per-unit
    sums over `[piece.lo, piece.hi)` (`piece_prints`); None with `sums=False` (nothing
    is hashed).
    """
    check_flag("sums", sums)
    layout = CacheLayout.from_caches(caches)
    ids, src, route = _check_piece_call(layout, block_ids, staging, slots, piece,
                                        distinct_ids=True)
    if len(ids) == 0:
        return list(caches), np.zeros((layout.num_layers, 0, SUMS), np.uint32) if sums else None
    if route == _VIEW:  # the sums, when wanted, in the same program
        view = _xla_pieces.local_view(caches, [_held_shards(c, piece) for c in caches], piece)
        new, landed = _xla_pieces.scatter(layout, caches, view, staging.regions, src, ids,
                                          piece.axis, _unit_weights(layout, piece), sums)
        return new, None if landed is None else fmix32(reduce_sums(landed, 1).transpose(1, 0, 2))
    if route == _WHOLE:  # blocks split otherwise too, in this one process: whole blocks
        rows = [np.ascontiguousarray(_block_order(region, piece)[src]) for region in staging.regions]
        return _xla.scatter(layout, caches[0].sharding.mesh, caches, rows, ids,
                            np.arange(len(ids)), sums)
    threads = host_threads()  # a bad setting is refused before the caches are donated
    new = own_buffers(layout, caches[0].sharding.mesh)(list(caches))
    jax.block_until_ready(new)
    copies = RowCopies(ids, src, ids_are_dst=True)
    hashes = BufferHashes(layout, ids) if sums else None
    tasks = []
    for layer, (cache, region) in enumerate(zip(new, staging.regions)):
        view = _block_order(region, piece)
        for shard, first in _replicas(cache, piece):  # every replica has its own buffer
            tasks.append(functools.partial(
                copy_then_hash, copies, shard, buffer_view(shard.data),
                view[_local_index(shard, piece)], hashes if first else None, layer))
    run_per_shard(tasks, threads)
    return new, None if hashes is None else hashes.result()


def precompile_piece(caches: Sequence[jax.Array], staging: Staging, piece: Piece,
                     max_blocks: int, *, saves: bool, loads: bool, sums: bool = True) -> int:
    """Compile, without running anything, every program that `gather_piece_into` (`saves`)
    and `scatter_piece` (`loads`, with `sums`) run for 1 to `max_blocks` blocks of this
    process's piece; returns how many (0 on the numpy backend, which compiles nothing).
    As `kvxfer.device.gather.precompile`, for pieces."""
    layout = CacheLayout.from_caches(caches)
    _, _, route = _check_piece_call(layout, np.zeros(0, np.int64), staging,
                                    np.zeros(0, np.int64), piece, distinct_ids=False)
    check_precompile_args(max_blocks, saves=saves, loads=loads, sums=sums)
    if route == _NUMPY:
        return 0
    if route == _WHOLE:
        return _xla.precompile(layout, caches[0].sharding.mesh, caches, max_blocks, saves, loads,
                               sums, save_prints=False)
    weights, count = _unit_weights(layout, piece), 0
    for wanted, shards, gathers in ((saves, _one_replica, True), (loads, _held_shards, False)):
        if wanted:  # a gather reads one replica, a scatter writes all: other views
            view = _xla_pieces.local_view(caches, [shards(c, piece) for c in caches], piece)
            count += _xla_pieces.precompile(layout, view, piece.axis, weights, staging.regions,
                                            max_blocks, gathers, not gathers, sums)
    return count


def piece_prints(staging: Staging, slots: Sequence[int] | np.ndarray) -> np.ndarray:
    """`uint32[num_layers, n, 3]`: each slot's per-unit sums combined (`P` by XOR, `L` and
    `H` mod 2**32) and mixed: the fingerprint of the slot's piece, which for a piece of
    every unit is the block's (`kvxfer.device.gather.fingerprint_blocks`)."""
    prints = staging.prints[np.asarray(slots, np.int64)]  # [n, units, layers, 3]
    return fmix32(reduce_sums(prints, axis=1).transpose(1, 0, 2))


_NUMPY, _VIEW, _WHOLE = "numpy", "xla view", "xla whole blocks"


def _route(layout: CacheLayout, piece: Piece) -> str:
    """How a piece of these caches is copied: `_NUMPY` (the numpy backend), `_VIEW` (the XLA
    backend over a view of this process's shards, `kvxfer.device._xla_pieces`) or `_WHOLE`
    (the XLA backend's whole-block programs, where blocks are split along other axes too,
    in an instance of one process). Refuses, by name, a piece that does not cut blocks
    along their unit axis (`split_axis`; a piece of every unit may cut them along any
    axis), or whose unit's or shard's innermost run is not whole 32-bit words (what the
    sums add)."""
    whole = piece.lo == 0 and piece.hi == piece.units
    if (piece.axis >= len(layout.block_shape) or layout.block_shape[piece.axis] != piece.units
            or not (whole or piece.axis == split_axis(layout))):
        raise LayoutMismatchError(f"piece {piece} does not cut blocks of {layout.block_shape} "
                                  f"(spec {layout.spec}) along their unit axis")
    if (not sums_words(layout, layout.shard_block_shape[-1])
            or piece.axis == len(layout.block_shape) - 1):
        raise LayoutMismatchError(
            f"blocks of {layout.block_shape} {layout.dtype} (spec {layout.spec}) cut along axis "
            f"{piece.axis}: a unit's and a shard's innermost run must be whole 32-bit words, "
            f"and not the unit axis itself")
    if _backend() == "numpy":  # a bad KVXFER_BACKEND is refused here too
        return _NUMPY
    sizes = dict(layout.mesh_axes)
    if all(math.prod(sizes[n] for n in entry) == 1
           for a, entry in enumerate(layout.spec) if a != 1 + piece.axis):
        return _VIEW  # blocks split along the unit axis alone
    if jax.process_count() > 1:
        raise LayoutMismatchError(
            f"caches split blocks along axes other than the unit axis {piece.axis} (spec "
            f"{layout.spec}) on this process of an instance across hosts: the XLA backend "
            f"copies pieces of those only in an instance of one process")
    return _WHOLE


def _backend() -> str:
    """`kvxfer.device.gather`'s choice for this process's devices: `"numpy"` or `"xla"`."""
    return backend_for(d.platform for d in jax.local_devices())


def _check_piece_call(layout: CacheLayout, block_ids: Any, staging: Staging, slots: Any,
                      piece: Piece, distinct_ids: bool) -> tuple[np.ndarray, np.ndarray, str]:
    """Checked `(ids, slots)`, and the `_route` the copy takes: slots always distinct; ids
    too for a scatter (a gather may stage one block twice: requests that share a prefix
    each have their slots)."""
    route = _route(layout, piece)
    ids = check_block_ids(block_ids, layout)
    want = (layout.num_layers, piece_shape(layout, piece), layout.np_dtype, piece.count)
    got = (staging.num_layers, staging.block_shape, staging.dtype, staging.prints_per_layer)
    if not isinstance(staging, Staging) or got != want:
        raise LayoutMismatchError(f"staging holds (layers, slot shape, dtype, units) {got}, "
                                  f"piece {piece} of these caches needs {want}")
    rows = np.asarray(slots)
    if (rows.ndim != 1 or len(rows) != len(ids) or not np.issubdtype(rows.dtype, np.integer)
            or (rows < 0).any() or (rows >= staging.num_slots).any()):
        raise InvalidInputError(f"slots must be {len(ids)} ints in [0, {staging.num_slots}), "
                                f"got {np.asarray(slots).tolist()[:16]}")
    if len(np.unique(rows)) != len(rows):
        raise InvalidInputError(f"slots of one call must be distinct, got {rows.tolist()[:16]}")
    if distinct_ids and len(np.unique(ids)) != len(ids):
        raise InvalidInputError(f"block ids of one scatter must be distinct, got "
                                f"{ids.tolist()[:16]}")
    return ids, rows.astype(np.int64), route


def _block_order(region: np.ndarray, piece: Piece) -> np.ndarray:
    """A unit-major region seen in block order, `[slots, *block_shape with the piece's units]`."""
    return np.moveaxis(region, 1, 1 + piece.axis)


def _local_index(shard: jax.Shard, piece: Piece) -> tuple[slice, ...]:
    """Where `shard`'s part of a block sits in a block-order view of `piece`'s slots."""
    lo, hi, _ = shard.index[1 + piece.axis].indices(piece.units)
    index = [slice(None), *shard.index[1:]]
    index[1 + piece.axis] = slice(lo - piece.lo, hi - piece.lo)
    return tuple(index)


def _held_shards(cache: jax.Array, piece: Piece) -> list[jax.Shard]:
    """This process's shards inside `piece` (all of them, in a multi-process instance)."""
    out = []
    for shard in cache.addressable_shards:
        lo, hi, _ = shard.index[1 + piece.axis].indices(piece.units)
        if piece.lo <= lo and hi <= piece.hi:
            out.append(shard)
        elif lo < piece.hi and piece.lo < hi:
            raise LayoutMismatchError(f"a shard holds units [{lo}, {hi}), across the edge of "
                                      f"piece {piece}")
    return out


def _replicas(cache: jax.Array, piece: Piece) -> list[tuple[jax.Shard, bool]]:
    """The shards inside `piece`, each with whether it is the first of its ranges of blocks
    and units (by index: shard objects are not kept, so their ids say nothing)."""
    seen, out = set(), []
    for shard in _held_shards(cache, piece):
        key = tuple(s.indices(n) for s, n in zip(shard.index, cache.shape))
        out.append((shard, key not in seen))
        seen.add(key)
    return out


def _one_replica(cache: jax.Array, piece: Piece) -> list[jax.Shard]:
    """The shards inside `piece`, one per distinct range of units (replicas skipped)."""
    return [shard for shard, first in _replicas(cache, piece) if first]


def _sum_units(layout: CacheLayout, staging: Staging, layer: int,
               runs: list[tuple[int, int]], piece: Piece) -> None:
    """`staging.prints[slot, unit, layer]` = the sums of the unit's words against their block
    weights, for the slots in `runs` (`(start, length)`)."""
    weights = _unit_weights(layout, piece)  # [units held, words per unit]
    region = staging.regions[layer]
    words = region.reshape(region.shape[0], piece.count, -1).view(np.uint32)
    for start, length in runs:
        word_sums(words[start : start + length], weights, "suj,uj->su",
                  out=staging.prints[start : start + length, :, layer])


def _unit_weights(layout: CacheLayout, piece: Piece) -> np.ndarray:
    """`uint32[units held, words per unit]`: each word's weight by its index in the whole block."""
    index = [slice(None)] * len(layout.block_shape)
    index[piece.axis] = slice(piece.lo, piece.hi)
    return piece_weights(layout, tuple(index), unit_axis=piece.axis)
