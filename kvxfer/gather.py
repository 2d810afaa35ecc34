"""Gather KV blocks from device caches into host memory, and scatter them back.

    host = gather_blocks(caches, block_ids)
    prints = gather_into(caches, block_ids, staging_regions, slots)
    caches = scatter_blocks(caches, host, block_ids)               # or rows=slots
    caches, prints = scatter_blocks(caches, host, block_ids, fingerprints=True)
    prints = fingerprint_blocks(caches, block_ids)

All take `list[jax.Array]` (one array per layer, blocks on axis 0) and do all
layers in one jitted dispatch. Block ids are kernel block ids; their count is
padded to a power-of-two bucket (at least `MIN_BUCKET`) and the ids go in as a
device array, so after one call per bucket no new block count compiles again.
Jitted builders are cached on the static `CacheLayout`, the mesh and the bucket.

Blocks are moved as unsigned integers of the element's width (a bitcast, free
on device), so bf16 and fp8 NaN payloads round-trip bit for bit and nothing
depends on the element type or on what the inner axes mean.

Sharding: everything runs per shard under `shard_map`. Gathered blocks keep the
caches' sharding on the inner axes and have the block axis unsharded. With an
unsharded block axis (mesh `(1, 8)`, `P(None, None, 'model')`) there is no
cross-device traffic. Where the block axis is sharded (over `'data'`, each
shard a contiguous range of blocks), each shard takes the requested blocks it
holds, zeros the rest, and a `psum` over the block axes assembles the rows; a
scatter writes on each shard only the blocks it holds, with no collective.

In place. `scatter_blocks` costs what its `n` blocks cost, whatever the size of
the caches, and never holds a second copy of them:

- On XLA:CPU a scatter into a donated bf16 or fp8 buffer is done as a full copy
  of the buffer (the type is widened; a bitcast to uint16 is itself a copy;
  `dynamic_update_slice` with a runtime index is no better): 64 blocks took 9 ms
  into 256-block caches and 148 ms into 4,096-block ones. There the caches are
  donated to an identity (which waits for every pending use of the buffers and
  hands them over without a copy) and the blocks are copied with numpy into the
  very buffers the returned caches own: the buffer pointers do not change.
- Elsewhere (TPU, GPU) it is an XLA scatter with unique indices (bucket padding
  goes to distinct ids past the end, dropped) into the donated caches, which
  the compiled program aliases to its outputs. A Pallas kernel, as
  tpu-inference uses for its KV updates, is not written: it can only be tested
  on a TPU.

Copies run in destination order, as slices wherever rows run together in
either direction: a table allocated from a free list that hands blocks out in
descending order (vLLM frees a request's blocks tail first) copies in runs too.

P's side, `gather_into`, copies blocks straight into existing host arrays (the
registered staging NIXL reads): on XLA:CPU with numpy from the caches' own
buffers, one copy in all; elsewhere a `gather_blocks` into pinned host memory,
then one host copy of each shard's piece into staging. Registering each step's
gather output with NIXL instead would save that copy but cost a registration
per step; on TPU, tpu-inference writes gathered blocks straight into a
preallocated pinned-host pool with a Pallas DMA (`pltpu.async_copy` into
`pl.HOST` memory). Neither is measurable without a TPU, so neither is shipped.

Fingerprints are 32-bit hashes of whole blocks, independent of how the caches
are sharded, so P (TP 4) and D (TP 8) compute the same values on their own
devices. The hash is `fmix32(sum_j w_j * c_j mod 2**32)` over the block's
little-endian 32-bit words `w_j` (C order, zero padded), with odd
position-dependent constants `c_j = (2*j + 1) * 0x9E3779B1`: a single flipped
bit changes the sum by an odd multiple of a power of two below `2**32`, so it is
always caught, and moving a word changes its weight. Each device sums the words
it holds (by their index in the whole block) and a `psum` over the axes that
split a block adds the parts. `gather_blocks(..., fingerprints=True)` and
`gather_into` fingerprint on P in the same pass; `scatter_blocks(...,
fingerprints=True)` is D's check of the blocks as they landed, and
`fingerprint_blocks` the same check on its own; `block_fingerprints` computes
the same values with numpy from host bytes, and `check_fingerprints` raises
`CorruptionError` at the first mismatch.

Where fingerprints are summed. On a TPU or GPU, in the jitted programs, on
device. On XLA:CPU, where each shard's piece of a block is whole 32-bit words
(bf16, fp8 and int8 caches with the usual shapes), `np.einsum` sums each
piece's words straight from the shard's buffer against their weights, right
after the copy that read or wrote them (while they are in the processor's
cache): measured on 2 cores, 64 MiB hashed in 3.2 ms from the buffers (21
GB/s; about 2.6 ms more than the scatter alone when fused with it), against
19 ms for the XLA:CPU program (3.5 GB/s: it materializes the gathered rows,
and XLA:CPU's integer reductions run at a fraction of memory speed). Pieces
that are not whole words go to the XLA program.

Threads. On XLA:CPU each shard's copy (and its hash, by the same thread right
after) is one task, run on `host_threads()` threads (`KVXFER_HOST_THREADS`,
else this process's cores, at most 8): numpy's copies and `einsum` release the
GIL. Scattering 128 blocks into 8 layers of a TP 8 cache with fingerprints took
10.2 ms on one thread and 7.8 ms on two (5.9 ms without fingerprints, 7.1 on
one): the hash, which runs at about 30 GB/s a core and is not memory bound,
gains most.
"""

