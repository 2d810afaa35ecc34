"""scatter_blocks in place, gather_into staging, fingerprints computed on device.

Everything is compared as bytes (uint8 views) against numpy on the host
copies the caches were made from. No test measures time: "the cost does not
depend on the cache size" is shown by the buffers a scatter writes into (the
inputs' own, same addresses) and by the compiled XLA program aliasing every
cache input to its output.

`path` runs a test on both backends: `numpy` (numpy copies into the donated
buffers, XLA:CPU's) and `xla` (the jitted programs used on other platforms),
selected with `KVXFER_BACKEND`.
"""

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvxfer.device import _numpy, _xla
from kvxfer.device._rows import slice_runs
from kvxfer.device._xla import scatter_fn
from kvxfer.device.fingerprint import compare_fingerprints
from kvxfer.device.gather import (
    block_fingerprints,
    bucket_size,
    fingerprint_blocks,
    gather_blocks,
    gather_into,
    scatter_blocks,
)
from kvxfer.device.layout import CacheLayout
from kvxfer.errors import CorruptionError, InvalidInputError, LayoutMismatchError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_gather import CONFIGS, LAYERS, NUM_BLOCKS, SIGNALING_NAN_BF16, _bytes  # noqa: E402

STAGING_ROWS = 32


def _random_host(shape, dtype, rng):
    dtype = np.dtype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    host = raw.view(dtype).reshape(shape)
    if dtype.name == "bfloat16":
        host.reshape(-1).view(np.uint16)[:3] = SIGNALING_NAN_BF16
    return host


def _owned(host, sharding):
    """`host` on device in buffers XLA owns.

    `device_put` of a suitably aligned numpy array on the CPU backend may alias
    the numpy memory (for a replicated array, every device's shard is then the
    same memory); a donation cannot take such a buffer over and copies it. A
    jitted copy gives every device its own buffer, as a real cache has.
    """
    out = jax.jit(jnp.copy, out_shardings=sharding)(jax.device_put(host, sharding))
    np.testing.assert_array_equal(_bytes(out), _bytes(host))
    return out


def _make(config, seed, *, num_blocks=NUM_BLOCKS, layers=LAYERS):
    """Per-layer caches of `config` and the numpy arrays they were made from."""
    mesh_shape, names, spec, shape, dtype = CONFIGS[config]
    sharding = NamedSharding(jax.make_mesh(mesh_shape, names), spec)
    rng = np.random.default_rng(seed)
    hosts = [_random_host((num_blocks, *shape[1:]), dtype, rng) for _ in range(layers)]
    return [_owned(h, sharding) for h in hosts], hosts


def _staging(config, seed, rows=STAGING_ROWS, layers=LAYERS):
    """Writable numpy regions `[rows, *block_shape]` per layer, random bytes."""
    _, _, _, shape, dtype = CONFIGS[config]
    rng = np.random.default_rng(seed)
    return [_random_host((rows, *shape[1:]), dtype, rng) for _ in range(layers)]


def _pointers(caches):
    return [[s.data.unsafe_buffer_pointer() for s in c.addressable_shards] for c in caches]


@pytest.fixture(params=["numpy", "xla"])
def path(request, monkeypatch):
    monkeypatch.setenv("KVXFER_BACKEND", request.param)
    return request.param


# 1. scatter_blocks writes into the caches' own buffers.


@pytest.mark.parametrize("config", CONFIGS)
def test_scatter_keeps_every_shard_buffer_and_deletes_the_inputs(config):
    caches, hosts = _make(config, seed=1)
    layout = CacheLayout.from_caches(caches)
    before = _pointers(caches)
    assert all(len(set(p)) == len(p) for p in before)  # one buffer per device
    src = _staging(config, seed=2, rows=5)
    ids = [3, NUM_BLOCKS - 1, 0, 7, 8]
    out = scatter_blocks(caches, src, ids)
    assert _pointers(out) == before
    assert all(c.is_deleted() for c in caches)
    assert CacheLayout.from_caches(out) == layout
    for o, c in zip(out, caches):
        assert o.sharding.is_equivalent_to(c.sharding, o.ndim)


