"""The XLA backend: jitted `shard_map` programs for gather, scatter and fingerprints.

The path for TPUs and GPUs (and, selected with `KVXFER_BACKEND=xla`, for
XLA:CPU in tests). Every program does all layers in one dispatch, per shard,
with no cross-device traffic where the block axis is unsharded; where it is
sharded (over `'data'`), each shard takes the blocks it holds, zeros the
rest, and a `psum` over the block axes assembles the rows. Blocks move as
unsigned integers of the element's width, so bf16 and fp8 NaN payloads
round-trip bit for bit. Block counts are padded to power-of-two buckets
(`bucket_size`) and the ids go in as a device array, so a new count never
recompiles after one call per bucket; builders are cached on the static
`CacheLayout`, the mesh and the bucket. A scatter is an XLA scatter with
unique indices into the donated caches, which the compiled program aliases
to its outputs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvxfer.device._rows import RowCopies
from kvxfer.device.fingerprint import device_fingerprint
from kvxfer.device.layout import CacheLayout
from kvxfer.errors import InvalidInputError

__all__ = ["MIN_BUCKET", "bucket_size", "buckets_up_to", "fingerprint", "fingerprint_async",
           "gather", "precompile", "scatter"]


MIN_BUCKET = 8
"""The smallest padded block count; counts up to it share one compiled program."""


def bucket_size(count: int) -> int:
    """The padded row count for `count` blocks: the next power of two, at least `MIN_BUCKET`."""
    if count < 0:
        raise InvalidInputError(f"block count must be non-negative, got {count}")
    return max(MIN_BUCKET, 1 << max(count - 1, 0).bit_length())


def buckets_up_to(count: int) -> list[int]:
    """Every bucket a call of 1 to `count` blocks pads to."""
    return [b for b in (MIN_BUCKET << i for i in range(64)) if b <= bucket_size(count)]


def bucket_ids(ids: np.ndarray, mesh: Mesh) -> jax.Array:
    """`ids` padded to their bucket with copies of the last (any valid id), on the mesh."""
    padded = np.full(bucket_size(len(ids)), ids[-1] if len(ids) else 0, np.int32)
    padded[: len(ids)] = ids
    return jax.device_put(padded, NamedSharding(mesh, PartitionSpec()))


def dropped_ids(ids: np.ndarray, num_blocks: int) -> np.ndarray:
    """`ids` padded to their bucket with distinct ids past the last block: a scatter drops
    them, and its indices stay unique."""
    padded = (num_blocks + np.arange(bucket_size(len(ids)))).astype(np.int32)
    padded[: len(ids)] = ids
    return padded


def copy_rows(gathered: Sequence[jax.Array], regions: Sequence[np.ndarray],
              dst: np.ndarray) -> None:
    """Row `i` of each layer's gathered pinned-host array into slot `dst[i]` of its region,
    shard by shard (one replica of each), each shard's piece where its index puts it."""
    copies = RowCopies(np.arange(len(dst)), dst, ids_are_dst=False)
    for rows, region in zip(gathered, regions):
        for shard in rows.addressable_shards:
            if shard.replica_id == 0:
                copies.copy(shard, region[(slice(None), *shard.index[1:])], np.asarray(shard.data))


def bucket_rows(
    h: jax.Array | np.ndarray, src: np.ndarray, bucket: int, sharding: NamedSharding
) -> jax.Array:
    """Rows `src` of `h` as exactly `bucket` rows in pinned host memory (no recompiles)."""
    if (isinstance(h, jax.Array) and h.shape[0] == bucket and h.sharding == sharding
            and np.array_equal(src, np.arange(len(src)))):
        return h
    padded = np.zeros((bucket, *h.shape[1:]), h.dtype)
    np.take(np.asarray(h), src, axis=0, out=padded[: len(src)])
    return jax.device_put(padded, sharding)


# The backend: what `kvxfer.device.gather` calls once its inputs are checked.


def gather(layout: CacheLayout, mesh: Mesh, caches: Sequence[jax.Array], ids: np.ndarray,
           fingerprints: bool):
    """Blocks `ids` of every layer in pinned host memory (and their prints), one dispatch."""
    return gather_fn(layout, mesh, fingerprints)(list(caches), bucket_ids(ids, mesh))