from __future__ import annotations

import ctypes
import functools
import math
import numbers
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvxfer.blocks import cdiv
from kvxfer.errors import CorruptionError, InvalidInputError, LayoutMismatchError
from kvxfer.layout import CacheLayout

MIN_BUCKET = 8
"""The smallest padded block count; counts up to it share one compiled program."""

_K = np.uint32(0x9E3779B1)
_MURMUR_C1 = np.uint32(0x85EBCA6B)
_MURMUR_C2 = np.uint32(0xC2B2AE35)


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


def bucket_size(count: int) -> int:
    """The padded row count for `count` blocks: the next power of two, at least `MIN_BUCKET`."""
    if count < 0:
        raise InvalidInputError(f"block count must be non-negative, got {count}")
    return max(MIN_BUCKET, 1 << max(count - 1, 0).bit_length())


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


def compare_fingerprints(got: np.ndarray, expected: np.ndarray) -> None:
    """Raise `CorruptionError` at the first block where two fingerprint arrays differ.

    Both are `uint32[num_layers, n]` (`fingerprint_blocks` of what arrived, and
    what the sender computed); the error names the layer and block row.
    """
    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape:
        raise InvalidInputError(
            f"fingerprints of shape {got.shape} cannot be checked against {expected.shape}")
    bad = np.argwhere(got != expected)
    if len(bad):
        layer, row = (int(v) for v in bad[0])
        raise CorruptionError(
            f"block fingerprint mismatch at layer {layer}, block row {row}: received "
            f"{int(got[layer, row]):#010x}, sender computed {int(expected[layer, row]):#010x} "
            f"({len(bad)} mismatching blocks in all)"
        )


# Input checks.


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


def _bucket_ids(ids: np.ndarray, mesh: Mesh) -> jax.Array:
    """`ids` padded to their bucket with copies of the last (any valid id), on the mesh."""
    padded = np.full(bucket_size(len(ids)), ids[-1] if len(ids) else 0, np.int32)
    padded[: len(ids)] = ids
    return jax.device_put(padded, NamedSharding(mesh, PartitionSpec()))


def _bucket_rows(
    h: jax.Array | np.ndarray, src: np.ndarray, bucket: int, sharding: NamedSharding
) -> jax.Array:
    """Rows `src` of `h` as exactly `bucket` rows in pinned host memory (no recompiles)."""
    if (isinstance(h, jax.Array) and h.shape[0] == bucket and h.sharding == sharding
            and np.array_equal(src, np.arange(len(src)))):
        return h
    padded = np.zeros((bucket, *h.shape[1:]), h.dtype)
    np.take(np.asarray(h), src, axis=0, out=padded[: len(src)])
    return jax.device_put(padded, sharding)