@pytest.mark.parametrize("config", CONFIGS)
def test_scatter_writes_the_source_rows_and_leaves_every_other_block(config, path):
    caches, hosts = _make(config, seed=3)
    src = _staging(config, seed=4, rows=5)
    ids = [3, NUM_BLOCKS - 1, 0, 7, 8]  # 5 ids: 3 rows of bucket padding in the XLA path
    out = scatter_blocks(caches, src, ids)
    for o, h, s in zip(out, hosts, src):
        expected = _bytes(h).copy()
        expected[ids] = _bytes(s)
        np.testing.assert_array_equal(_bytes(o), expected)
        # Every replica holds the new bytes, not only the one np.asarray reads.
        for shard in o.addressable_shards:
            np.testing.assert_array_equal(_bytes(shard.data), expected[shard.index])


def test_scatter_of_no_blocks_returns_the_caches_unchanged():
    caches, hosts = _make("mla_bf16_data_2x4", seed=5)
    out = scatter_blocks(caches, [h[:0] for h in hosts], [])
    for o, h in zip(out, hosts):
        np.testing.assert_array_equal(_bytes(o), _bytes(h))


def test_scatter_from_the_caches_themselves_copies_or_refuses_without_losing_them():
    caches, hosts = _make("mla_bf16_data_2x4", seed=27)
    try:
        out = scatter_blocks(caches, caches, [1, 14], rows=[0, 15])
    except InvalidInputError:
        assert not any(c.is_deleted() for c in caches)
        return
    for o, h in zip(out, hosts):
        np.testing.assert_array_equal(_bytes(o)[[1, 14]], _bytes(h)[[0, 15]])


# 2. The XLA scatter aliases every cache input to its output, whatever the cache size.


def _aliases(compiled_text):
    """`{output index: parameter index}` from the HLO module header's input_output_alias."""
    header = compiled_text.splitlines()[0]
    assert "input_output_alias" in header, header[:300]
    pairs = re.findall(r"\{(\d+)\}: \((\d+), \{\}, [a-z-]+\)", header)
    return {int(o): int(p) for o, p in pairs}


@pytest.mark.parametrize("config", ["attention_bf16_mesh_1x8", "attention_fp8_blocks_sharded_2x4",
                                    "mla_bf16_replicated_1x8"])
def test_compiled_xla_scatter_aliases_each_layer_for_small_and_16x_caches(config):
    layers = 3
    for num_blocks in (NUM_BLOCKS, 16 * NUM_BLOCKS):
        caches, _ = _make(config, seed=6, num_blocks=num_blocks, layers=layers)
        layout = CacheLayout.from_caches(caches)
        mesh = caches[0].sharding.mesh
        host = NamedSharding(mesh, layout.host_partition_spec(), memory_kind="pinned_host")
        rows = [jax.device_put(np.zeros((8, *layout.block_shape), layout.np_dtype), host)
                for _ in range(layers)]
        ids = jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(mesh, P()))
        text = scatter_fn(layout, mesh).lower(caches, rows, ids).compile().as_text()
        # Outputs are the layers; parameters 0..layers-1 are the caches (then rows, ids).
        assert _aliases(text) == {i: i for i in range(layers)}, num_blocks


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("count", [1, 5, 9])  # buckets 8, 8, 16: padding rows in every case
def test_scatter_xla_direct_is_byte_exact_and_reuses_the_buffers(config, count):
    caches, hosts = _make(config, seed=7)
    layout = CacheLayout.from_caches(caches)
    src_rows = _staging(config, seed=8, rows=12)
    ids = np.array([15, 0, 8, 7, 3, 12, 1, 9, 4][:count], np.int32)  # both ends of both halves
    src = np.array([11, 0, 5, 2, 9, 3, 10, 1, 7][:count], np.int64)
    assert bucket_size(count) > count
    before = _pointers(caches)
    out, _ = _xla.scatter(layout, caches[0].sharding.mesh, caches, src_rows, ids, src, False)
    assert _pointers(out) == before
    assert all(c.is_deleted() for c in caches)
    for o, h, s in zip(out, hosts, src_rows):
        expected = _bytes(h).copy()
        expected[ids] = _bytes(s)[src]
        np.testing.assert_array_equal(_bytes(o), expected)


