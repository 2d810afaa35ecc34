"""The block fingerprint's guarantees (kvxfer.device.fingerprint), checked exhaustively where small.

Every test here fails on the former hash (one weighted word sum mod 2**32), which
missed two flips of bit 31 and swaps of words that differ only in their high bits.
"""

import itertools
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvxfer.device import fingerprint
from kvxfer.device.fingerprint import (
    combine_sums,
    fmix32,
    host_fingerprint,
    reduce_sums,
    word_sums,
    word_weight,
)
from kvxfer.device.layout import CacheLayout

BIG = 1 << 15  # words in a 128 KiB block, the size up to which every pair is covered


@pytest.fixture(scope="module")
def layout():
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    return CacheLayout.from_caches([jax.device_put(np.zeros((8, 8), np.uint32),
                                                   NamedSharding(mesh, P()))])


def _prints(layout, blocks: np.ndarray) -> np.ndarray:
    """`uint32[n, 3]` of `n` blocks of uint32 words, in batches that keep memory small."""
    step = max(1, (64 << 20) // blocks[0].nbytes)
    return np.concatenate([host_fingerprint(layout, blocks[i : i + step])
                           for i in range(0, len(blocks), step)])


def _caught(layout, base: np.ndarray, spoiled: np.ndarray) -> np.ndarray:
    """Per spoiled block, whether its fingerprint differs from `base`'s."""
    return (_prints(layout, spoiled) != _prints(layout, base[None])[0]).any(axis=1)


def _flipped(base: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """One copy of `base` per row of `bits` (`[n, k]` bit indices), those bits flipped."""
    out = np.repeat(base[None], len(bits), axis=0)
    rows = np.arange(len(bits))
    for column in bits.T:
        out[rows, column // 32] ^= np.uint32(1) << (column % 32).astype(np.uint32)
    return out


def test_every_1_2_and_3_bit_error_in_a_small_block_is_caught(layout):
    base = np.random.default_rng(0).integers(0, 1 << 32, 8, dtype=np.uint64).astype(np.uint32)
    n = base.size * 32
    patterns = [np.arange(n)[:, None], np.array(np.triu_indices(n, 1)).T]
    for first in range(n - 2):  # every 3-bit pattern, a first bit at a time
        rest = np.array(np.triu_indices(n - first - 1, 1)).T + first + 1
        patterns.append(np.concatenate([np.full((len(rest), 1), first), rest], axis=1))
    for bits in patterns:
        assert _caught(layout, base, _flipped(base, bits)).all()
    assert sum(map(len, patterns)) == n + n * (n - 1) // 2 + n * (n - 1) * (n - 2) // 6


@pytest.mark.parametrize("bit", [31, 30, 16, 15])
@pytest.mark.parametrize("fill", [0, 1])  # zeros: both flips go 0 -> 1; random: either way
def test_two_flips_in_one_high_column_of_a_128_kib_block_are_caught(layout, bit, fill):
    rng = np.random.default_rng(bit)
    base = (rng.integers(0, 1 << 32, BIG, dtype=np.uint64).astype(np.uint32) if fill
            else np.zeros(BIG, np.uint32))
    worst = [(0, 1 << 14), (5, 5 + (1 << 14)), (0, BIG - 1), ((1 << 14) - 1, 1 << 14),
             (1, BIG - 2), (0, 1 << 13), (3, 3 + 3 * (1 << 13)), (0, 1), (BIG - 2, BIG - 1)]
    pairs = np.concatenate([np.array(worst), np.sort(rng.choice(BIG, (120, 2)), axis=1)])
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    assert _caught(layout, base, _flipped(base, pairs * 32 + bit)).all()


def test_every_swap_of_two_different_words_in_a_small_block_is_caught(layout):
    rng = np.random.default_rng(1)
    for base in (rng.integers(0, 1 << 32, 16, dtype=np.uint64).astype(np.uint32),
                 np.array([0, 0xC0000000, 0x80000000, 0, 0x40000000, 0xFFFF0000, 0xFFFF, 1] * 2,
                          np.uint32)):
        pairs = [(a, b) for a, b in itertools.combinations(range(base.size), 2)
                 if base[a] != base[b]]
        spoiled = np.repeat(base[None], len(pairs), axis=0)
        for row, (a, b) in enumerate(pairs):
            spoiled[row, [a, b]] = base[[b, a]]
        assert _caught(layout, base, spoiled).all()


@pytest.mark.parametrize("x, y", [(0, 0xC0000000), (0, 0x80000000), (0x12345678, 0x92345678),
                                  (0x0000FFFF, 0xFFFF0000), (1, 0x80000001)])
def test_swaps_of_high_bit_words_in_a_128_kib_block_are_caught(layout, x, y):
    rng = np.random.default_rng(2)
    base = rng.integers(0, 1 << 32, BIG, dtype=np.uint64).astype(np.uint32)
    pairs = [(0, 2), (10, 12), (0, 1 << 14), (7, 7 + (1 << 14)), (0, BIG - 1), (4, 8),
             (100, 100 + (1 << 13)), *map(tuple, np.sort(rng.choice(BIG, (40, 2)), axis=1))]
    pairs = [(a, b) for a, b in pairs if a != b]
    spoiled = np.repeat(base[None], len(pairs), axis=0)
    for row, (a, b) in enumerate(pairs):
        spoiled[row, a], spoiled[row, b] = y, x  # base held x at a and y at b
    base_rows = spoiled.copy()
    for row, (a, b) in enumerate(pairs):
        base_rows[row, a], base_rows[row, b] = x, y
    caught = (_prints(layout, spoiled) != _prints(layout, base_rows)).any(axis=1)
    assert caught.all()


def test_partial_sums_of_any_split_combine_to_the_whole():
    rng = np.random.default_rng(3)
    words = rng.integers(0, 1 << 32, (5, 96), dtype=np.uint64).astype(np.uint32)
    weights = word_weight(np.arange(96, dtype=np.uint32))
    whole = word_sums(words, weights)
    for cut in (rng.permutation(96).reshape(6, 16), np.arange(96).reshape(4, 24),
                np.arange(96).reshape(24, 4).T):  # scattered, contiguous, strided pieces
        total = np.zeros_like(whole)
        for piece in cut:
            combine_sums(total, word_sums(words[:, piece], weights[piece]))
        np.testing.assert_array_equal(total, whole)
        parts = np.stack([word_sums(words[:, piece], weights[piece]) for piece in cut], axis=1)
        np.testing.assert_array_equal(reduce_sums(parts, axis=1), whole)


def test_sums_are_the_xor_and_the_weighted_half_word_sums(layout):
    rng = np.random.default_rng(4)
    words = rng.integers(0, 1 << 32, (3, 40), dtype=np.uint64)
    c = (4 * np.arange(40, dtype=np.uint64) + 1) * 0x9E3779B1 % (1 << 32)
    expected = np.stack([np.bitwise_xor.reduce(words, axis=1),
                         (words % (1 << 16) * c).sum(axis=1) % (1 << 32),
                         ((words >> 16) * c).sum(axis=1) % (1 << 32)],  # < 2**54: exact
                        axis=1).astype(np.uint32)
    got = host_fingerprint(layout, words.astype(np.uint32))
    np.testing.assert_array_equal(got, fmix32(expected))


def test_the_one_pass_sums_are_built_wherever_a_c_compiler_is():
    """`pip install` builds kvxfer.device._sums where there is a compiler (the extension is optional,
    so a failed build would otherwise go unnoticed and D would verify at numpy's speed)."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine: numpy sums the fingerprints")
    assert fingerprint.COMPILED


@pytest.mark.parametrize("order", ["rows", "picked_rows", "units", "strided_out", "unaligned"])
def test_one_pass_sums_equal_numpys_three_passes(order):
    rng = np.random.default_rng(7)
    words = rng.integers(0, 1 << 32, (9, 3, 70), dtype=np.uint64).astype(np.uint32)
    weights = word_weight(rng.permutation(1 << 12)[: 3 * 70].astype(np.uint32)).reshape(3, 70)

    def numpy(w, c, subscripts):
        out = np.empty((*w.shape[: fingerprint._LEAD[subscripts]], 3), np.uint32)
        fingerprint._numpy_sums(w, c, subscripts, out)
        return out

    if order == "rows":
        got, expected = word_sums(words[:, 1], weights[1]), numpy(words[:, 1], weights[1], "ij,j->i")
    elif order == "picked_rows":
        rows = np.array([4, 0, 4, -1, 2])  # repeated, negative, out of order
        got = word_sums(words[:, 2], weights[2], rows=rows)
        expected = numpy(words[rows, 2], weights[2], "ij,j->i")
    elif order == "units":
        got, expected = word_sums(words, weights, "suj,uj->su"), numpy(words, weights, "suj,uj->su")
    elif order == "strided_out":  # as kvxfer.device.pieces writes staging.prints[slots, :, layer]
        prints = np.zeros((9, 3, 4, 3), np.uint32)
        word_sums(words, weights, "suj,uj->su", out=prints[:, :, 2])
        got, expected = prints[:, :, 2], numpy(words, weights, "suj,uj->su")
        assert not prints[:, :, [0, 1, 3]].any()
    else:  # words at an odd byte offset: numpy's path, the same values
        raw = np.zeros(9 * 70 * 4 + 1, np.uint8)[1:].view(np.uint32).reshape(9, 70)
        raw[...] = words[:, 0]
        assert not raw.flags.aligned
        got, expected = word_sums(raw, weights[0]), numpy(words[:, 0], weights[0], "ij,j->i")
    np.testing.assert_array_equal(got, expected)
