"""The XLA backend of `kvxfer.device.pieces`: jitted programs over this process's own shards.

A process of a multi-host instance runs them alone, with no collective and no
dispatch on other hosts: the shards it holds of each cache are first viewed as
one array on a mesh of its own devices (`local_view`, no copy), and the
programs run on that mesh. A gather takes the blocks' rows on each device,
turns them unit-major (the piece's split axis first, as staging holds them),
sums each unit's words against its weights in the whole block (the
fingerprint's unmixed `(P, L, H)`, the same values `kvxfer.device.pieces` sums with
numpy), and lands both in pinned host memory; the rows are then copied into
the staging slots. A scatter moves staged rows to the devices, writes them into
the donated local view (XLA aliases it to its output: the shards keep their
buffers), sums what landed, and the caches are put back together from the new
shards. Block counts are padded to `bucket_size` as in `kvxfer.device._xla`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvxfer.device import pinned
from kvxfer.device._xla import _uint, bucket_ids, buckets_up_to, compile_all, copy_rows, dropped_ids
from kvxfer.device.layout import CacheLayout
from kvxfer.device.pinned import PinnedRegions
from kvxfer.errors import LayoutMismatchError


class Units(Protocol):
    """What this backend reads of a piece (`kvxfer.device.pieces.Piece` is one): its split
    axis, the axis's length, and how many of its units the piece holds."""

    axis: int
    units: int

    @property
    def count(self) -> int: ...

__all__ = ["gather", "local_mesh", "local_view", "precompile", "scatter"]

_16 = np.uint32(16)


def local_view(caches: Sequence[jax.Array], shards: Sequence[Sequence[jax.Shard]],
               piece: Units) -> list[jax.Array]:
    """The given shards of each cache as one array on a mesh of their devices, no copy.

    `shards[layer]` are grouped as `kvxfer.device.pieces` picks them: every shard of the
    piece, replicas included. The mesh is `('copies', 'units')`: a row per replica,
    a column per range of units (in order); the array is `[num_blocks, ...]` with the
    piece's units on its split axis, split over `'units'`.
    """
    mesh = local_mesh(shards[0], piece)
    sharding = NamedSharding(mesh, _unit_spec(len(caches[0].shape), piece.axis))
    shape = list(caches[0].shape)
    shape[1 + piece.axis] = piece.count
    return [jax.make_array_from_single_device_arrays(tuple(shape), sharding,
                                                     [s.data for s in held])
            for held in shards]


def local_mesh(shards: Sequence[jax.Shard], piece: Units) -> Mesh:
    """The mesh `local_view` puts a cache's given shards on."""
    return Mesh(_device_grid(shards, piece), ("copies", "units"))


def gather(layout: CacheLayout, view: Sequence[jax.Array], ids: np.ndarray, axis: int,
           weights: np.ndarray, regions: Sequence[np.ndarray], prints: np.ndarray,
           dst: np.ndarray) -> None:
    """Rows `ids` of the local view, unit-major, into slots `dst` of `regions`, and their
    per-unit sums into `prints[dst]` (`[slots, units, layers, 3]`)."""
    mesh = view[0].sharding.mesh
    if isinstance(regions, PinnedRegions) and regions.on_device_of(mesh):  # in place, no host copy
        sums = pinned.write_chunks(regions, ids, dst, _gather_fn(layout, mesh, axis, True),
                                   (list(view), _weights_on(mesh, weights)), 1,
                                   NamedSharding(mesh, PartitionSpec(None, "units")))
        prints[dst] = np.concatenate([np.asarray(s) for s in sums])
        return
    rows, sums = _gather_fn(layout, mesh, axis, False)(
        list(view), bucket_ids(ids, mesh), _weights_on(mesh, weights))
    copy_rows(rows, regions, dst)
    prints[dst] = np.asarray(sums)[: len(ids)]