# 3. rows=: which host row goes to which block; bad rows refused before anything moves.


@pytest.mark.parametrize("config", ["attention_fp8_blocks_sharded_2x4", "attention_int8_dcp_2x4",
                                    "mla_bf16_replicated_1x8", "old_4d_bf16_mesh_1x8"])
def test_scatter_rows_pick_from_a_staging_region(config, path):
    caches, hosts = _make(config, seed=9)
    region = _staging(config, seed=10)
    ids = [9, 2, 15, 4, 0, 11, 5, 6]
    rows = [31, 0, 17, 5, 30, 8, 9, 10]  # scattered and a run (9, 10 -> 5, 6)
    out = scatter_blocks(caches, region, ids, rows=np.array(rows))
    for o, h, r in zip(out, hosts, region):
        expected = _bytes(h).copy()
        expected[ids] = _bytes(r)[rows]
        np.testing.assert_array_equal(_bytes(o), expected)


def test_scatter_rows_may_read_one_host_row_into_two_blocks(path):
    caches, hosts = _make("mla_bf16_data_2x4", seed=11)
    region = _staging("mla_bf16_data_2x4", seed=12)
    out = scatter_blocks(caches, region, [1, 14], rows=[7, 7])
    for o, r in zip(out, region):
        np.testing.assert_array_equal(_bytes(o)[[1, 14]], _bytes(r)[[7, 7]])


@pytest.mark.parametrize(
    "rows, message",
    [
        ([0, 1, STAGING_ROWS], rf"rows \[{STAGING_ROWS}\] out of range \[0, {STAGING_ROWS}\)"),
        ([-1, 0, 1], r"rows \[-1\] out of range"),
        ([0, 1], r"rows must hold one integer per block id \(3\), got .*\[0, 1\]"),
        ([0, 1, 2, 3], r"rows must hold one integer per block id \(3\), got .*\[0, 1, 2, 3\]"),
        ([0.0, 1.0, 2.0], r"rows must hold one integer per block id \(3\), got .*0\.0"),
        ([[0, 1, 2]], r"rows must hold one integer per block id \(3\), got .*\[\[0, 1, 2\]\]"),
        (["0", "1", "2"], r"rows must hold one integer per block id \(3\), got .*'0'"),
    ],
)
def test_scatter_rejects_bad_rows_naming_them_and_keeps_the_caches(rows, message, path):
    caches, hosts = _make("attention_fp8_blocks_sharded_2x4", seed=13)
    region = _staging("attention_fp8_blocks_sharded_2x4", seed=14)
    with pytest.raises(InvalidInputError, match=message):
        scatter_blocks(caches, region, [4, 12, 1], rows=rows)
    for c, h in zip(caches, hosts):
        assert not c.is_deleted()
        np.testing.assert_array_equal(_bytes(c), _bytes(h))


# 4. gather_into (deprecated: staging holds pieces): blocks into existing host arrays.