# Host copies on several threads (XLA:CPU).
#
# One task per shard: its rows are copied, then hashed by the same thread while
# they are in its core's cache, as other threads copy other shards. numpy's
# copies and `einsum` release the GIL. Tasks touch disjoint buffers and rows;
# `_BufferHashes` adds each task's sums under a lock.


_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def host_threads() -> int:
    """Threads for host copies: `KVXFER_HOST_THREADS`, else this process's cores, at most 8."""
    raw = os.environ.get("KVXFER_HOST_THREADS")
    if raw is not None:
        if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
            raise InvalidInputError(f"KVXFER_HOST_THREADS must be a positive int, got {raw!r}")
        return int(raw)
    return max(1, min(8, len(os.sched_getaffinity(0))))


def run_per_shard(tasks: Sequence[Callable[[], object]], threads: int | None = None) -> None:
    """Run independent per-shard tasks on `threads` host-copy threads (`host_threads()` by
    default) and wait for all of them; the first task's error is raised once every task
    has ended."""
    global _pool
    threads = host_threads() if threads is None else threads
    if threads == 1 or len(tasks) < 2 or getattr(_in_task, "on", False):
        for task in tasks:  # inline; also from inside a task, which would wait on itself
            task()
        return
    with _pool_lock:
        if _pool is None or _pool[0] != threads:
            _pool = (threads, ThreadPoolExecutor(threads, thread_name_prefix="kvxfer-copy"))
        pool = _pool[1]
    futures = [pool.submit(_as_task, task) for task in tasks]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


_in_task = threading.local()


def _as_task(task: Callable[[], object]) -> None:
    _in_task.on = True
    try:
        task()
    finally:
        _in_task.on = False


def _forget_pool() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # a forked child has none of the threads


os.register_at_fork(after_in_child=_forget_pool)


def _copy_then_hash(copies: _RowCopies, shard: jax.Shard, dst: np.ndarray, src: np.ndarray,
                    hashes: _BufferHashes | None, layer: int) -> None:
    copies.copy(shard, dst, src)
    if hashes is not None:  # the shard's buffer: rows just copied, while in this core's cache
        hashes.add(layer, shard, dst if copies.ids_are_dst else src)


# Writing in place where the caches are host memory (XLA:CPU).
#
# XLA:CPU does a scatter into a donated bf16 or fp8 buffer as a full copy of the
# buffer (it widens the type; a bitcast to uint16 is a copy too), so there the
# blocks are copied with numpy straight into the buffers the caches own.


def _writes_in_place(mesh: Mesh) -> bool:
    return all(d.platform == "cpu" for d in mesh.devices.flat)


def _buffer_view(array: jax.Array) -> np.ndarray:
    """A writable numpy view of a single-device CPU array's buffer (C order), no copy.

    The view does not keep `array` alive: the caller does.
    """
    nbytes = array.size * array.dtype.itemsize
    if nbytes == 0:
        return np.empty(array.shape, array.dtype)
    raw = (ctypes.c_char * nbytes).from_address(array.unsafe_buffer_pointer())
    return np.frombuffer(raw, dtype=array.dtype).reshape(array.shape)


class _RowCopies:
    """`dst[to[i]] = src[frm[i]]` for the blocks a shard holds, as slice copies where
    rows run together.

    `ids` are block ids (global), `rows` the matching host rows; `ids_are_dst` says
    which side the shard's buffer is. The rows each block range holds, and their
    runs, are worked out once per call and reused for every layer and inner piece.
    """

    def __init__(self, ids: np.ndarray, rows: np.ndarray, ids_are_dst: bool):
        self.ids, self.rows, self.ids_are_dst = ids, rows, ids_are_dst
        self._plans: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, list | None]] = {}

    def copy(self, shard: jax.Shard, dst: np.ndarray, src: np.ndarray) -> None:
        first, size = shard.index[0].start or 0, shard.data.shape[0]
        plan = self._plans.get((first, size))
        if plan is None:
            local = self.ids - first
            inside = (local >= 0) & (local < size)
            held, rows = local[inside], self.rows[inside]
            to, frm = (held, rows) if self.ids_are_dst else (rows, held)
            runs = _slice_runs(frm, to)
            plan = self._plans[(first, size)] = (to, frm, runs if 2 * len(runs) <= len(to)
                                                 else None)
        to, frm, runs = plan
        if not len(to):
            return
        if runs is not None:  # mostly contiguous: no temporary
            for s, d, n in runs:
                if n > 0:
                    dst[d : d + n] = src[s : s + n]
                else:
                    dst[d : d - n] = src[s + n + 1 : s + 1][::-1]
        else:
            dst[to] = src[frm]