def scatter(layout: CacheLayout, mesh: Mesh, caches: Sequence[jax.Array],
            host_blocks: Sequence[jax.Array | np.ndarray], ids: np.ndarray, src: np.ndarray,
            fingerprints: bool) -> tuple[list[jax.Array], np.ndarray | None]:
    """An XLA scatter of rows `src` into blocks `ids` of the donated caches (aliased in and out)."""
    bucket = bucket_size(len(ids))
    padded = dropped_ids(ids, layout.num_blocks)
    host_sharding = NamedSharding(mesh, layout.host_partition_spec(), memory_kind="pinned_host")
    rows = [bucket_rows(h, src, bucket, host_sharding) for h in host_blocks]
    new = scatter_fn(layout, mesh)(list(caches), rows,
                                   jax.device_put(padded, NamedSharding(mesh, PartitionSpec())))
    return new, fingerprint(layout, mesh, new, ids) if fingerprints else None


def fingerprint(layout: CacheLayout, mesh: Mesh, caches: Sequence[jax.Array],
                ids: np.ndarray) -> np.ndarray:
    """`uint32[num_layers, n, 3]`: the prints of blocks `ids`, computed on device."""
    return np.asarray(fingerprint_async(layout, mesh, caches, ids))[:, : len(ids)]


def fingerprint_async(layout: CacheLayout, mesh: Mesh, caches: Sequence[jax.Array],
                      ids: np.ndarray) -> jax.Array:
    """`fingerprint`, dispatched: `uint32[num_layers, bucket, 3]`, not yet waited for."""
    return fingerprint_fn(layout, mesh)(list(caches), bucket_ids(ids, mesh))


def precompile(layout: CacheLayout, mesh: Mesh, caches: Sequence[jax.Array], max_blocks: int,
               saves: bool, loads: bool, fingerprints: bool, save_prints: bool = True) -> int:
    """Compile, without running, the programs `gather` (`saves`, with `save_prints`) and
    `scatter` (`loads`, with `fingerprints`) run for every bucket up to `max_blocks`, with
    the arguments' exact types and shardings (so a call finds them compiled); returns how
    many."""
    ids_on = NamedSharding(mesh, PartitionSpec())
    host = NamedSharding(mesh, layout.host_partition_spec(), memory_kind="pinned_host")
    programs = []
    for bucket in buckets_up_to(max_blocks):
        ids = jax.ShapeDtypeStruct((bucket,), np.int32, sharding=ids_on)
        rows = [jax.ShapeDtypeStruct((bucket, *layout.block_shape), layout.np_dtype,
                                     sharding=host)] * layout.num_layers
        programs += [(gather_fn(layout, mesh, save_prints), (list(caches), ids))] if saves else []
        programs += [(scatter_fn(layout, mesh), (list(caches), rows, ids))] if loads else []
        programs += ([(fingerprint_fn(layout, mesh), (list(caches), ids))]
                     if loads and fingerprints else [])
    return compile_all(programs)


def compile_all(programs: Sequence[tuple[Any, tuple[Any, ...]]]) -> int:
    """`fn.lower(*args).compile()` for each `(fn, args)`, several at once (XLA compiles
    without the GIL: on XLA:CPU's 2 cores here, 32 layers, 1.2x faster than one by one
    for P's 26 programs, 1.5x for D's 20); returns how many."""
    lowered = [fn.lower(*args) for fn, args in programs]  # traces: under the GIL anyway
    threads = min(8, len(os.sched_getaffinity(0)))  # this process's cores, as host copies
    with ThreadPoolExecutor(threads, thread_name_prefix="kvxfer-compile") as pool:
        list(pool.map(lambda program: program.compile(), lowered))
    return len(lowered)


# Jitted builders.


def _uint(dtype: np.dtype) -> np.dtype:
    if dtype.itemsize not in (1, 2, 4):
        raise InvalidInputError(f"dtype {dtype} of itemsize {dtype.itemsize} is not supported")
    return np.dtype(f"uint{8 * dtype.itemsize}")