@pytest.mark.parametrize("config", CONFIGS)
def test_gather_into_writes_exactly_the_blocks_and_returns_their_fingerprints(config, path):
    caches, hosts = _make(config, seed=15)
    regions = _staging(config, seed=16)
    before = [_bytes(r).copy() for r in regions]
    ids = [5, 0, NUM_BLOCKS - 1, 5, 9, 10]  # unsorted, repeated, both ends
    rows = [31, 2, 3, 10, 0, 1]  # a run (2, 3) among scattered rows
    with pytest.warns(DeprecationWarning, match="gather_piece_into"):
        prints = gather_into(caches, ids, regions, rows)
    for r, b, h in zip(regions, before, hosts):
        expected = b.copy()
        expected[rows] = _bytes(h)[ids]
        np.testing.assert_array_equal(_bytes(r), expected)
    layout = CacheLayout.from_caches(caches)
    assert prints.shape == (LAYERS, len(ids), 3) and prints.dtype == np.uint32
    gathered = gather_blocks(caches, ids, fingerprints=True)
    np.testing.assert_array_equal(prints, np.asarray(gathered.fingerprints)[:, : len(ids)])
    np.testing.assert_array_equal(
        prints, block_fingerprints(layout, [h[ids] for h in hosts], len(ids)))
    for c, h in zip(caches, hosts):  # read only
        assert not c.is_deleted()
        np.testing.assert_array_equal(_bytes(c), _bytes(h))


def test_gather_into_of_no_blocks_touches_nothing():
    caches, _ = _make("attention_int8_dcp_2x4", seed=17)
    regions = _staging("attention_int8_dcp_2x4", seed=18)
    before = [r.copy() for r in regions]
    prints = gather_into(caches, [], regions, [])
    assert prints.shape == (LAYERS, 0, 3)
    for r, b in zip(regions, before):
        np.testing.assert_array_equal(_bytes(r), _bytes(b))


def _read_only(regions):
    regions[1].flags.writeable = False
    return regions


@pytest.mark.parametrize(
    "make_regions, rows, error, message",
    [
        (lambda r: r, [3, 7, 3], InvalidInputError, r"distinct, got \[3, 7, 3\]"),
        (lambda r: r, [3, 7, STAGING_ROWS], InvalidInputError, rf"rows \[{STAGING_ROWS}\] out of range"),
        (lambda r: r, [3, 7], InvalidInputError, r"rows must hold one integer per block id \(3\)"),
        (_read_only, [3, 7, 8], InvalidInputError, r"regions\[1\] must be a writable numpy array"),
        (lambda r: [r[0], jnp.asarray(r[1])], [3, 7, 8], InvalidInputError,
         r"regions\[1\] must be a writable numpy array"),
        (lambda r: [r[0], r[1].astype(np.float32)], [3, 7, 8], LayoutMismatchError, "dtype float32"),
        (lambda r: [r[0], r[1][:, :2]], [3, 7, 8], LayoutMismatchError, r"regions\[1\] has shape"),
        (lambda r: r[:1], [3, 7, 8], LayoutMismatchError, "1 layers"),
    ],
)
def test_gather_into_rejects_bad_regions_and_rows_before_writing(
    make_regions, rows, error, message, path
):
    caches, _ = _make("mla_bf16_data_2x4", seed=19)
    regions = make_regions(_staging("mla_bf16_data_2x4", seed=20))
    before = [np.array(r, copy=True) for r in regions]
    with pytest.raises(error, match=message):
        gather_into(caches, [1, 9, 14], regions, rows)
    for r, b in zip(regions, before):
        np.testing.assert_array_equal(_bytes(r), _bytes(b))


# 5. Fingerprints do not depend on how the caches are sharded.


def _mesh(shape, names=("data", "model")):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names)


# Shardings of one layout, by name: (mesh shape over the first devices, spec).
WHOLE_WORDS = {  # for blocks [8, 8, 2, w]
    "1x4_model": ((1, 4), P(None, None, "model")),
    "1x8_model": ((1, 8), P(None, None, "model")),
    "1x8_replicated": ((1, 8), P()),
    "1x1_single_device": ((1, 1), P()),
    "2x4_blocks_and_model": ((2, 4), P("data", None, "model")),
    "2x4_two_inner_axes": ((2, 4), P(None, "data", "model")),
    "2x4_one_axis_both": ((2, 4), P(None, None, ("data", "model"))),
    "8x1_blocks": ((8, 1), P("data")),
    "2x4_blocks_and_last_axis": ((2, 4), P("data", None, None, None, "model")),
    "1x8_last_axis": ((1, 8), P(None, None, None, None, "model")),
}
LAST_AXIS = {name: WHOLE_WORDS[name] for name in (
    "1x8_replicated", "1x8_model", "2x4_blocks_and_last_axis", "1x8_last_axis")}
