"""gather_blocks / scatter_blocks on real TPUs: round trip, fingerprints, bandwidth.

Skipped where JAX sees no TPU (see conftest.py). The bandwidth test prints
figures (run with `-s`) and asserts only what does not depend on the machine.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvxfer.gather import check_fingerprints, gather_blocks, scatter_blocks
from kvxfer.layout import CacheLayout


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


def test_round_trip_and_fingerprints_on_tpu():
    mesh = _mesh()
    model = mesh.shape["model"]
    sharding = NamedSharding(mesh, P(None, None, "model"))
    shape = (64, 16, 2 * model, 2, 128)
    source = _random_caches(4, shape, jnp.bfloat16, sharding, seed=0)
    target = _random_caches(4, shape, jnp.bfloat16, sharding, seed=1)
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


def test_gather_bandwidth_on_tpu():
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