@functools.lru_cache(maxsize=64)
def gather_fn(layout: CacheLayout, mesh: Mesh, fingerprints: bool):
    layout.check_mesh(mesh)
    dtype, udtype = layout.np_dtype, _uint(layout.np_dtype)
    block_axes = layout.spec[0]
    cache_spec, host_spec = layout.partition_spec(), layout.host_partition_spec()

    def local(caches: list[jax.Array], ids: jax.Array):
        # Per device: its shard of each cache, [num_blocks / data, *shard_block_shape].
        if block_axes:
            ids, inside = _local_ids(ids, caches[0].shape[0], block_axes)
        rows = []
        for cache in caches:
            row = jnp.take(lax.bitcast_convert_type(cache, udtype), ids, axis=0)
            if block_axes:
                # Each block lives on one shard of the block axes: the others add zeros.
                row = lax.psum(jnp.where(_bcast(inside, row.ndim), row, 0), block_axes)
            rows.append(row)
        blocks = [lax.bitcast_convert_type(r, dtype) for r in rows]
        if not fingerprints:
            return blocks
        return blocks, jnp.stack([device_fingerprint(r, layout) for r in rows])

    out_specs: object = [host_spec] * layout.num_layers
    host = NamedSharding(mesh, host_spec, memory_kind="pinned_host")
    out_shardings: object = [host] * layout.num_layers
    if fingerprints:
        out_specs = (out_specs, PartitionSpec())
        out_shardings = (out_shardings,
                         NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host"))
    per_shard = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=([cache_spec] * layout.num_layers, PartitionSpec()),
        out_specs=out_specs,
        check_vma=False,
    )
    return jax.jit(per_shard, out_shardings=out_shardings)


@functools.lru_cache(maxsize=64)
def scatter_fn(layout: CacheLayout, mesh: Mesh):
    layout.check_mesh(mesh)
    dtype, udtype = layout.np_dtype, _uint(layout.np_dtype)
    block_axes = layout.spec[0]
    cache_spec, host_spec = layout.partition_spec(), layout.host_partition_spec()
    on_device = NamedSharding(mesh, host_spec)

    def local(caches: list[jax.Array], rows: list[jax.Array], ids: jax.Array):
        num_local = caches[0].shape[0]
        if block_axes:
            ids, inside = _local_ids(ids, num_local, block_axes)
            # Another shard's block: dropped here, at an index no other row uses.
            ids = jnp.where(inside, ids, num_local + lax.iota(ids.dtype, ids.shape[0]))
        out = []
        for cache, row in zip(caches, rows):
            row = lax.bitcast_convert_type(row, udtype)
            new = lax.bitcast_convert_type(cache, udtype).at[ids].set(
                row, mode="drop", unique_indices=True)
            out.append(lax.bitcast_convert_type(new, dtype))
        return out

    per_shard = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=([cache_spec] * layout.num_layers, [host_spec] * layout.num_layers,
                  PartitionSpec()),
        out_specs=[cache_spec] * layout.num_layers,
        check_vma=False,
    )

    def scatter(caches: list[jax.Array], rows: list[jax.Array], ids: jax.Array):
        rows = [jax.device_put(r, on_device) for r in rows]  # pinned host -> device
        return per_shard(caches, rows, ids)

    cache_sharding = NamedSharding(mesh, cache_spec)
    return jax.jit(scatter, out_shardings=[cache_sharding] * layout.num_layers, donate_argnums=0)


@functools.lru_cache(maxsize=64)
def fingerprint_fn(layout: CacheLayout, mesh: Mesh):
    layout.check_mesh(mesh)
    udtype = _uint(layout.np_dtype)
    block_axes = layout.spec[0]

    def local(caches: list[jax.Array], ids: jax.Array) -> jax.Array:
        if block_axes:
            ids, inside = _local_ids(ids, caches[0].shape[0], block_axes)
        prints = []
        for cache in caches:
            h = device_fingerprint(
                jnp.take(lax.bitcast_convert_type(cache, udtype), ids, axis=0), layout)
            if block_axes:
                # One shard holds each block; the others add zeros (so XOR and sum agree).
                h = lax.psum(jnp.where(inside[:, None], h, jnp.uint32(0)), block_axes)
            prints.append(h)
        return jnp.stack(prints)

    per_shard = jax.shard_map(
        local, mesh=mesh,
        in_specs=([layout.partition_spec()] * layout.num_layers, PartitionSpec()),
        out_specs=PartitionSpec(), check_vma=False,
    )
    return jax.jit(per_shard)


def _local_ids(
    ids: jax.Array, num_local: int, block_axes: tuple[str, ...]
) -> tuple[jax.Array, jax.Array]:
    """Global ids as offsets into this device's contiguous range of blocks, and which fall in it."""
    first = lax.axis_index(block_axes) * num_local
    local = ids - first
    inside = (local >= 0) & (local < num_local)
    return jnp.where(inside, local, 0), inside


def _bcast(mask: jax.Array, ndim: int) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (ndim - 1))