def scatter(layout: CacheLayout, caches: Sequence[jax.Array], view: Sequence[jax.Array],
            regions: Sequence[np.ndarray], src: np.ndarray, ids: np.ndarray, axis: int,
            weights: np.ndarray, sums: bool) -> tuple[list[jax.Array], np.ndarray | None]:
    """Write slots `src` of `regions` (per layer, `[slots, units, *rest]`, unit-major) into
    blocks `ids` of the donated local view; returns the caches rebuilt with its new shards,
    and (with `sums`) the per-unit sums of what landed, `uint32[n, units, layers, 3]`."""
    mesh = view[0].sharding.mesh
    padded = dropped_ids(ids, layout.num_blocks)
    host = NamedSharding(mesh, PartitionSpec(None, "units"), memory_kind="pinned_host")
    staged = []
    for region in regions:
        rows = np.zeros((len(padded), *region.shape[1:]), region.dtype)
        np.take(region, src, axis=0, out=rows[: len(ids)], mode="clip")  # src is checked
        staged.append(jax.device_put(rows, host))
    kept = [[(s.device, s.data) for s in cache.addressable_shards]  # before they are donated
            for cache in caches]
    new, landed = _scatter_fn(layout, mesh, axis, sums)(
        list(view), staged, jax.device_put(padded, NamedSharding(mesh, PartitionSpec())),
        _weights_on(mesh, weights))
    out = []
    for cache, old, local in zip(caches, kept, new):
        by_device = {s.device: s.data for s in local.addressable_shards}
        out.append(jax.make_array_from_single_device_arrays(
            cache.shape, cache.sharding, [by_device.get(d, a) for d, a in old]))
    return out, None if landed is None else np.asarray(landed)[: len(ids)]


def precompile(layout: CacheLayout, view: Sequence[jax.Array], axis: int, weights: np.ndarray,
               regions: Sequence[np.ndarray], max_blocks: int, saves: bool, loads: bool,
               sums: bool) -> int:
    """Compile, without running, the programs `gather` (`saves`, into `regions`) and
    `scatter` (`loads`, with `sums`) run for 1 to `max_blocks` blocks; returns how many."""
    mesh = view[0].sharding.mesh
    on_mesh, programs = _weights_on(mesh, weights), []
    if saves and isinstance(regions, PinnedRegions) and regions.on_device_of(mesh):
        programs += pinned.write_programs(regions, max_blocks, _gather_fn(layout, mesh, axis, True),
                                          (list(view), on_mesh), 1,
                                          NamedSharding(mesh, PartitionSpec(None, "units")))
        saves = False
    ids_on = NamedSharding(mesh, PartitionSpec())
    host = NamedSharding(mesh, PartitionSpec(None, "units"), memory_kind="pinned_host")
    for bucket in buckets_up_to(max_blocks):
        ids = jax.ShapeDtypeStruct((bucket,), np.int32, sharding=ids_on)
        if saves:
            programs.append((_gather_fn(layout, mesh, axis, False), (list(view), ids, on_mesh)))
        if loads:
            staged = [jax.ShapeDtypeStruct((bucket, *r.shape[1:]), r.dtype, sharding=host)
                      for r in regions]
            programs.append((_scatter_fn(layout, mesh, axis, sums),
                             (list(view), staged, ids, on_mesh)))
    return compile_all(programs)


# Jitted builders, cached on the static layout, the local mesh and the split axis.


@functools.lru_cache(maxsize=64)
def _gather_fn(layout: CacheLayout, mesh: Mesh, axis: int, in_place: bool):
    """Rows, unit-major, and their per-unit sums: per layer in pinned host, or (`in_place`,
    for `PinnedRegions` on one device) per layer as unsigned ints on the device."""
    dtype, udtype = layout.np_dtype, _uint(layout.np_dtype)
    spec = _unit_spec(1 + len(layout.block_shape), axis)

    def local(caches: list[jax.Array], ids: jax.Array, weights: jax.Array):
        rows, sums = [], []
        for cache in caches:
            row = jnp.moveaxis(jnp.take(lax.bitcast_convert_type(cache, udtype), ids, axis=0),
                               1 + axis, 1)
            sums.append(_unit_sums(row, weights))
            rows.append(row if in_place else lax.bitcast_convert_type(row, dtype))
        return rows, jnp.stack(sums, axis=2)

    if in_place:  # one device: plain code, as `pinned._gather_fn`
        return jax.jit(local)
    unit_major = PartitionSpec(None, "units")
    per_shard = jax.shard_map(
        local, mesh=mesh,
        in_specs=([spec] * layout.num_layers, PartitionSpec(), PartitionSpec("units")),
        out_specs=([unit_major] * layout.num_layers, unit_major), check_vma=False)
    host = NamedSharding(mesh, unit_major, memory_kind="pinned_host")
    return jax.jit(per_shard, out_shardings=([host] * layout.num_layers, host))