def _slice_runs(frm: np.ndarray, to: np.ndarray) -> list[tuple[int, int, int]]:
    """`dst[to[i]] = src[frm[i]]` (`to` distinct) as runs `(s, d, n)`: `dst[d:d+|n|]`
    gets rows `s, s+1, ...` of `src` for `n > 0`, rows `s, s-1, ...` for `n < 0`.

    In destination order, so a table allocated from a free list that hands out
    blocks in descending order (vLLM frees a request's blocks tail first) still
    copies in runs.
    """
    order = np.argsort(to, kind="stable")
    runs: list[tuple[int, int, int]] = []
    for d, s in zip(to[order].tolist(), frm[order].tolist()):
        if runs:
            s0, d0, n = runs[-1]
            if d == d0 + abs(n):
                if s == s0 + n and n > 0:
                    runs[-1] = (s0, d0, n + 1)
                    continue
                if s == s0 - abs(n) and (n < 0 or n == 1):
                    runs[-1] = (s0, d0, -abs(n) - 1)
                    continue
        runs.append((s, d, 1))
    return runs


class _BufferHashes:
    """Fingerprints summed with numpy from the caches' own buffers (XLA:CPU).

    The same values as `_device_fingerprint`: each shard's piece of a block is
    a run of whole 32-bit words, and `np.einsum` sums them against the
    weights of their indices in the whole block, at about memory speed (an
    XLA:CPU reduction runs at a fraction of it and materializes the gathered
    rows). Replicas are skipped: `add` is given each `replica_id == 0` shard
    of each layer once, and the shards' sums add up as the device's `psum`
    does. Only for layouts whose pieces are whole words (`of` returns None
    otherwise).
    """

    _CHUNK = 64  # rows gathered at a time where ids do not run together

    def __init__(self, layout: CacheLayout, ids: np.ndarray):
        self.layout, self.ids = layout, ids
        self.sums = np.zeros((layout.num_layers, len(ids)), np.uint32)
        self._lock = threading.Lock()
        self._plans: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, list | None]] = {}

    @classmethod
    def of(cls, layout: CacheLayout, ids: np.ndarray) -> _BufferHashes | None:
        piece = layout.shard_block_shape[-1] * layout.np_dtype.itemsize
        whole = layout.block_shape[-1] * layout.np_dtype.itemsize
        return cls(layout, ids) if piece % 4 == 0 and whole % 4 == 0 else None

    def add(self, layer: int, shard: jax.Shard, view: np.ndarray) -> None:
        """Add the words `view` (the shard's buffer) holds of the blocks in `ids`."""
        first, size = shard.index[0].start or 0, view.shape[0]
        plan = self._plans.get((first, size))
        if plan is None:
            local = self.ids.astype(np.int64) - first
            at = np.flatnonzero((local >= 0) & (local < size))
            # In block order, whatever order the ids came in: rows that run together
            # in the buffer are summed as one slice.
            at = at[np.argsort(local[at], kind="stable")]
            held = local[at]
            starts = np.flatnonzero(np.diff(held, prepend=-2) != 1)
            runs = list(zip(starts.tolist(), np.diff(starts, append=len(held)).tolist()))
            plan = self._plans[(first, size)] = (held, at,
                                                 runs if 2 * len(runs) <= len(at) else None)
        held, at, runs = plan
        if not len(at):
            return
        words = view.reshape(size, -1).view(np.uint32)
        weights = _piece_weights(self.layout, _index_key(shard.index[1:]))
        got = np.empty(len(at), np.uint32)  # in `at`'s order
        if runs is not None:
            for i, n in runs:
                h = int(held[i])
                np.einsum("ij,j->i", words[h : h + n], weights, out=got[i : i + n])
        else:
            for c in range(0, len(at), self._CHUNK):
                part = slice(c, c + self._CHUNK)
                np.einsum("ij,j->i", words[held[part]], weights, out=got[part])
        with self._lock:  # shards of one layer are summed on several threads
            self.sums[layer, at] += got

    def result(self) -> np.ndarray:
        """`uint32[num_layers, n]`: the fingerprints."""
        return _fmix32(self.sums)


