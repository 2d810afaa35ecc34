"""Block fingerprints: the hash of a whole block, on device and on host.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvxfer.blocks import cdiv
from kvxfer.errors import CorruptionError, InvalidInputError
from kvxfer.layout import CacheLayout

_K = np.uint32(0x9E3779B1)


_MURMUR_C1 = np.uint32(0x85EBCA6B)


_MURMUR_C2 = np.uint32(0xC2B2AE35)


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
