"""Block fingerprints: three 32-bit words per whole block, whatever its sharding.

A block is read as little-endian 32-bit words `w_j` (C order, zero padded).
Its fingerprint is `fmix32` (a bijection) of each of three sums (`word_sums`):

- `P = XOR_j w_j`;
- `L = sum_j c_j * (w_j & 0xFFFF) mod 2**32` and `H = sum_j c_j * (w_j >> 16) mod 2**32`,
  with the odd weights `c_j = (4*j + 1) * 0x9E3779B1 mod 2**32` (`word_weight`).

What it guarantees, for two versions of a block of up to `2**15` words (128 KiB;
a larger block keeps the same guarantee for the pairs of words whose distance
is not a multiple of `2**15`):

- Every error that flips an odd number of bits in some bit column (bit `k` of
  every word) changes `P`: so every 1-bit and 3-bit error, and every 2-bit
  error whose bits are in different columns.
- Two flips in one column `k` of words `a != b` leave `P` unchanged and change
  the half-word sum of that column (`L` if `k < 16`, else `H`) by
  `2**(k % 16) * (+-c_a +- c_b)`. `c_a - c_b = 4 * K * (a - b)` has 2-adic
  valuation `2 + v(a - b)` and `c_a + c_b = K * (4 * (a + b) + 2)` valuation 1,
  so the change is 0 mod `2**32` only if `2**15` divides `a - b`.
- Swapping words `a != b` that hold `x != y` changes `L` by
  `(c_a - c_b) * dlo` and `H` by `(c_a - c_b) * dhi`, `dlo, dhi` the differences of
  their half-words (`|d| < 2**16`, not both 0): valuation at most
  `2 + v(a - b) + 15 < 32`, so it is caught.
- Corruption that leaves the block random (independent of what was sent) is
  missed with probability at most `2**-32`: `P` alone is uniform.

Tests that show it (cpu_tests/test_fingerprint.py): `test_every_1_2_and_3_bit_error_
in_a_small_block_is_caught`, `test_two_flips_in_one_high_column_of_a_128_kib_block_are_
caught`, `test_every_swap_of_two_different_words_in_a_small_block_is_caught`,
`test_swaps_of_high_bit_words_in_a_128_kib_block_are_caught`; and that every place that
computes it agrees (`test_partial_sums_of_any_split_combine_to_the_whole`, the sharded
agreement tests in test_gather.py, test_gather_in_place.py and test_pieces.py).

All three sums combine across any split of a block (`combine_sums`: `P` by XOR,
`L` and `H` by addition): each device, shard or piece sums the words it holds by
their index in the whole block. Three places sum: `device_fingerprint` inside the
jitted programs (`psum` for `L`, `H`; an all-gather and XOR for `P`), numpy on
host rows (`host_fingerprint`), and numpy on the caches' own buffers or a piece's
units (`piece_weights` and `word_sums`, used by `kvxfer.device._numpy` and
`kvxfer.device.pieces`). A piece that is not whole words (an odd number of bf16 on a
shard) is summed by element: each element's bits shifted to its byte offset in
its word, into `P` and into the half-word sum its bytes fall in.
See docs/internals.md ("Gather, scatter and fingerprints") for the figures.
"""

from __future__ import annotations

import ctypes
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvxfer.device.layout import CacheLayout
from kvxfer.errors import CorruptionError, InvalidInputError
from kvxfer.plan.blocks import cdiv

__all__ = ["COMPILED", "SUMS", "combine_sums", "compare_fingerprints", "device_fingerprint", "fmix32",
           "host_fingerprint", "piece_weights", "reduce_sums", "sums_words", "word_sums",
           "word_weight"]

SUMS = 3
"""Words per fingerprint: `(P, L, H)`, the last axis of every fingerprint array."""

_K = np.uint32(0x9E3779B1)
_MURMUR_C1 = np.uint32(0x85EBCA6B)
_MURMUR_C2 = np.uint32(0xC2B2AE35)
_16 = np.uint32(16)


def word_weight(word):
    """The weight `(4*j + 1) * 0x9E3779B1 mod 2**32` of word `j` of a block.

    `word`: a uint32 numpy or JAX array of word indices; returns the same kind.
    """
    return (word * np.uint32(4) + np.uint32(1)) * _K


def fmix32(h):
    """MurmurHash3's 32-bit finalizer; a bijection, works on numpy and JAX uint32 arrays."""
    h = h ^ (h >> 16)
    h = h * _MURMUR_C1
    h = h ^ (h >> 13)
    h = h * _MURMUR_C2
    return h ^ (h >> 16)