ODD = {  # for blocks [3, 2, 5] and [4, 2, 6]
    "1x8_replicated": ((1, 8), P()),
    "1x1_single_device": ((1, 1), P()),
    "8x1_blocks": ((8, 1), P("data")),
    "1x2_axis_2": ((1, 2), P(None, None, "model")),
    "2x4_axis_2_and_blocks": ((2, 4), P("model", None, "data")),
}
SPLIT_LAST = {  # for blocks [4, 2, 6]: each device holds 3 elements of the last axis
    "1x2_last_axis": ((1, 2), P(None, None, None, "model")),
    "2x4_last_axis_and_blocks": ((2, 4), P("model", None, None, "data")),
}

# (block shape, dtype, shardings). With the last axis cut into pieces that are not
# whole 32-bit words, or blocks whose bytes do not fill whole words, the device sums
# elements at byte offsets; the host sums zero-padded words of the whole block.
FINGERPRINT_CASES = {
    "bf16_words": ((8, 8, 2, 16), jnp.bfloat16, WHOLE_WORDS),
    "int8_words_and_2_bytes_a_device": ((8, 8, 2, 16), jnp.int8, LAST_AXIS),
    "int8_1_or_2_bytes_a_device": ((8, 8, 2, 8), jnp.int8, LAST_AXIS),
    "bf16_1_or_2_elements_a_device": ((8, 8, 2, 8), jnp.bfloat16, LAST_AXIS),
    "int8_odd_block": ((3, 2, 5), jnp.int8, ODD),
    "bf16_odd_block": ((3, 2, 5), jnp.bfloat16, ODD),
    "fp8_odd_block": ((3, 2, 5), jnp.float8_e4m3fn,
                      {k: ODD[k] for k in ("1x8_replicated", "2x4_axis_2_and_blocks")}),
    "bf16_last_axis_split_mid_word": ((4, 2, 6), jnp.bfloat16, {**ODD, **SPLIT_LAST}),
    "int8_last_axis_split_mid_word": ((4, 2, 6), jnp.int8, {**ODD, **SPLIT_LAST}),
}


@pytest.mark.parametrize("case", FINGERPRINT_CASES)
def test_device_fingerprints_are_the_same_under_every_sharding(case):
    block_shape, dtype, shardings = FINGERPRINT_CASES[case]
    rng = np.random.default_rng(21)
    hosts = [_random_host((NUM_BLOCKS, *block_shape), dtype, rng) for _ in range(LAYERS)]
    ids = [7, 0, 15, 7, 8, 3]
    results = {}
    for name, (mesh_shape, spec) in shardings.items():
        sharding = NamedSharding(_mesh(mesh_shape), spec)
        caches = [_owned(h, sharding) for h in hosts]
        results[name] = fingerprint_blocks(caches, ids)
    # gather_blocks computes the same prints in its own dispatch (here: the last sharding).
    gathered = np.asarray(gather_blocks(caches, ids, fingerprints=True).fingerprints)
    np.testing.assert_array_equal(results[name], gathered[:, : len(ids)], err_msg=name)
    layout = CacheLayout.from_caches(caches)
    on_host = block_fingerprints(layout, [h[ids] for h in hosts], len(ids))
    assert on_host.shape == (LAYERS, len(ids), 3)
    for name, prints in results.items():
        np.testing.assert_array_equal(prints, on_host, err_msg=name)
    assert len(np.unique(on_host[:, [0, 1, 2, 4, 5]])) == 2 * 5 * 3  # distinct blocks differ
    np.testing.assert_array_equal(on_host[:, 0], on_host[:, 3])  # same block, same print


# 6. A flipped bit in a scattered block is caught on device.