def _index_key(index: tuple[slice, ...]) -> tuple[tuple[int | None, int | None], ...]:
    return tuple((s.start, s.stop) for s in index)  # slices are not hashable before 3.12


@functools.lru_cache(maxsize=256)
def _piece_weights(layout: CacheLayout, key: tuple[tuple[int | None, int | None], ...]
                   ) -> np.ndarray:
    """The weight of each 32-bit word of one shard's piece of a block, in its buffer's order."""
    per_word = 4 // layout.np_dtype.itemsize
    flat = np.arange(math.prod(layout.block_shape), dtype=np.int64).reshape(layout.block_shape)
    first = flat[tuple(slice(a, b) for a, b in key)][..., ::per_word].reshape(-1)
    word = first // per_word
    return ((word * 2 + 1) * int(_K) % (1 << 32)).astype(np.uint32)


def _scatter_in_place(layout: CacheLayout, mesh: Mesh, caches: Sequence[jax.Array],
                      host_blocks: Sequence[jax.Array | np.ndarray], ids: np.ndarray,
                      src: np.ndarray, hashes: _BufferHashes | None = None) -> list[jax.Array]:
    # Donating to an identity waits for every pending use of the buffers and hands
    # them over without a copy; from then on nothing else reads or writes them.
    hosts = [np.asarray(h) for h in host_blocks]  # before donating: they may be the caches
    threads = host_threads()  # a bad setting is refused before the caches are donated
    new = _own_fn(layout, mesh)(list(caches))
    jax.block_until_ready(new)
    copies = _RowCopies(ids, src, ids_are_dst=True)
    tasks = []
    for layer, (cache, host) in enumerate(zip(new, hosts)):
        for shard in cache.addressable_shards:  # every replica: each has its own buffer
            view = _buffer_view(shard.data)
            tasks.append(functools.partial(
                _copy_then_hash, copies, shard, view, host[(slice(None), *shard.index[1:])],
                hashes if shard.replica_id == 0 else None, layer))
    run_per_shard(tasks, threads)
    return new


def _scatter_xla(layout: CacheLayout, mesh: Mesh, caches: Sequence[jax.Array],
                 host_blocks: Sequence[jax.Array | np.ndarray], ids: np.ndarray,
                 src: np.ndarray) -> list[jax.Array]:
    """An XLA scatter with unique indices into the donated caches (aliased in and out)."""
    bucket = bucket_size(len(ids))
    # Padding ids are distinct and past the last block: dropped, and indices stay unique.
    padded = (layout.num_blocks + np.arange(bucket)).astype(np.int32)
    padded[: len(ids)] = ids
    host_sharding = NamedSharding(mesh, layout.host_partition_spec(), memory_kind="pinned_host")
    rows = [_bucket_rows(h, src, bucket, host_sharding) for h in host_blocks]
    fn = _scatter_fn(layout, mesh)
    return fn(list(caches), rows, jax.device_put(padded, NamedSharding(mesh, PartitionSpec())))


# Jitted builders.


def _uint(dtype: np.dtype) -> np.dtype:
    if dtype.itemsize not in (1, 2, 4):
        raise InvalidInputError(f"dtype {dtype} of itemsize {dtype.itemsize} is not supported")
    return np.dtype(f"uint{8 * dtype.itemsize}")


@functools.lru_cache(maxsize=64)
def _gather_fn(layout: CacheLayout, mesh: Mesh, fingerprints: bool):
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
        return blocks, jnp.stack([_device_fingerprint(r, layout) for r in rows])

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
def _scatter_fn(layout: CacheLayout, mesh: Mesh):
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
def _own_fn(layout: CacheLayout, mesh: Mesh):
    sharding = NamedSharding(mesh, layout.partition_spec())
    return jax.jit(lambda caches: caches, out_shardings=[sharding] * layout.num_layers,
                   donate_argnums=0)