@functools.lru_cache(maxsize=64)
def _scatter_fn(layout: CacheLayout, mesh: Mesh, axis: int, sums: bool):
    dtype, udtype = layout.np_dtype, _uint(layout.np_dtype)
    spec = _unit_spec(1 + len(layout.block_shape), axis)
    unit_major = PartitionSpec(None, "units")

    def local(caches: list[jax.Array], rows: list[jax.Array], ids: jax.Array,
              weights: jax.Array):
        out, landed = [], []
        for cache, row in zip(caches, rows):
            row = jnp.moveaxis(lax.bitcast_convert_type(row, udtype), 1, 1 + axis)
            new = lax.bitcast_convert_type(cache, udtype).at[ids].set(
                row, mode="drop", unique_indices=True)
            if sums:
                taken = jnp.take(new, ids, axis=0, mode="clip")
                landed.append(_unit_sums(jnp.moveaxis(taken, 1 + axis, 1), weights))
            out.append(lax.bitcast_convert_type(new, dtype))
        return out, jnp.stack(landed, axis=2) if sums else None

    per_shard = jax.shard_map(
        local, mesh=mesh,
        in_specs=([spec] * layout.num_layers, [unit_major] * layout.num_layers,
                  PartitionSpec(), PartitionSpec("units")),
        out_specs=([spec] * layout.num_layers, unit_major if sums else None), check_vma=False)
    on_device = NamedSharding(mesh, unit_major)

    def scatter(caches, rows, ids, weights):
        rows = [jax.device_put(r, on_device) for r in rows]  # pinned host -> device
        return per_shard(caches, rows, ids, weights)

    return jax.jit(scatter, donate_argnums=0,
                   out_shardings=([NamedSharding(mesh, spec)] * layout.num_layers,
                                  NamedSharding(mesh, unit_major) if sums else None))


def _unit_sums(rows: jax.Array, weights: jax.Array) -> jax.Array:
    """`uint32[n, units, 3]`: unmixed `(P, L, H)` of each unit's words, for unit-major
    unsigned rows `[n, units, *rest]` and `weights` `uint32[units, words per unit]`."""
    n, units = rows.shape[:2]
    per_word = 4 // rows.dtype.itemsize
    if per_word > 1:  # whole words: the unit's innermost run is a multiple of per_word
        rows = rows.reshape(n, units, -1, per_word)
    words = lax.bitcast_convert_type(rows, jnp.uint32).reshape(n, units, -1)
    p = lax.reduce(words, np.uint32(0), lax.bitwise_xor, (2,))
    low = jnp.sum((words & jnp.uint32(0xFFFF)) * weights[None], axis=2, dtype=jnp.uint32)
    high = jnp.sum((words >> _16) * weights[None], axis=2, dtype=jnp.uint32)
    return jnp.stack([p, low, high], axis=2)


@functools.lru_cache(maxsize=64)
def _weights_cached(mesh: Mesh, key: bytes, shape: tuple[int, ...]) -> jax.Array:
    weights = np.frombuffer(key, np.uint32).reshape(shape)
    return jax.device_put(weights, NamedSharding(mesh, PartitionSpec("units")))


def _weights_on(mesh: Mesh, weights: np.ndarray) -> jax.Array:
    """The piece's word weights on the local mesh, split by unit (kept between calls)."""
    return _weights_cached(mesh, np.ascontiguousarray(weights, np.uint32).tobytes(),
                           weights.shape)


def _unit_spec(ndim: int, axis: int) -> PartitionSpec:
    spec: list[str | None] = [None] * ndim
    spec[1 + axis] = "units"
    return PartitionSpec(*spec)


def _device_grid(shards: Sequence[jax.Shard], piece: Units) -> np.ndarray:
    """`[replicas, ranges]` of the shards' devices, ranges of units in order."""
    by_range: dict[tuple[int, int, int], list[jax.Device]] = {}
    for shard in shards:
        key = shard.index[1 + piece.axis].indices(piece.units)
        by_range.setdefault(key, []).append(shard.device)
    columns = [by_range[key] for key in sorted(by_range)]
    if len({len(c) for c in columns}) != 1:
        raise LayoutMismatchError(
            f"this process holds {[len(c) for c in columns]} replicas of its unit ranges "
            f"{sorted(by_range)}: pieces need the same number of each")
    return np.array(columns, dtype=object).T

