"""Gather KV blocks from device caches into host memory, and scatter them back.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from kvxfer._host_buffers import (
    _buffer_view,
    _BufferHashes,
    _copy_then_hash,
    _RowCopies,
    _scatter_in_place,
    _writes_in_place,
    run_per_shard,
)
from kvxfer._xla import _bucket_ids, _fingerprint_fn, _gather_fn, _scatter_xla
from kvxfer.errors import InvalidInputError, LayoutMismatchError
from kvxfer.fingerprint import _host_fingerprint, compare_fingerprints
from kvxfer.layout import CacheLayout


class GatheredBlocks(NamedTuple):
    """What `gather_blocks(..., fingerprints=True)` returns.

    - `blocks`: per layer, `[bucket, *block_shape]` in pinned host memory.
    - `fingerprints`: `uint32[num_layers, bucket]` in pinned host memory.
    """

    blocks: list[jax.Array]
    fingerprints: jax.Array


class ScatteredBlocks(NamedTuple):
    """What `scatter_blocks(..., fingerprints=True)` returns.

    - `caches`: the new caches.
    - `fingerprints`: `uint32[num_layers, n]`, of the blocks as they are in the new
      caches (what `fingerprint_blocks(caches, block_ids)` gives).
    """

    caches: list[jax.Array]
    fingerprints: np.ndarray


def gather_blocks(
    caches: Sequence[jax.Array],
    block_ids: Sequence[int] | np.ndarray | jax.Array,
    *,
    fingerprints: bool = False,
) -> list[jax.Array] | GatheredBlocks:
    """Copy the given blocks of every layer into pinned host memory, in one dispatch.

    **Arguments:**

    - `caches`: one array per layer, `[num_blocks, *block_shape]`, all with the same
      shape, dtype and `NamedSharding`. Not modified.
    - `block_ids`: 1-D integer kernel block ids, `[n]`, each in `[0, num_blocks)`.
      Repeats are allowed.
    - `fingerprints`: also return per-block fingerprints (independent of sharding).

    **Returns:**

    Per layer, a `[bucket_size(n), *block_shape]` array with memory kind
    `"pinned_host"`, on the caches' mesh with their `PartitionSpec` on the inner axes
    and axis 0 unsharded. Rows `0..n-1` are the requested blocks in order; later rows
    are bucket padding (copies of the last requested block). With
    `fingerprints=True`, a `GatheredBlocks(blocks, fingerprints)` instead.

    Raises `InvalidInputError` (or its subclass `LayoutMismatchError`) naming the
    offending value before anything is dispatched.
    """
    _check_flag("fingerprints", fingerprints)
    layout = CacheLayout.from_caches(caches)
    ids = _check_block_ids(block_ids, layout)
    mesh = caches[0].sharding.mesh
    out = _gather_fn(layout, mesh, fingerprints)(list(caches), _bucket_ids(ids, mesh))
    if fingerprints:
        return GatheredBlocks(*out)
    return out


def scatter_blocks(
    caches: Sequence[jax.Array],
    host_blocks: Sequence[jax.Array | np.ndarray],
    block_ids: Sequence[int] | np.ndarray | jax.Array,
    *,
    rows: Sequence[int] | np.ndarray | None = None,
    fingerprints: bool = False,
) -> list[jax.Array] | ScatteredBlocks:
    """Write blocks into the caches in place; the input caches are donated.

    **Arguments:**

    - `caches`: one array per layer, `[num_blocks, *block_shape]`, as for
      `gather_blocks`. Donated: do not use them after the call.
    - `host_blocks`: one array per layer, `[num_rows, *block_shape]`, of the caches'
      dtype (a `gather_blocks` result, numpy arrays, or staging regions).
    - `block_ids`: 1-D integer kernel block ids, `[n]`, distinct, each in
      `[0, num_blocks)`.
    - `rows`: which row of `host_blocks` goes to each block id, `[n]`, each in
      `[0, num_rows)`; by default rows `0..n-1`. Row `rows[i]` of each layer goes to
      block `block_ids[i]`.
    - `fingerprints`: also return the fingerprints of the blocks as they landed in
      the caches (D's check against the sender's). On XLA:CPU each block's rows are
      summed right after they are written, while they are in the processor's cache,
      which costs less than a separate `fingerprint_blocks`.

    **Returns:**

    The new caches, same shapes and shardings, with those blocks replaced and every
    other block unchanged (with `fingerprints=True`, a `ScatteredBlocks(caches,
    fingerprints)`). They hold the donated inputs' buffers: the cost is that of
    the `n` blocks, whatever the caches' size (see the module docstring). One
    exception on XLA:CPU: caches whose buffers JAX shares with a numpy array
    (`jax.device_put` of an aligned numpy array may not copy) cannot be donated, so
    the first scatter into them copies them once; later ones are in place.

    Raises `InvalidInputError` (or `LayoutMismatchError`) naming the offending value
    before anything is dispatched.
    """
    _check_flag("fingerprints", fingerprints)
    layout = CacheLayout.from_caches(caches)
    ids = _check_block_ids(block_ids, layout)
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise InvalidInputError(
            f"block_ids to scatter must be distinct; repeated: {uniq[counts > 1].tolist()}"
        )
    num_rows = _check_host_blocks(host_blocks, layout, 0 if rows is not None else len(ids))
    src = np.arange(len(ids)) if rows is None else _check_rows(rows, len(ids), num_rows)
    if len(ids) == 0:
        new = list(caches)
        return ScatteredBlocks(new, np.zeros((layout.num_layers, 0), np.uint32)) \
            if fingerprints else new
    mesh = caches[0].sharding.mesh
    hashes = _BufferHashes.of(layout, ids) if fingerprints else None
    if _writes_in_place(mesh):
        new = _scatter_in_place(layout, mesh, caches, host_blocks, ids, src, hashes)
    else:
        hashes = None
        new = _scatter_xla(layout, mesh, caches, host_blocks, ids, src)
    if not fingerprints:
        return new
    if hashes is not None:
        return ScatteredBlocks(new, hashes.result())
    return ScatteredBlocks(new, fingerprint_blocks(new, ids))


def gather_into(
    caches: Sequence[jax.Array],
    block_ids: Sequence[int] | np.ndarray | jax.Array,
    regions: Sequence[np.ndarray],
    rows: Sequence[int] | np.ndarray,
) -> np.ndarray:
    """Copy blocks into host arrays that already exist (staging), and fingerprint them.

    **Arguments:**

    - `caches`: one array per layer, `[num_blocks, *block_shape]`. Not modified.
    - `block_ids`: 1-D integer kernel block ids, `[n]`, each in `[0, num_blocks)`.
    - `regions`: one writable numpy array per layer, `[num_rows, *block_shape]`, of the
      caches' dtype.
    - `rows`: the row of `regions` each block goes to, `[n]`, distinct, each in
      `[0, num_rows)`.

    **Returns:**

    `uint32[num_layers, n]`: the blocks' fingerprints, computed on device
    from the caches (the same values `gather_blocks(..., fingerprints=True)` gives).
    """
    layout = CacheLayout.from_caches(caches)
    ids = _check_block_ids(block_ids, layout)
    num_rows = _check_host_blocks(regions, layout, 0, "regions")
    dst = _check_rows(rows, len(ids), num_rows)
    if len(np.unique(dst)) != len(dst):
        raise InvalidInputError(f"rows to gather into must be distinct, got {dst.tolist()[:16]}")
    for i, region in enumerate(regions):
        if not isinstance(region, np.ndarray) or not region.flags.writeable:
            raise InvalidInputError(f"regions[{i}] must be a writable numpy array")
    if len(ids) == 0:
        return np.zeros((layout.num_layers, 0), np.uint32)
    mesh = caches[0].sharding.mesh
    if _writes_in_place(mesh):
        jax.block_until_ready(list(caches))
        hashes = _BufferHashes.of(layout, ids)
        if hashes is None:  # pieces that are not whole words: hash on device meanwhile
            prints = _fingerprint_fn(layout, mesh)(list(caches), _bucket_ids(ids, mesh))
        copies = _RowCopies(ids, dst, ids_are_dst=False)
        tasks = []
        for layer, (cache, region) in enumerate(zip(caches, regions)):
            for shard in cache.addressable_shards:
                if shard.replica_id == 0:
                    view = _buffer_view(shard.data)
                    tasks.append(functools.partial(
                        _copy_then_hash, copies, shard, region[(slice(None), *shard.index[1:])],
                        view, hashes, layer))
        run_per_shard(tasks)
        if hashes is not None:
            return hashes.result()
        return np.asarray(prints)[:, : len(ids)]
    gathered = gather_blocks(caches, ids, fingerprints=True)
    copies = _RowCopies(np.arange(len(ids)), dst, ids_are_dst=False)  # row i -> slot dst[i]
    for blocks, region in zip(gathered.blocks, regions):
        for shard in blocks.addressable_shards:
            if shard.replica_id == 0:
                copies.copy(shard, region[(slice(None), *shard.index[1:])],
                            np.asarray(shard.data))
    return np.asarray(gathered.fingerprints)[:, : len(ids)]


def fingerprint_blocks(
    caches: Sequence[jax.Array], block_ids: Sequence[int] | np.ndarray | jax.Array
) -> np.ndarray:
    """Fingerprints of blocks as they are in the caches, computed on device.

    `uint32[num_layers, n]`, the values `gather_blocks(...,
    fingerprints=True)` gives for the same bytes: D checks the blocks it wrote
    against P's fingerprints with it, after the scatter.
    """
    layout = CacheLayout.from_caches(caches)
    ids = _check_block_ids(block_ids, layout)
    mesh = caches[0].sharding.mesh
    hashes = _BufferHashes.of(layout, ids) if _writes_in_place(mesh) else None
    if hashes is None:
        out = _fingerprint_fn(layout, mesh)(list(caches), _bucket_ids(ids, mesh))
        return np.asarray(out)[:, : len(ids)]
    jax.block_until_ready(list(caches))
    run_per_shard([functools.partial(hashes.add, layer, shard, _buffer_view(shard.data))
                   for layer, cache in enumerate(caches)
                   for shard in cache.addressable_shards if shard.replica_id == 0])
    return hashes.result()


def block_fingerprints(
    layout: CacheLayout, host_blocks: Sequence[jax.Array | np.ndarray], count: int
) -> np.ndarray:
    """Fingerprints of the first `count` rows of host blocks, computed with numpy.

    Gives the same values as `gather_blocks(..., fingerprints=True)` computes on
    device, from the block bytes alone.

    **Arguments:**

    - `layout`: the layout the blocks were gathered with (it says how a block is cut
      into shards).
    - `host_blocks`: one array per layer, `[rows, *block_shape]`, `rows >= count`.
    - `count`: how many leading rows are real blocks.

    **Returns:**

    `uint32[num_layers, count]`.
    """
    count = _check_count(count)
    _check_host_blocks(host_blocks, layout, count)
    return np.stack([_host_fingerprint(layout, np.asarray(h)[:count]) for h in host_blocks])


def check_fingerprints(
    layout: CacheLayout,
    host_blocks: Sequence[jax.Array | np.ndarray],
    count: int,
    expected: jax.Array | np.ndarray,
) -> None:
    """Raise `CorruptionError` unless received blocks match the sender's fingerprints.

    **Arguments:**

    - `layout`: the sender's layout (checked compatible before the transfer).
    - `host_blocks`: one array per layer, `[rows, *block_shape]`, `rows >= count`, as
      received.
    - `count`: how many leading rows are real blocks.
    - `expected`: `uint32[num_layers, rows']`, `rows' >= count`, the
      fingerprints `gather_blocks` returned at the source.

    The error names the first mismatching layer and block row.
    """
    count = _check_count(count)
    expected = np.asarray(expected)
    if expected.ndim != 2 or expected.shape[0] != layout.num_layers or expected.shape[1] < count:
        raise InvalidInputError(
            f"expected fingerprints have shape {expected.shape}; need "
            f"[{layout.num_layers}, >= {count}]"
        )
    compare_fingerprints(block_fingerprints(layout, host_blocks, count), expected[:, :count])


def _check_block_ids(block_ids: object, layout: CacheLayout) -> np.ndarray:
    ids = np.asarray(block_ids)
    if ids.ndim != 1:
        raise InvalidInputError(f"block_ids must be 1-D, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise InvalidInputError(f"block_ids must be integers, got dtype {ids.dtype}")
    ids = ids.astype(np.int64)
    bad = ids[(ids < 0) | (ids >= layout.num_blocks)]
    if bad.size:
        raise InvalidInputError(
            f"block ids {bad[:8].tolist()} out of range [0, {layout.num_blocks})"
        )
    return ids.astype(np.int32)


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be True or False, got {value!r:.80}")


def _check_count(count: object) -> int:
    """`count` as an int: it must be a non-negative integer (numpy ones too), not a bool."""
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
        raise InvalidInputError(f"count must be a non-negative int, got {count!r}")
    return int(count)


def _check_rows(rows: object, count: int, num_rows: int) -> np.ndarray:
    """`rows` as int64 `[count]`, each in `[0, num_rows)`."""
    arr = np.asarray(rows)
    if arr.shape != (count,) or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidInputError(
            f"rows must hold one integer per block id ({count}), got {np.asarray(rows).tolist()!r:.80}")
    arr = arr.astype(np.int64)
    bad = arr[(arr < 0) | (arr >= num_rows)]
    if bad.size:
        raise InvalidInputError(f"rows {bad[:8].tolist()} out of range [0, {num_rows})")
    return arr


def _check_host_blocks(host_blocks: object, layout: CacheLayout, count: int,
                       name: str = "host_blocks") -> int:
    """Check per-layer host arrays of at least `count` rows; returns their row count."""
    if isinstance(host_blocks, (jax.Array, np.ndarray)) or not isinstance(host_blocks, Sequence):
        raise InvalidInputError(
            f"{name} must be a list of per-layer arrays, got {type(host_blocks).__name__}"
        )
    if len(host_blocks) != layout.num_layers:
        raise LayoutMismatchError(
            f"{name} has {len(host_blocks)} layers; the caches have {layout.num_layers}"
        )
    for i, h in enumerate(host_blocks):
        if isinstance(h, jax.Array) and h.is_deleted():
            raise InvalidInputError(
                f"{name}[{i}] was deleted (donated to an earlier call); pass live arrays"
            )
        shape, dtype = tuple(getattr(h, "shape", ())), np.dtype(getattr(h, "dtype", object))
        if len(shape) != len(layout.shape) or shape[1:] != layout.block_shape:
            raise LayoutMismatchError(
                f"{name}[{i}] has shape {shape}; blocks have shape {layout.block_shape}"
            )
        if dtype != layout.np_dtype:
            raise LayoutMismatchError(
                f"{name}[{i}] has dtype {dtype}; the caches have {layout.dtype}"
            )
        if shape[0] < count:
            raise InvalidInputError(
                f"{name}[{i}] has {shape[0]} rows, fewer than the {count} block ids"
            )
    rows = {int(h.shape[0]) for h in host_blocks}
    if len(rows) > 1:
        raise LayoutMismatchError(f"{name} have different row counts per layer: {rows}")
    return rows.pop()
