"""gather / scatter / pieces on a real accelerator (TPU or GPU): round trips, fingerprints,
writes in place, bandwidth.

P's save into staging is `gather_piece_into` (a piece of every unit of each block, for
caches in one process: `Piece.local`) into `piece_staging`, and D's load `scatter_piece`;
`gather_blocks` / `scatter_blocks` are the whole-block functional API.

Skipped where JAX's default backend is the CPU (see conftest.py). The bandwidth test
prints figures (run with `-s`) and asserts only what does not depend on the machine;
`kvxfer bench gather` gives the figures against their references.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvxfer.device.gather import (
    backend,
    check_fingerprints,
    fingerprint_blocks,
    gather_blocks,
    scatter_blocks,
)
from kvxfer.device.layout import CacheLayout
from kvxfer.device.pieces import (
    Piece,
    gather_piece_into,
    piece_prints,
    piece_staging,
    precompile_piece,
    scatter_piece,
)
from kvxfer.device.pinned import PinnedRegions


def _mesh():
    n = len(jax.devices())
    model = next(m for m in (8, 4, 2, 1) if n % m == 0)
    return jax.make_mesh((n // model, model), ("data", "model"))


def _random_caches(layers, shape, dtype, sharding, seed):
    udtype = jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")
    make = jax.jit(
        lambda k: lax.bitcast_convert_type(jax.random.bits(k, shape, udtype), dtype),
        out_shardings=sharding,
    )
    return [make(k) for k in jax.random.split(jax.random.key(seed), layers)]


def _pair(layers=4, seed=0):
    mesh = _mesh()
    sharding = NamedSharding(mesh, P(None, None, "model"))
    shape = (64, 16, 2 * mesh.shape["model"], 2, 128)
    return (_random_caches(layers, shape, jnp.bfloat16, sharding, seed),
            _random_caches(layers, shape, jnp.bfloat16, sharding, seed + 1))


def _addresses(caches):
    return [s.data.unsafe_buffer_pointer() for c in caches for s in c.addressable_shards]


def _bits(array):
    return np.asarray(array).view(np.uint16)


def test_the_accelerator_runs_the_xla_backend():
    source, _ = _pair(layers=1)
    assert backend(source[0].sharding.mesh) == "xla"


def test_round_trip_and_fingerprints_on_the_accelerator():
    source, target = _pair()
    ids = [5, 63, 0, 17, 18, 40]
    expected = [np.asarray(t).view(np.uint8).copy() for t in target]
    for exp, src in zip(expected, source):
        exp[ids] = np.asarray(src).view(np.uint8)[ids]

    host, fps = gather_blocks(source, ids, fingerprints=True)
    assert host[0].sharding.memory_kind == "pinned_host"
    check_fingerprints(CacheLayout.from_caches(source), host, len(ids), fps)
    out = scatter_blocks(target, host, ids)
    for o, exp in zip(out, expected):
        np.testing.assert_array_equal(np.asarray(o).view(np.uint8), exp)


def test_scatter_writes_in_place_on_the_accelerator():
    """D's load (`scatter_piece` of P's staged piece of every unit) writes into the donated
    caches' buffers: every shard's address is unchanged, so a load costs its blocks, not a
    copy of the cache; what landed fingerprints as P staged it, as the blocks do."""
    source, target = _pair(seed=4)
    layout, piece = CacheLayout.from_caches(source), Piece.local(source)
    assert (piece.lo, piece.hi) == (0, piece.units)  # one process: every unit
    ids, slots = np.array([3, 9, 10, 11, 60]), np.arange(5) + 2
    staging = piece_staging(layout, piece, 8)
    gather_piece_into(source, ids, staging, slots, piece)
    prints = piece_prints(staging, slots)
    np.testing.assert_array_equal(prints, fingerprint_blocks(source, ids))
    before = _addresses(target)
    out, landed = scatter_piece(target, staging, ids, slots, piece)
    assert _addresses(out) == before
    np.testing.assert_array_equal(landed, prints)
    np.testing.assert_array_equal(fingerprint_blocks(out, ids), prints)
    for o, s in zip(out, source):
        np.testing.assert_array_equal(_bits(o)[ids], _bits(s)[ids])


def test_gather_piece_into_pinned_staging_in_place_on_one_device():
    """P's staging on one device (`piece_staging(..., caches)`) is pinned-host buffers the
    gather writes in place: the donation keeps every address (else the staging is numpy),
    and the bytes and sums are the host-copy path's (numpy staging: the gather to pinned
    host, then a copy), the blocks' bytes unit-major."""
    device = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([[device]]), ("data", "model"))
    sharding = NamedSharding(mesh, P(None, None, "model"))
    source = _random_caches(4, (64, 16, 4, 2, 128), jnp.bfloat16, sharding, seed=11)
    layout, piece = CacheLayout.from_caches(source), Piece.local(source)
    staging = piece_staging(layout, piece, 32, source)
    regions = staging.regions
    assert isinstance(regions, PinnedRegions), \
        "a donated write moved a pinned-host buffer on this device"
    copied = piece_staging(layout, piece, 32)  # numpy: the host-copy path, as reference
    addresses = list(regions.addresses)
    for ids, slots in (([7, 3, 50, 61, 2], [4, 5, 6, 7, 8]), ([9, 8, 1], [20, 0, 1])):
        ids, slots = np.array(ids), np.array(slots)
        before = regions.arrays[0]
        gather_piece_into(source, ids, staging, slots, piece)
        assert before.is_deleted() and regions.addresses == addresses
        gather_piece_into(source, ids, copied, slots, piece)
        np.testing.assert_array_equal(staging.prints[slots], copied.prints[slots])
        np.testing.assert_array_equal(piece_prints(staging, slots), fingerprint_blocks(source, ids))
        for region, copy, cache in zip(regions, copied.regions, source):
            np.testing.assert_array_equal(region.view(np.uint16), copy.view(np.uint16))
            np.testing.assert_array_equal(  # unit-major slots, seen in block order
                np.moveaxis(region, 1, 1 + piece.axis)[slots].view(np.uint16), _bits(cache)[ids])