@functools.lru_cache(maxsize=64)
def _fingerprint_fn(layout: CacheLayout, mesh: Mesh):
    layout.check_mesh(mesh)
    udtype = _uint(layout.np_dtype)
    block_axes = layout.spec[0]

    def local(caches: list[jax.Array], ids: jax.Array) -> jax.Array:
        if block_axes:
            ids, inside = _local_ids(ids, caches[0].shape[0], block_axes)
        prints = []
        for cache in caches:
            h = _device_fingerprint(
                jnp.take(lax.bitcast_convert_type(cache, udtype), ids, axis=0), layout)
            if block_axes:
                h = lax.psum(jnp.where(inside, h, jnp.uint32(0)), block_axes)
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


# The fingerprint, on device and on host. Both must give identical values.


def _device_fingerprint(rows: jax.Array, layout: CacheLayout) -> jax.Array:
    """`uint32[n]`: the fingerprint of each whole block whose pieces this device holds.

    Inside `shard_map`: `rows` is `[n, *shard_block_shape]` of unsigned ints. The
    sum runs over the block's little-endian 32-bit words, each weighted by its index
    in the whole block, so the per-device sums add up (`psum` over the axes that
    split a block) to the same value however the block is sharded. Where a device's
    rows of the last axis are whole words (the usual case) it sums words; otherwise
    it sums elements, each weighted by its word's weight shifted to its byte offset
    in the word, which is the same sum.
    """
    n, local = rows.shape[0], rows.shape[1:]
    itemsize = layout.np_dtype.itemsize
    per_word = 4 // itemsize
    aligned = (local[-1] * itemsize) % 4 == 0 and (layout.block_shape[-1] * itemsize) % 4 == 0
    step = per_word if aligned else 1
    # The flat index, in the whole block, of each element this device sums (the
    # first element of each word when summing words).
    index = jnp.zeros((), jnp.uint32)
    stride = 1
    last = len(local) - 1
    for axis in reversed(range(len(local))):
        entry = layout.spec[1 + axis]
        part = lax.iota(jnp.uint32, local[axis] // step if axis == last else local[axis])
        if axis == last:
            part = part * jnp.uint32(step)
        if entry:
            part = part + lax.axis_index(entry).astype(jnp.uint32) * jnp.uint32(local[axis])
        shape = [1] * len(local)
        shape[axis] = part.shape[0]
        index = index + part.reshape(shape) * jnp.uint32(stride)
        stride *= layout.block_shape[axis]
    index = index.reshape(-1)
    if aligned:
        if per_word > 1:
            rows = lax.bitcast_convert_type(
                rows.reshape(n, *local[:-1], local[-1] // per_word, per_word), jnp.uint32)
        words = rows.reshape(n, -1)
        weights = (index // jnp.uint32(per_word) * jnp.uint32(2) + jnp.uint32(1)) * _K
    else:
        words = rows.reshape(n, -1).astype(jnp.uint32)
        byte = index * jnp.uint32(itemsize)
        weights = (((byte >> 2) * jnp.uint32(2) + jnp.uint32(1)) * _K) << ((byte & 3) * 8)
    partial = jnp.sum(words * weights[None], axis=1, dtype=jnp.uint32)
    if layout.shard_axes:
        partial = lax.psum(partial, layout.shard_axes)
    return _fmix32(partial)


def _host_fingerprint(layout: CacheLayout, rows: np.ndarray) -> np.ndarray:
    """`uint32[n]` for whole blocks `rows`, `[n, *block_shape]`, with numpy."""
    n = rows.shape[0]
    data = np.ascontiguousarray(rows).view(np.uint8).reshape(n, -1)
    padded = np.zeros((n, cdiv(data.shape[1], 4) * 4), np.uint8)
    padded[:, : data.shape[1]] = data
    words = padded.view("<u4")
    i = np.arange(words.shape[1], dtype=np.uint32)
    weights = (i * np.uint32(2) + np.uint32(1)) * _K
    return _fmix32(np.sum(words * weights, axis=1, dtype=np.uint32))


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer; a bijection, works on numpy and jax uint32 arrays."""
    h = h ^ (h >> 16)
    h = h * _MURMUR_C1
    h = h ^ (h >> 13)
    h = h * _MURMUR_C2
    return h ^ (h >> 16)