def word_sums(words: np.ndarray, weights: np.ndarray, subscripts: str = "ij,j->i",
              out: np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
    """The partial sums `(P, L, H)` of runs of words: `uint32[..., 3]`.

    `words` (uint32) and `weights` (their `word_weight`s) are contracted over their
    last axis as `np.einsum(subscripts, ...)` contracts them: `"ij,j->i"` (rows of
    one piece's words against the piece's weights) or `"suj,uj->su"` (slots of
    units, each unit against its own weights). `rows`, when given, picks rows of
    `words`' first axis (as `words[rows]`, without copying them). `out`, when
    given, is the `uint32[..., 3]` result written in place.

    One pass over the words in C (`kvxfer/device/_sums.c`) where that module was built and
    the arrays are aligned runs of uint32; numpy otherwise (three passes, the
    same values).
    """
    if subscripts not in _LEAD:
        raise InvalidInputError(f"word_sums sums {sorted(_LEAD)}, not {subscripts!r}")
    lead = words.shape[: _LEAD[subscripts]] if rows is None else (len(rows), *words.shape[1:-1])
    if out is None:
        out = np.empty((*lead, SUMS), np.uint32)
    if _KERNEL is None or not _compiled_sums(words, weights, subscripts, out, rows):
        _numpy_sums(words if rows is None else words[rows], weights, subscripts, out)
    return out


_LEAD = {"ij,j->i": 1, "suj,uj->su": 2}  # the subscripts word_sums takes: leading axes of out


def _numpy_sums(words: np.ndarray, weights: np.ndarray, subscripts: str, out: np.ndarray) -> None:
    a = np.einsum(subscripts, words, weights)  # sum c_j w_j = L + 2**16 H
    high = np.einsum(subscripts, words >> _16, weights)
    np.bitwise_xor.reduce(words, axis=-1, out=out[..., 0])
    np.subtract(a, high << _16, out=out[..., 1])
    out[..., 2] = high


def _load_kernel():
    """`kvxfer_word_sums` from the built `kvxfer.device._sums`, or None where it was not built."""
    try:
        from kvxfer.device import _sums
    except ImportError:
        return None
    kernel = ctypes.CDLL(_sums.__file__).kvxfer_word_sums  # ctypes releases the GIL in the call
    size, ssize, ptr = ctypes.c_size_t, ctypes.c_ssize_t, ctypes.c_void_p
    kernel.argtypes = [ptr, ptr, ssize, ssize, size, size, ptr, ssize, size, ptr, ssize, ssize]
    kernel.restype = None
    return kernel


_KERNEL = _load_kernel()
COMPILED = _KERNEL is not None
"""Whether `word_sums` sums in one compiled pass (`kvxfer.device._sums` was built at install)."""


def _compiled_sums(words: np.ndarray, weights: np.ndarray, subscripts: str, out: np.ndarray,
                   rows: np.ndarray | None) -> bool:
    """Sum with the C kernel, where the arrays suit it; False (nothing written) otherwise."""
    if subscripts == "ij,j->i":
        words, weights, out = words[:, None], weights[None], out[:, None]
    arrays = (words, weights, out)
    if (any(a.dtype != np.uint32 or not a.flags.aligned or a.strides[-1] != 4 for a in arrays)
            or words.ndim != 3 or weights.shape != words.shape[1:] or out.shape[-1] != SUMS
            or out.shape[1] != words.shape[1] or any(s % 4 for a in arrays for s in a.strides)):
        return False
    if rows is None:
        num_s, row_ptr = words.shape[0], None
    else:
        rows = np.ascontiguousarray(rows, np.int64)
        if len(rows) and (rows.min() < -words.shape[0] or rows.max() >= words.shape[0]):
            return False  # numpy's indexing names the bad row
        rows = np.where(rows < 0, rows + words.shape[0], rows)
        num_s, row_ptr = len(rows), rows.ctypes.data
    if out.shape[0] != num_s:
        return False
    step = [s // 4 for a in arrays for s in a.strides[:-1]]
    if num_s and words.shape[1] and words.shape[2]:
        _KERNEL(words.ctypes.data, row_ptr, step[0], step[1], num_s, words.shape[1],
                weights.ctypes.data, 0 if weights.shape[0] == 1 else step[2], words.shape[2],
                out.ctypes.data, step[3], step[4])
    elif num_s and words.shape[1]:
        out[...] = 0
    return True


def combine_sums(total: np.ndarray, part: np.ndarray) -> None:
    """Add partial sums `part` into `total` in place (both `uint32[..., 3]`): `P` by XOR,
    `L` and `H` mod `2**32`."""
    total[..., 0] ^= part[..., 0]
    total[..., 1:] += part[..., 1:]


def reduce_sums(parts: np.ndarray, axis: int) -> np.ndarray:
    """`parts` (`uint32[..., 3]`) combined along `axis` (not the last)."""
    out = np.add.reduce(parts, axis=axis, dtype=np.uint32)
    out[..., 0] = np.bitwise_xor.reduce(parts[..., 0], axis=axis)
    return out


def piece_weights(layout: CacheLayout, index: tuple[slice, ...], unit_axis: int | None = None
                  ) -> np.ndarray:
    """The weights of the 32-bit words of one piece of a block, in the piece's C order.

    **Arguments:**

    - `layout`: the caches' layout (the whole block's shape and dtype).
    - `index`: the piece, as one slice per block axis (a shard's index without axis 0).
    - `unit_axis`: when given, the piece is laid out with that block axis first
      (`kvxfer.device.pieces`' unit-major staging); the result is then
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
    return np.ascontiguousarray(word_weight((first // per_word).astype(np.uint32)))


def sums_words(layout: CacheLayout, last: int) -> bool:
    """Whether a piece of a block whose last axis holds `last` elements is whole 32-bit
    words, so that its words are summed (else its elements, each at its byte offset)."""
    itemsize = layout.np_dtype.itemsize
    return (last * itemsize) % 4 == 0 and (layout.block_shape[-1] * itemsize) % 4 == 0


def host_fingerprint(layout: CacheLayout, rows: np.ndarray) -> np.ndarray:
    """`uint32[n, 3]`: the fingerprints of whole blocks `rows`, `[n, *block_shape]`, with numpy."""
    n = rows.shape[0]
    data = np.ascontiguousarray(rows).view(np.uint8).reshape(n, -1)
    if data.shape[1] % 4:
        padded = np.zeros((n, cdiv(data.shape[1], 4) * 4), np.uint8)
        padded[:, : data.shape[1]] = data
        data = padded
    words = data.view("<u4")
    return fmix32(word_sums(words, word_weight(np.arange(words.shape[1], dtype=np.uint32))))


def device_fingerprint(rows: jax.Array, layout: CacheLayout) -> jax.Array:
    """`uint32[n, 3]`: the fingerprint of each whole block whose pieces this device holds.

    Inside `shard_map`: `rows` is `[n, *shard_block_shape]` of unsigned ints. Each
    device sums its words by their index in the whole block; a `psum` over the
    axes that split a block adds the parts of `L` and `H`, and an all-gather the
    parts of `P`, XORed. Where a device's rows of the last axis are whole words
    (the usual case) it sums words; otherwise it sums elements, each shifted to
    its byte offset in its word, which gives the same sums.
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
        low, high = words & jnp.uint32(0xFFFF), words >> _16
        w_low = w_high = weights[None]
    else:  # each element lies in one half of its word: weight it there, zero in the other
        words = rows.reshape(n, -1).astype(jnp.uint32)
        byte = index * jnp.uint32(itemsize)
        shift = (byte & jnp.uint32(3)) * jnp.uint32(8)
        weights = word_weight(byte >> 2)
        in_high = shift >= _16
        w_low = jnp.where(in_high, jnp.uint32(0), weights << shift)[None]
        w_high = jnp.where(in_high, weights << (shift - _16), jnp.uint32(0))[None]
        low = high = words
        words = words << shift[None]
    p = lax.reduce(words, np.uint32(0), lax.bitwise_xor, (1,))
    lh = jnp.stack([jnp.sum(low * w_low, axis=1, dtype=jnp.uint32),
                    jnp.sum(high * w_high, axis=1, dtype=jnp.uint32)], axis=1)
    if layout.shard_axes:
        lh = lax.psum(lh, layout.shard_axes)
        parts = lax.all_gather(p, layout.shard_axes)  # lax has no XOR all-reduce
        p = lax.reduce(parts.reshape(-1, n), np.uint32(0), lax.bitwise_xor, (0,))
    return fmix32(jnp.concatenate([p[:, None], lh], axis=1))


def compare_fingerprints(got: np.ndarray, expected: np.ndarray) -> None:
    """Raise `CorruptionError` at the first block where two fingerprint arrays differ.

    Both are `uint32[num_layers, n, 3]` (`fingerprint_blocks` of what arrived, and
    what the sender computed); the error names the layer and block row.
    """
    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape or got.ndim != 3 or got.shape[2] != SUMS:
        raise InvalidInputError(
            f"fingerprints of shape {got.shape} cannot be checked against {expected.shape}")
    bad = np.argwhere((got != expected).any(axis=2))
    if len(bad):
        layer, row = (int(v) for v in bad[0])
        raise CorruptionError(
            f"block fingerprint mismatch at layer {layer}, block row {row}: received "
            f"{_hex(got[layer, row])}, sender computed {_hex(expected[layer, row])} "
            f"({len(bad)} mismatching blocks in all)"
        )


def _hex(words: np.ndarray) -> str:
    return "/".join(f"{int(w):08x}" for w in words)
