"""Block fingerprints: one 32-bit hash per whole block, whatever its sharding.

The hash of a block is `fmix32(sum_j w_j * c_j mod 2**32)` over its
little-endian 32-bit words `w_j` (C order, zero padded), with odd
position-dependent weights `c_j = (2*j + 1) * 0x9E3779B1` (`word_weight`). A
flipped bit changes the sum by an odd multiple of a power of two below
`2**32`, so it is always caught, and a moved word changes its weight. Sums add
across any split of a block: each device (or process) sums the words it holds
by their index in the whole block, and the parts add up to the same value.

Three places sum: `device_fingerprint` inside the jitted programs, numpy on
host rows (`host_fingerprint`), and numpy on the caches' own buffers or a
piece's units (`piece_weights`, used by `kvxfer._host_buffers` and
`kvxfer.pieces`). All use `word_weight` and `fmix32`, so all agree.
See docs/internals.md ("Gather, scatter and fingerprints") for the figures.
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

__all__ = ["compare_fingerprints", "device_fingerprint", "fmix32", "host_fingerprint",
           "piece_weights", "sums_words", "word_weight"]

_K = np.uint32(0x9E3779B1)
_MURMUR_C1 = np.uint32(0x85EBCA6B)
_MURMUR_C2 = np.uint32(0xC2B2AE35)


def word_weight(word):
    """The weight `(2*j + 1) * 0x9E3779B1 mod 2**32` of word `j` of a block.

    `word`: a uint32 numpy or JAX array of word indices; returns the same kind.
    """
    return (word * np.uint32(2) + np.uint32(1)) * _K


def fmix32(h):
    """MurmurHash3's 32-bit finalizer; a bijection, works on numpy and JAX uint32 arrays."""
    h = h ^ (h >> 16)
    h = h * _MURMUR_C1
    h = h ^ (h >> 13)
    h = h * _MURMUR_C2
    return h ^ (h >> 16)


def piece_weights(layout: CacheLayout, index: tuple[slice, ...], unit_axis: int | None = None
                  ) -> np.ndarray:
    """The weights of the 32-bit words of one piece of a block, in the piece's C order.

    **Arguments:**

    - `layout`: the caches' layout (the whole block's shape and dtype).
    - `index`: the piece, as one slice per block axis (a shard's index without axis 0).
    - `unit_axis`: when given, the piece is laid out with that block axis first
      (`kvxfer.pieces`' unit-major staging); the result is then
      `uint32[units, words per unit]`.

    **Returns:**

    `uint32[words]` (or `[units, words per unit]`). The piece's innermost run must be
    whole words; callers check.
    """
    return _piece_weights(layout, tuple((s.start, s.stop) for s in index), unit_axis)


@functools.lru_cache(maxsize=256)
def _piece_weights(layout: CacheLayout, key: tuple[tuple[int | None, int | None], ...],
                   unit_axis: int | None) -> np.ndarray:
    per_word = 4 // layout.np_dtype.itemsize
    flat = np.arange(math.prod(layout.block_shape), dtype=np.int64).reshape(layout.block_shape)
    piece = flat[tuple(slice(a, b) for a, b in key)]
    if unit_axis is not None:
        piece = np.moveaxis(piece, unit_axis, 0)
        first = piece.reshape(piece.shape[0], -1)[:, ::per_word]
    else:
        first = piece[..., ::per_word].reshape(-1)
    return word_weight((first // per_word).astype(np.uint32))


def sums_words(layout: CacheLayout, last: int) -> bool:
    """Whether a piece of a block whose last axis holds `last` elements is whole 32-bit
    words, so that its words are summed (else its elements, each at its byte offset)."""
    itemsize = layout.np_dtype.itemsize
    return (last * itemsize) % 4 == 0 and (layout.block_shape[-1] * itemsize) % 4 == 0


def host_fingerprint(layout: CacheLayout, rows: np.ndarray) -> np.ndarray:
    """`uint32[n]`: the fingerprints of whole blocks `rows`, `[n, *block_shape]`, with numpy."""
    n = rows.shape[0]
    data = np.ascontiguousarray(rows).view(np.uint8).reshape(n, -1)
    padded = np.zeros((n, cdiv(data.shape[1], 4) * 4), np.uint8)
    padded[:, : data.shape[1]] = data
    words = padded.view("<u4")
    weights = word_weight(np.arange(words.shape[1], dtype=np.uint32))
    return fmix32(np.sum(words * weights, axis=1, dtype=np.uint32))


def device_fingerprint(rows: jax.Array, layout: CacheLayout) -> jax.Array:
    """`uint32[n]`: the fingerprint of each whole block whose pieces this device holds.

    Inside `shard_map`: `rows` is `[n, *shard_block_shape]` of unsigned ints. Each
    device sums its words by their index in the whole block and a `psum` over the
    axes that split a block adds the parts. Where a device's rows of the last axis
    are whole words (the usual case) it sums words; otherwise it sums elements,
    each weighted by its word's weight shifted to its byte offset in the word,
    which is the same sum.
    """
    n, local = rows.shape[0], rows.shape[1:]
    itemsize = layout.np_dtype.itemsize
    per_word = 4 // itemsize
    aligned = sums_words(layout, local[-1])
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
        weights = word_weight(index // jnp.uint32(per_word))
    else:
        words = rows.reshape(n, -1).astype(jnp.uint32)
        byte = index * jnp.uint32(itemsize)
        weights = word_weight(byte >> 2) << ((byte & 3) * 8)
    partial = jnp.sum(words * weights[None], axis=1, dtype=jnp.uint32)
    if layout.shard_axes:
        partial = lax.psum(partial, layout.shard_axes)
    return fmix32(partial)


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