@pytest.mark.parametrize(
    "config, layer, row, byte_index, bit",
    [
        ("attention_bf16_mesh_1x8", 0, 0, 0, 0),
        ("attention_fp8_blocks_sharded_2x4", 1, 3, -1, 7),
        ("attention_int8_dcp_2x4", 1, 2, 1000, 3),
        ("mla_bf16_replicated_1x8", 0, 4, 517, 5),
        ("mla_bf16_data_2x4", 1, 1, -1, 0),
    ],
)
def test_a_bit_flipped_before_the_scatter_is_caught_by_device_fingerprints(
    config, layer, row, byte_index, bit, path
):
    source, _ = _make(config, seed=22)
    target, _ = _make(config, seed=23)
    src_ids = [4, 11, 0, 15, 8]
    dst_ids = [13, 2, 9, 6, 15]
    staging_rows = [20, 3, 31, 0, 12]
    staging = _staging(config, seed=24)
    sent = gather_into(source, src_ids, staging, staging_rows)  # P's fingerprints
    block = staging[layer][staging_rows[row]].reshape(-1).view(np.uint8)
    block[byte_index % block.size] ^= np.uint8(1 << bit)  # corrupted on the wire
    out, landed = scatter_blocks(target, staging, dst_ids, rows=staging_rows, fingerprints=True)
    for got in (landed, fingerprint_blocks(out, dst_ids)):  # D's check, and a separate one
        with pytest.raises(CorruptionError, match=f"layer {layer}, block row {row}:") as caught:
            compare_fingerprints(got, sent)
        assert "(1 mismatching blocks in all)" in str(caught.value)


@pytest.mark.parametrize("config", ["attention_fp8_blocks_sharded_2x4", "mla_bf16_replicated_1x8"])
def test_an_intact_scatter_matches_the_senders_fingerprints(config, path):
    source, _ = _make(config, seed=25)
    target, _ = _make(config, seed=26)
    src_ids, dst_ids = [4, 11, 0], [13, 2, 9]
    sent = gather_blocks(source, src_ids, fingerprints=True)
    out = scatter_blocks(target, sent.blocks, dst_ids)
    compare_fingerprints(fingerprint_blocks(out, dst_ids), np.asarray(sent.fingerprints)[:, :3])


def test_compare_fingerprints_refuses_arrays_of_different_shape():
    with pytest.raises(InvalidInputError, match=r"\(2, 3, 3\) cannot be checked against \(2, 4, 3\)"):
        compare_fingerprints(np.zeros((2, 3, 3), np.uint32), np.zeros((2, 4, 3), np.uint32))


# 7. D's scatter fingerprints the blocks as they landed; tables in any order copy in runs.


def _scatter_with_prints_checked(config, seed):
    """Scatter with fingerprints; check the bytes and that the prints are the rows'."""
    caches, hosts = _make(config, seed=seed)
    region = _staging(config, seed=seed + 1)
    ids = [9, 8, 7, 6, 15, 0, 3]  # a descending run (a tail-first free list), then scattered
    rows = [4, 5, 6, 7, 31, 0, 20]
    out, prints = scatter_blocks(caches, region, ids, rows=rows, fingerprints=True)
    for o, h, r in zip(out, hosts, region):
        expected = _bytes(h).copy()
        expected[ids] = _bytes(r)[rows]
        np.testing.assert_array_equal(_bytes(o), expected)
    layout = CacheLayout.from_caches(out)
    assert prints.shape == (LAYERS, len(ids), 3) and prints.dtype == np.uint32
    np.testing.assert_array_equal(
        prints, block_fingerprints(layout, [r[rows] for r in region], len(ids)))
    return out, region, ids, rows, prints


@pytest.mark.parametrize("config", CONFIGS)
def test_scatter_with_fingerprints_gives_those_of_the_blocks_as_they_landed(config, path):
    out, region, ids, _, prints = _scatter_with_prints_checked(config, seed=28)
    np.testing.assert_array_equal(prints, fingerprint_blocks(out, ids))
    out, none = scatter_blocks(out, region, [], rows=[], fingerprints=True)
    assert none.shape == (LAYERS, 0, 3)


