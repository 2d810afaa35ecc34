"""gather_blocks / scatter_blocks against a numpy reference, byte for byte.

Caches hold random bit patterns (NaN payloads included), compared as uint8.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvxfer.device.gather import (
    block_fingerprints,
    bucket_size,
    check_fingerprints,
    fingerprint_blocks,
    gather_blocks,
    scatter_blocks,
)
from kvxfer.device.layout import CacheLayout
from kvxfer.errors import CorruptionError, InvalidInputError, LayoutMismatchError
from kvxfer.plan.blocks import to_kernel_ids

NUM_BLOCKS = 16
LAYERS = 2

# (mesh shape, mesh axes, spec, cache shape, dtype). Attention caches are
# [blocks, block_size * dcp, cdiv(2H, p), p, head_dim]; MLA [blocks, cdiv(bs, p), p, kv_dim].
CONFIGS = {
    "attention_bf16_mesh_1x8": ((1, 8), ("data", "model"), P(None, None, "model"),
                                (NUM_BLOCKS, 8, 8, 2, 16), jnp.bfloat16),
    "attention_fp8_blocks_sharded_2x4": ((2, 4), ("data", "model"), P("data", None, "model"),
                                         (NUM_BLOCKS, 8, 8, 4, 16), jnp.float8_e4m3fn),
    "attention_int8_dcp_2x4": ((2, 4), ("dcp", "model"), P(None, "dcp", "model"),
                               (NUM_BLOCKS, 8, 8, 4, 16), jnp.int8),
    "mla_bf16_replicated_1x8": ((1, 8), ("data", "model"), P(), (NUM_BLOCKS, 4, 2, 64),
                                jnp.bfloat16),
    "mla_bf16_data_2x4": ((2, 4), ("data", "model"), P("data"), (NUM_BLOCKS, 4, 2, 64),
                          jnp.bfloat16),
    "old_4d_bf16_mesh_1x8": ((1, 8), ("data", "model"), P(None, None, "model"),
                             (NUM_BLOCKS, 8, 8, 16), jnp.bfloat16),
}

SIGNALING_NAN_BF16 = np.uint16(0x7F81)  # payload 1, quiet bit clear


def _make_caches(config, seed, layers=LAYERS):
    mesh_shape, names, spec, shape, dtype = CONFIGS[config]
    mesh = jax.make_mesh(mesh_shape, names)
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    caches = []
    for _ in range(layers):
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
        host = raw.view(dtype).reshape(shape)
        if dtype == np.dtype(ml_dtypes.bfloat16):
            host.reshape(-1).view(np.uint16)[:3] = SIGNALING_NAN_BF16
        caches.append(jax.device_put(host, NamedSharding(mesh, spec)))
    return caches


def _bytes(x):
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


@pytest.mark.parametrize("config", CONFIGS)
def test_gather_matches_numpy_take_byte_for_byte(config):
    caches = _make_caches(config, seed=1)
    ids = [5, 0, NUM_BLOCKS - 1, 5, 9]  # unsorted, repeated, both ends
    host = gather_blocks(caches, ids)
    layout = CacheLayout.from_caches(caches)
    assert len(host) == LAYERS
    for cache, rows in zip(caches, host):
        assert rows.shape == (bucket_size(len(ids)), *layout.block_shape)
        assert rows.sharding.memory_kind == "pinned_host"
        assert rows.sharding.mesh == cache.sharding.mesh
        assert rows.sharding.spec == layout.host_partition_spec()
        np.testing.assert_array_equal(_bytes(rows)[: len(ids)], _bytes(cache)[ids])


@pytest.mark.parametrize("config", CONFIGS)
def test_round_trip_replaces_scattered_blocks_and_leaves_the_rest(config):
    source = _make_caches(config, seed=2)
    target = _make_caches(config, seed=3)
    ids = [3, NUM_BLOCKS - 1, 0, 7, 8]  # 5 rows: 3 rows of bucket padding follow
    expected = [_bytes(t).copy() for t in target]
    for exp, src in zip(expected, source):
        exp[ids] = _bytes(src)[ids]
    out = scatter_blocks(target, gather_blocks(source, ids), ids)
    for o, exp in zip(out, expected):
        assert o.sharding.is_equivalent_to(source[0].sharding, o.ndim)
        np.testing.assert_array_equal(_bytes(o), exp)


@pytest.mark.parametrize("config", CONFIGS)
def test_device_fingerprints_equal_numpy_fingerprints_of_the_bytes(config):
    caches = _make_caches(config, seed=4)
    ids = [2, 11, 2]
    host, fps = gather_blocks(caches, ids, fingerprints=True)
    layout = CacheLayout.from_caches(caches)
    assert fps.shape == (LAYERS, bucket_size(3), 3)
    assert fps.dtype == np.uint32
    received = [np.asarray(h)[:3].copy() for h in host]  # as if read off the network
    np.testing.assert_array_equal(block_fingerprints(layout, received, 3), np.asarray(fps)[:, :3])
    check_fingerprints(layout, received, 3, fps)
    assert len(np.unique(np.asarray(fps)[:, [0, 1]])) > 1  # not a constant


def test_scatter_accepts_numpy_rows_of_exactly_the_id_count():
    source = _make_caches("attention_int8_dcp_2x4", seed=5)
    target = _make_caches("attention_int8_dcp_2x4", seed=6)
    ids = [4, 12, 1]
    rows = [np.asarray(c)[ids] for c in source]
    out = scatter_blocks(target, rows, ids)
    for o, s in zip(out, source):
        np.testing.assert_array_equal(_bytes(o)[ids], _bytes(s)[ids])


def test_logical_block_gathers_its_kernel_blocks_in_order():
    caches = _make_caches("attention_bf16_mesh_1x8", seed=7)
    ids = to_kernel_ids([3, 1], ratio=2)  # kernel blocks 6, 7, 2, 3
    host = gather_blocks(caches, ids)
    np.testing.assert_array_equal(_bytes(host[1])[:4], _bytes(caches[1])[[6, 7, 2, 3]])


# Fingerprints catch corruption.


@pytest.mark.parametrize(
    "layer, row, byte_index, bit",
    [(0, 0, 0, 0), (1, 2, 1000, 7), (1, 4, -1, 7), (0, 3, -1, 0)],
)
def test_a_single_flipped_bit_raises_corruption_naming_layer_and_row(
    layer, row, byte_index, bit
):
    caches = _make_caches("attention_int8_dcp_2x4", seed=8)
    layout = CacheLayout.from_caches(caches)
    ids = [9, 1, 14, 0, 6]
    host, fps = gather_blocks(caches, ids, fingerprints=True)
    received = [np.asarray(h)[:5].copy() for h in host]
    block = received[layer][row].reshape(-1).view(np.uint8)
    byte_index %= block.size
    block[byte_index] ^= np.uint8(1 << bit)
    with pytest.raises(CorruptionError, match=f"layer {layer}, block row {row}:"):
        check_fingerprints(layout, received, 5, fps)


def test_swapping_two_words_of_a_block_is_caught():
    caches = _make_caches("mla_bf16_replicated_1x8", seed=9)
    layout = CacheLayout.from_caches(caches)
    host, fps = gather_blocks(caches, [3], fingerprints=True)
    received = [np.asarray(h)[:1].copy() for h in host]
    words = received[0].reshape(-1).view(np.uint32)
    words[[0, 5]] = words[[5, 0]]
    with pytest.raises(CorruptionError, match="layer 0, block row 0:"):
        check_fingerprints(layout, received, 1, fps)


def test_check_fingerprints_rejects_fingerprints_of_the_wrong_shape():
    caches = _make_caches("mla_bf16_replicated_1x8", seed=9)
    layout = CacheLayout.from_caches(caches)
    host = gather_blocks(caches, [3])
    with pytest.raises(InvalidInputError, match=r"shape \(2, 8, 1\)"):
        check_fingerprints(layout, host, 1, np.zeros((2, 8, 1), np.uint32))


# Buckets and compilation.


@pytest.mark.parametrize("count, bucket", [(0, 8), (1, 8), (8, 8), (9, 16), (256, 256), (257, 512)])
def test_bucket_is_next_power_of_two_at_least_eight(count, bucket):
    assert bucket_size(count) == bucket


def test_new_block_count_in_a_seen_bucket_does_not_recompile():
    from kvxfer.device._xla import gather_fn

    caches = _make_caches("attention_bf16_mesh_1x8", seed=10)
    fn = gather_fn(CacheLayout.from_caches(caches), caches[0].sharding.mesh, False)
    gather_blocks(caches, [1])
    gather_blocks(caches, list(range(9)))
    compiled = fn._cache_size()
    for count in (2, 5, 8, 10, 16, 3):
        gather_blocks(caches, list(range(count)))
    assert fn._cache_size() == compiled


# Invalid input is refused before dispatch, naming the value.


@pytest.mark.parametrize(
    "ids, message",
    [([0, NUM_BLOCKS], rf"\[{NUM_BLOCKS}\] out of range"), ([-1, 2], r"\[-1\] out of range"),
     ([[0, 1]], "1-D"), ([0.0, 1.0], "integers")],
)
def test_gather_rejects_bad_block_ids(ids, message):
    caches = _make_caches("mla_bf16_replicated_1x8", seed=11)
    with pytest.raises(InvalidInputError, match=message):
        gather_blocks(caches, ids)


def test_gather_rejects_an_empty_cache_list():
    with pytest.raises(InvalidInputError, match="empty"):
        gather_blocks([], [0])


def test_gather_rejects_caches_of_mixed_shape():
    caches = _make_caches("mla_bf16_replicated_1x8", seed=12)
    small = jax.device_put(jnp.zeros((8, 4, 2, 64), jnp.bfloat16), caches[0].sharding)
    with pytest.raises(LayoutMismatchError, match=r"caches\[2\] shape \(8, 4, 2, 64\)"):
        gather_blocks(caches + [small], [0])


@pytest.mark.parametrize(
    "make_rows, error, message",
    [
        (lambda r: [x.astype(np.float32) for x in r], LayoutMismatchError, "dtype float32"),
        (lambda r: [x[:, :2] for x in r], LayoutMismatchError, r"shape \(3, 2, 2, 64\)"),
        (lambda r: r[:1], LayoutMismatchError, "1 layers"),
        (lambda r: [x[:2] for x in r], InvalidInputError, "2 rows, fewer than the 3"),
    ],
)
def test_scatter_rejects_host_blocks_that_do_not_match_and_keeps_the_caches(
    make_rows, error, message
):
    caches = _make_caches("mla_bf16_replicated_1x8", seed=13)
    before = [_bytes(c).copy() for c in caches]
    rows = make_rows([np.asarray(c)[:3] for c in caches])
    with pytest.raises(error, match=message):
        scatter_blocks(caches, rows, [0, 1, 2])
    for c, b in zip(caches, before):  # not donated: still readable and unchanged
        np.testing.assert_array_equal(_bytes(c), b)


def test_scatter_rejects_repeated_block_ids():
    caches = _make_caches("mla_bf16_replicated_1x8", seed=14)
    rows = [np.asarray(c)[:3] for c in caches]
    with pytest.raises(InvalidInputError, match=r"repeated: \[4\]"):
        scatter_blocks(caches, rows, [4, 1, 4])


def test_bench_reports_ratios_and_no_recompiles_after_warmup():
    from kvxfer.bench.gather import run

    result = run(layers=2, num_blocks=32, block_shape=(4, 8, 2, 8), count=12, iters=2,
                 recompile_trials=10)
    assert {"gather_gbps", "memcpy_gbps", "gather_over_memcpy", "naive_over_memcpy",
            "recompiles_after_warmup", "fingerprint_overhead", "gather_into_over_memcpy"
            } <= set(result)
    assert result["recompiles_after_warmup"] == 0
    assert result["gather_gbps"] > 0 and result["memcpy_gbps"] > 0
    assert result["gather_into_gbps"] > 0


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape, spec, mesh_shape", [
    ((8, 4, 3, 8), P(None, None, None, "model"), (1, 8)),  # pieces of the last axis, < 1 word
    ((8, 4, 3, 8), P(None, None, None, "model"), (1, 4)),
    ((8, 4, 3, 7), P(), (1, 8)),  # blocks of an odd number of bytes
    ((8, 4, 8, 2), P(None, None, "model"), (1, 8)),
])
def test_fingerprints_on_device_equal_numpy_for_pieces_that_are_not_whole_words(
        dtype, shape, spec, mesh_shape):
    mesh = jax.make_mesh(mesh_shape, ("data", "model"))
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(12)
    host = [rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
            .view(dtype).reshape(shape) for _ in range(LAYERS)]
    caches = [jax.device_put(h, NamedSharding(mesh, spec)) for h in host]
    ids = [1, 5, 2]
    on_device = fingerprint_blocks(caches, ids)
    layout = CacheLayout.from_caches(caches)
    np.testing.assert_array_equal(on_device, block_fingerprints(layout, [h[ids] for h in host], 3))
    assert len(np.unique(on_device)) == on_device.size  # distinct blocks, distinct prints
