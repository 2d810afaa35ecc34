"""Gather KV blocks from device caches into pinned host arrays, and scatter them back.

    host = gather_blocks(caches, block_ids)
    caches = scatter_blocks(caches, host, block_ids)

Both are pure functions over `list[jax.Array]` (one array per layer, blocks on
axis 0) and issue one jitted dispatch for all layers. Block ids are kernel
block ids; their count is padded to a power-of-two bucket (at least
`MIN_BUCKET`) and the ids go in as a device array, so after one call per
bucket no new block count compiles again. Jitted builders are cached on the
static `CacheLayout`, the mesh and the bucket.

Blocks are moved as unsigned integers of the element's width (a bitcast, free
on device), so bf16 and fp8 NaN payloads round-trip bit for bit and nothing
depends on the element type or on what the inner axes mean.

Sharding: both run per shard under `shard_map`. Gathered blocks keep the
caches' sharding on the inner axes and have the block axis unsharded. With an
unsharded block axis (mesh `(1, 8)`, `P(None, None, 'model')`) there is no
cross-device traffic. Where the block axis is sharded (over `'data'`, each
shard a contiguous range of blocks), each shard takes the requested blocks it
holds, zeros the rest, and a `psum` over the block axes assembles the rows, so
the gathered rows are replicated over those axes; a scatter writes on each
shard only the blocks it holds, with no collective.

Fingerprints (`gather_blocks(..., fingerprints=True)`) are 32-bit hashes of
each block's piece on each shard, computed on device from the gathered rows in
the same dispatch. `block_fingerprints` computes the same values with numpy
from host bytes alone, and `check_fingerprints` raises `CorruptionError` at
the first mismatch. The hash is `fmix32(sum_i w_i * c_i mod 2**32)` over the
piece's little-endian 32-bit words `w_i` (zero padded), with odd
position-dependent constants `c_i = (2*i + 1) * 0x9E3779B1`: a single flipped
bit changes the sum by an odd multiple of a power of two below `2**32`, so it
is always caught, and moving a word changes its weight. The fingerprint is a
second pass over the gathered bytes: on the CPU backend it costs about as much
as the gather itself; on TPU it runs at HBM bandwidth, far above D2H.

Not implemented: on TPU, tpu-inference writes gathered blocks in place into a
preallocated pinned-host pool with a Pallas DMA kernel (`pltpu.async_copy`
into `pl.HOST` memory), which saves the per-call host mapping cost. That path
can only be tested on a TPU, so it is left out rather than shipped untested;
here every gather allocates its pinned-host output. `tpu_tests/` measures the
plain path on TPU.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
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
    - `fingerprints`: `uint32[num_layers, bucket, num_shards]` in pinned host memory.
    """

    blocks: list[jax.Array]
    fingerprints: jax.Array


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
    - `fingerprints`: also return per-block, per-shard fingerprints.

    **Returns:**

    Per layer, a `[bucket_size(n), *block_shape]` array with memory kind
    `"pinned_host"`, on the caches' mesh with their `PartitionSpec` on the inner axes
    and axis 0 unsharded. Rows `0..n-1` are the requested blocks in order; later rows
    are bucket padding (copies of the last requested block). With
    `fingerprints=True`, a `GatheredBlocks(blocks, fingerprints)` instead.

    Raises `InvalidInputError` (or its subclass `LayoutMismatchError`) naming the
    offending value before anything is dispatched.
    """
    layout = CacheLayout.from_caches(caches)
    ids = _check_block_ids(block_ids, layout)
    bucket = bucket_size(len(ids))
    padded = np.empty(bucket, np.int32)
    padded[: len(ids)] = ids
    padded[len(ids):] = ids[-1] if len(ids) else 0
    mesh = caches[0].sharding.mesh
    fn = _gather_fn(layout, mesh, fingerprints)
    out = fn(list(caches), jax.device_put(padded, NamedSharding(mesh, PartitionSpec())))
    if fingerprints:
        return GatheredBlocks(*out)
    return out


def scatter_blocks(
    caches: Sequence[jax.Array],
    host_blocks: Sequence[jax.Array | np.ndarray],
    block_ids: Sequence[int] | np.ndarray | jax.Array,
) -> list[jax.Array]:
    """Write blocks into the caches, in one dispatch; the input caches are donated.

    **Arguments:**

    - `caches`: one array per layer, `[num_blocks, *block_shape]`, as for
      `gather_blocks`. Donated: do not use them after the call.
    - `host_blocks`: one array per layer, `[rows, *block_shape]` with `rows >= n`, of
      the caches' dtype (a `gather_blocks` result, or numpy arrays). Rows past `n` are
      ignored.
    - `block_ids`: 1-D integer kernel block ids, `[n]`, distinct, each in
      `[0, num_blocks)`. Row `i` of each layer goes to block `block_ids[i]`.

    **Returns:**

    The new caches, same shapes and shardings, with those blocks replaced and every
    other block unchanged.

    Raises `InvalidInputError` (or `LayoutMismatchError`) naming the offending value
    before anything is dispatched.
    """
    layout = CacheLayout.from_caches(caches)
    ids = _check_block_ids(block_ids, layout)
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise InvalidInputError(
            f"block_ids to scatter must be distinct; repeated: {uniq[counts > 1].tolist()}"
        )
    _check_host_blocks(host_blocks, layout, len(ids))
    if len(ids) == 0:
        return list(caches)
    mesh = caches[0].sharding.mesh
    bucket = bucket_size(len(ids))
    # Padding ids point past the last block; mode="drop" discards those rows.
    padded = np.full(bucket, layout.num_blocks, np.int32)
    padded[: len(ids)] = ids
    host_sharding = NamedSharding(mesh, layout.host_partition_spec(), memory_kind="pinned_host")
    rows = [_as_bucket_rows(h, bucket, len(ids), host_sharding) for h in host_blocks]
    fn = _scatter_fn(layout, mesh)
    return fn(list(caches), rows, jax.device_put(padded, NamedSharding(mesh, PartitionSpec())))


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

    `uint32[num_layers, count, num_shards]`.
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
    - `expected`: `uint32[num_layers, rows', num_shards]`, `rows' >= count`, the
      fingerprints `gather_blocks` returned at the source.

    The error names the first mismatching layer, block row and shard.
    """
    count = _check_count(count)
    expected = np.asarray(expected)
    want = (layout.num_layers, count, layout.num_shards)
    if (expected.ndim != 3 or expected.shape[0] != want[0] or expected.shape[1] < count
            or expected.shape[2] != want[2]):
        raise InvalidInputError(
            f"expected fingerprints have shape {expected.shape}; need "
            f"[{want[0]}, >= {count}, {want[2]}]"
        )
    got = block_fingerprints(layout, host_blocks, count)
    bad = np.argwhere(got != expected[:, :count])
    if len(bad):
        layer, row, shard = (int(v) for v in bad[0])
        raise CorruptionError(
            f"block fingerprint mismatch at layer {layer}, block row {row}, shard {shard}: "
            f"received {got[layer, row, shard]:#010x}, sender computed "
            f"{int(expected[layer, row, shard]):#010x} ({len(bad)} mismatching pieces in all)"
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


def _check_count(count: object) -> int:
    """`count` as an int: it must be a non-negative integer (numpy ones too), not a bool."""
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
        raise InvalidInputError(f"count must be a non-negative int, got {count!r}")
    return int(count)


def _check_host_blocks(host_blocks: object, layout: CacheLayout, count: int) -> None:
    if isinstance(host_blocks, (jax.Array, np.ndarray)) or not isinstance(host_blocks, Sequence):
        raise InvalidInputError(
            f"host_blocks must be a list of per-layer arrays, got {type(host_blocks).__name__}"
        )
    if len(host_blocks) != layout.num_layers:
        raise LayoutMismatchError(
            f"host_blocks has {len(host_blocks)} layers; the caches have {layout.num_layers}"
        )
    for i, h in enumerate(host_blocks):
        if isinstance(h, jax.Array) and h.is_deleted():
            raise InvalidInputError(
                f"host_blocks[{i}] was deleted (donated to an earlier call); pass live arrays"
            )
        shape, dtype = tuple(getattr(h, "shape", ())), np.dtype(getattr(h, "dtype", object))
        if len(shape) != len(layout.shape) or shape[1:] != layout.block_shape:
            raise LayoutMismatchError(
                f"host_blocks[{i}] has shape {shape}; blocks have shape {layout.block_shape}"
            )
        if dtype != layout.np_dtype:
            raise LayoutMismatchError(
                f"host_blocks[{i}] has dtype {dtype}; the caches have {layout.dtype}"
            )
        if shape[0] < count:
            raise InvalidInputError(
                f"host_blocks[{i}] has {shape[0]} rows, fewer than the {count} block ids"
            )


def _as_bucket_rows(
    h: jax.Array | np.ndarray, bucket: int, count: int, sharding: NamedSharding
) -> jax.Array:
    """`h` as exactly `bucket` rows in pinned host memory, so the scatter never recompiles."""
    if isinstance(h, jax.Array) and h.shape[0] == bucket and h.sharding == sharding:
        return h
    rows = np.asarray(h)
    if rows.shape[0] >= bucket:  # rows past `count` are dropped by the scatter: no copy to pad
        return jax.device_put(rows[:bucket], sharding)
    padded = np.zeros((bucket, *rows.shape[1:]), rows.dtype)
    padded[:count] = rows[:count]
    return jax.device_put(padded, sharding)


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
    shard_axes = layout.shard_axes or None
    cache_spec, host_spec = layout.partition_spec(), layout.host_partition_spec()
    fp_spec = PartitionSpec(None, None, shard_axes)

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
        return blocks, jnp.stack([_device_fingerprint(r) for r in rows])[:, :, None]

    out_specs: object = [host_spec] * layout.num_layers
    host = NamedSharding(mesh, host_spec, memory_kind="pinned_host")
    out_shardings: object = [host] * layout.num_layers
    if fingerprints:
        out_specs = (out_specs, fp_spec)
        out_shardings = (out_shardings, NamedSharding(mesh, fp_spec, memory_kind="pinned_host"))
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
            ids = jnp.where(inside, ids, num_local)  # another shard's block: dropped here
        out = []
        for cache, row in zip(caches, rows):
            row = lax.bitcast_convert_type(row, udtype)
            new = lax.bitcast_convert_type(cache, udtype).at[ids].set(row, mode="drop")
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


def _device_fingerprint(piece: jax.Array) -> jax.Array:
    """`uint32[n]`: the hash of each row of `piece`, `[n, ...]` of unsigned ints."""
    n = piece.shape[0]
    flat = piece.reshape(n, -1)
    per_word = 4 // piece.dtype.itemsize
    if flat.shape[1] % per_word:
        pad = per_word - flat.shape[1] % per_word
        flat = jnp.concatenate([flat, jnp.zeros((n, pad), flat.dtype)], axis=1)
    if per_word > 1:
        words = lax.bitcast_convert_type(flat.reshape(n, -1, per_word), jnp.uint32)
    else:
        words = flat.astype(jnp.uint32)
    i = lax.iota(jnp.uint32, words.shape[1])
    weights = (i * jnp.uint32(2) + jnp.uint32(1)) * _K
    return _fmix32(jnp.sum(words * weights, axis=1, dtype=jnp.uint32))


def _host_fingerprint(layout: CacheLayout, rows: np.ndarray) -> np.ndarray:
    """`uint32[n, num_shards]` for `rows`, `[n, *block_shape]`, with numpy."""
    n = rows.shape[0]
    data = np.ascontiguousarray(rows).view(_uint(layout.np_dtype))
    # Cut each block into the shard grid: axis k of size d becomes (g, d // g), then
    # all the g axes go first so a piece is contiguous in C order, as on its device.
    split: list[int] = [n]
    for d, g in zip(layout.block_shape, layout.shard_grid):
        split += [g, d // g]
    k = len(layout.block_shape)
    order = [0] + [1 + 2 * a for a in range(k)] + [2 + 2 * a for a in range(k)]
    pieces = data.reshape(split).transpose(order).reshape(n, layout.num_shards, -1)
    nbytes = pieces.shape[2] * pieces.itemsize
    raw = np.zeros((n, layout.num_shards, cdiv(nbytes, 4) * 4), np.uint8)
    raw[..., :nbytes] = np.ascontiguousarray(pieces).view(np.uint8).reshape(n, layout.num_shards, nbytes)
    words = raw.view("<u4")
    i = np.arange(words.shape[2], dtype=np.uint32)
    weights = (i * np.uint32(2) + np.uint32(1)) * _K
    return _fmix32(np.sum(words * weights, axis=2, dtype=np.uint32))


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer; a bijection, works on numpy and jax uint32 arrays."""
    h = h ^ (h >> 16)
    h = h * _MURMUR_C1
    h = h ^ (h >> 13)
    h = h * _MURMUR_C2
    return h ^ (h >> 16)