@pytest.mark.parametrize("config", CONFIGS)
def test_gather_into_from_a_descending_table_is_byte_exact(config, path):
    caches, hosts = _make(config, seed=30)
    regions = _staging(config, seed=31)
    ids = [14, 13, 12, 11, 10, 2, 1]  # blocks handed out tail first
    rows = [0, 1, 2, 3, 4, 9, 8]
    prints = gather_into(caches, ids, regions, rows)
    for r, h in zip(regions, hosts):
        np.testing.assert_array_equal(_bytes(r)[rows], _bytes(h)[ids])
    layout = CacheLayout.from_caches(caches)
    np.testing.assert_array_equal(
        prints, block_fingerprints(layout, [h[ids] for h in hosts], len(ids)))


@pytest.mark.parametrize("config", ["attention_bf16_mesh_1x8", "attention_fp8_blocks_sharded_2x4",
                                    "mla_bf16_replicated_1x8", "mla_bf16_data_2x4"])
def test_on_the_cpu_fingerprints_are_summed_from_the_buffers_without_an_xla_dispatch(
        config, monkeypatch):
    caches, hosts = _make(config, seed=32)
    regions = _staging(config, seed=33)
    ids = [3, 4, 5, 12, 0]
    expected = np.asarray(gather_blocks(caches, ids, fingerprints=True).fingerprints)[:, :5]

    def no_xla(*args):
        raise AssertionError("fingerprints went through XLA")

    monkeypatch.setattr(_xla, "fingerprint_fn", no_xla)
    np.testing.assert_array_equal(fingerprint_blocks(caches, ids), expected)
    np.testing.assert_array_equal(gather_into(caches, ids, regions, [0, 1, 2, 3, 4]), expected)
    _, landed = scatter_blocks(caches, regions, [9, 8, 7, 6, 2], rows=[0, 1, 2, 3, 4],
                               fingerprints=True)
    np.testing.assert_array_equal(landed, expected)


@given(st.lists(st.integers(0, 40), min_size=1, max_size=40, unique=True),
       st.lists(st.integers(0, 40), min_size=40, max_size=40), st.sampled_from([0, 1, -1]))
def test_row_copies_by_runs_equal_fancy_assignment(to, frm, order):
    to = np.asarray(to)
    if order:  # sources that run with the destinations, one way or the other
        frm = np.argsort(np.argsort(to)) * order + (40 if order < 0 else 0)
    else:
        frm = np.asarray(frm[: len(to)])
    src = np.arange(41 * 3).reshape(41, 3)
    want, got = np.full((41, 3), -1), np.full((41, 3), -1)
    want[to] = src[frm]
    runs = slice_runs(frm, to)
    for s, d, n in runs:
        got[d : d + abs(n)] = src[s : s + n] if n > 0 else src[s + n + 1 : s + 1][::-1]
    np.testing.assert_array_equal(got, want)
    if order and np.array_equal(np.sort(to), np.arange(to.min(), to.max() + 1)):
        assert len(runs) == 1  # contiguous blocks, either order: one copy


@pytest.mark.parametrize("flag", ["no", 1, None])
def test_a_fingerprints_flag_that_is_not_a_bool_is_refused_and_the_caches_kept(flag):
    caches, hosts = _make("attention_bf16_mesh_1x8", seed=34)
    with pytest.raises(InvalidInputError, match=f"fingerprints must be True or False, got {flag!r}"):
        scatter_blocks(caches, _staging("attention_bf16_mesh_1x8", seed=35), [1], rows=[0],
                       fingerprints=flag)
    with pytest.raises(InvalidInputError, match="fingerprints must be True or False"):
        gather_blocks(caches, [1], fingerprints=flag)
    assert not any(c.is_deleted() for c in caches)


# Host copies on several threads.