def test_after_precompile_saves_and_loads_compile_nothing_on_the_accelerator():
    """`precompile_piece` compiles exactly the programs P's saves (`gather_piece_into`) and
    D's loads (`scatter_piece`) run (the same argument types, shardings and memory kinds on
    this backend), on one device (pinned staging) and on the whole mesh; prints how long
    it took."""
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    one = jax.sharding.Mesh(np.array([[jax.devices()[0]]]), ("data", "model"))
    for mesh in (one, _mesh()):
        sharding = NamedSharding(mesh, P(None, None, "model"))
        caches = _random_caches(4, (64, 16, 2 * mesh.shape["model"], 2, 128), jnp.bfloat16,
                                sharding, seed=13)
        piece = Piece.local(caches)
        staging = piece_staging(CacheLayout.from_caches(caches), piece, 32, caches)
        start = time.perf_counter()
        count = precompile_piece(caches, staging, piece, 32, saves=True, loads=True)
        print(f"precompile on {mesh.size} device(s): {count} programs in "
              f"{time.perf_counter() - start:.1f} s")
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            rng = np.random.default_rng(3)
            for n in (1, 2, 3, 7, 8, 9, 16, 31, 32):
                ids, rows = rng.choice(64, n, replace=False), np.arange(n)
                gather_piece_into(caches, ids, staging, rows, piece)
                caches, _ = scatter_piece(caches, staging, ids, rows, piece)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        assert compiles == [], f"{len(compiles)} programs compiled after precompile"


def test_pieces_round_trip_on_the_accelerator_with_matching_sums():
    """Two pieces of one process's devices (as two hosts would hold them): each gathers
    and scatters only its units, and the fingerprints of what landed in D's piece equal
    P's (`piece_prints`, both mixed)."""
    source, target = _pair(seed=7)
    layout = CacheLayout.from_caches(source)
    units = layout.block_shape[1]
    model = source[0].sharding.mesh.shape["model"]
    cut = units // 2 if model > 1 else units
    pieces = [Piece(1, units, 0, cut)] + ([Piece(1, units, cut, units)] if cut < units else [])
    ids = np.array([1, 2, 30, 31, 63])
    for piece in pieces:
        staging = piece_staging(layout, piece, 8)
        gather_piece_into(source, ids, staging, np.arange(5), piece)
        before = _addresses(target)
        target, landed = scatter_piece(target, staging, ids, np.arange(5), piece)
        assert _addresses(target) == before
        np.testing.assert_array_equal(landed, piece_prints(staging, np.arange(5)))
    for o, s in zip(target, source):
        np.testing.assert_array_equal(np.asarray(o)[ids].view(np.uint16),
                                      np.asarray(s)[ids].view(np.uint16))


def test_gather_bandwidth_on_the_accelerator():
    import time

    mesh = _mesh()
    sharding = NamedSharding(mesh, P(None, None, "model"))
    model = mesh.shape["model"]
    layers, shape, count = 8, (1024, 16, model, 2, 128), 256
    caches = _random_caches(layers, shape, jnp.bfloat16, sharding, seed=2)
    ids = np.random.default_rng(0).choice(shape[0], count, replace=False)
    nbytes = layers * count * int(np.prod(shape[1:])) * 2
    timings = {}
    for fingerprints in (False, True):
        jax.block_until_ready(gather_blocks(caches, ids, fingerprints=fingerprints))
        best = float("inf")
        for _ in range(10):
            start = time.perf_counter()
            jax.block_until_ready(gather_blocks(caches, ids, fingerprints=fingerprints))
            best = min(best, time.perf_counter() - start)
        timings[fingerprints] = best
    print(
        f"\ngather to pinned_host: {nbytes / timings[False] / 1e9:.1f} GB/s "
        f"({nbytes / 1e6:.0f} MB, {len(jax.devices())} {jax.devices()[0].device_kind}); "
        f"with fingerprints {nbytes / timings[True] / 1e9:.1f} GB/s, "
        f"overhead {timings[True] / timings[False] - 1:.2f}"
    )
    assert timings[False] > 0