@pytest.mark.parametrize("threads", ["1", "3", "8"])
def test_host_copies_on_any_number_of_threads_write_and_hash_the_same_bytes(threads, monkeypatch):
    """One task per shard, on `KVXFER_HOST_THREADS` threads: every shard's sums reach the
    right block (they are added under a lock), whatever the thread count."""
    monkeypatch.setenv("KVXFER_HOST_THREADS", threads)
    config = next(iter(CONFIGS))
    out, _, ids, rows, prints = _scatter_with_prints_checked(config, seed=41)
    staging = _staging(config, seed=43)
    sent = gather_into(out, ids, staging, rows)
    np.testing.assert_array_equal(sent, prints)
    np.testing.assert_array_equal(fingerprint_blocks(out, ids), prints)


def test_a_failing_shard_task_raises_once_every_task_has_ended(monkeypatch):
    monkeypatch.setenv("KVXFER_HOST_THREADS", "2")
    ran = []

    def ok(i):
        ran.append(i)

    def bad():
        raise LayoutMismatchError("shard 1 is not what the plan says")

    tasks = [lambda: ok(0), bad] + [lambda i=i: ok(i) for i in range(2, 6)]
    with pytest.raises(LayoutMismatchError, match="shard 1 is not"):
        _numpy.run_per_shard(tasks)
    assert sorted(ran) == [0, 2, 3, 4, 5]


def test_shard_tasks_that_run_shard_tasks_run_them_inline_not_deadlocked(monkeypatch):
    import threading

    monkeypatch.setenv("KVXFER_HOST_THREADS", "2")
    ran = []

    def outer(i):
        _numpy.run_per_shard([lambda j=j: ran.append((i, j)) for j in range(3)])

    worker = threading.Thread(
        target=_numpy.run_per_shard, args=([lambda i=i: outer(i) for i in range(4)],))
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "nested shard tasks deadlocked the pool"
    assert sorted(ran) == [(i, j) for i in range(4) for j in range(3)]


@pytest.mark.parametrize("value", ["0", "-2", "two", "", "\u00b2"])
def test_a_bad_host_thread_count_is_refused_naming_it(value, monkeypatch):
    monkeypatch.setenv("KVXFER_HOST_THREADS", value)
    config = next(iter(CONFIGS))
    caches, hosts = _make(config, seed=44)
    with pytest.raises(InvalidInputError, match=f"KVXFER_HOST_THREADS must be a positive int, "
                                                f"got '{value}'"):
        scatter_blocks(caches, _staging(config, seed=45), [1, 2], rows=[0, 1])
    for cache, host in zip(caches, hosts):  # refused before the caches were donated
        np.testing.assert_array_equal(_bytes(cache), _bytes(host))


def test_the_backend_follows_kvxfer_backend_and_a_bad_one_is_refused_with_the_caches_kept(
        monkeypatch):
    from kvxfer.device.gather import backend

    caches, _ = _make("attention_bf16_mesh_1x8", seed=40)
    mesh = caches[0].sharding.mesh
    assert backend(mesh) == "numpy"  # auto, on CPUs
    monkeypatch.setenv("KVXFER_BACKEND", "xla")
    assert backend(mesh) == "xla"
    monkeypatch.setenv("KVXFER_BACKEND", "gpu")
    with pytest.raises(InvalidInputError, match="KVXFER_BACKEND must be one of .* got 'gpu'"):
        scatter_blocks(caches, _staging("attention_bf16_mesh_1x8", seed=41, rows=2), [1, 2])
    assert not any(c.is_deleted() for c in caches)


def test_the_old_backend_name_host_still_selects_numpy_with_a_deprecation_warning(monkeypatch):
    from kvxfer.device.gather import backend_setting

    monkeypatch.setenv("KVXFER_BACKEND", "host")
    with pytest.warns(DeprecationWarning, match="KVXFER_BACKEND=host is now KVXFER_BACKEND=numpy"):
        assert backend_setting() == "numpy"
