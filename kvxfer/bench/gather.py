"""Benchmark of `kvxfer.device.gather.gather_blocks` against memcpy of the same bytes.

`run()` builds per-layer caches on a `('data', 'model')` mesh sharded
`P(None, None, 'model')`, gathers random block ids to pinned host memory and
reports bandwidths as ratios against numpy memcpy of the same number of bytes,
measured in the same run (interleaved with the gathers, best of `iters`), so
the figures mean something on a shared, noisy machine. `kvxfer bench gather
--json` prints the returned dict.

Two gathers are timed. `gather_blocks` is the jitted program (to pinned host
arrays; its fingerprints are XLA's, which is what other backends run).
`gather_into` is what P's connector runs, `gather_piece_into` of every unit of
each block into staging (`kvxfer.device.pieces`): on XLA:CPU the units are
copied with numpy straight into staging rows and summed in the same pass; on an
accelerator, the jitted gather then a host copy into staging.

On an accelerator (`scripts/accel-check`) two more figures matter, both
measured here on every backend: `jax.device_put` of the same bytes, already on
the device, to pinned host (what the device-to-host link gives, with no gather),
and P's gather into pinned staging on one device, which removes that host
copy (`pinned_*`, `kvxfer.device.pinned`; `pinned_in_place` says whether
it ran in place: on the XLA backend, where every buffer kept its address).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvxfer.device.gather import bucket_size, gather_blocks
from kvxfer.device.layout import CacheLayout
from kvxfer.device.pieces import Piece, gather_piece_into, piece_staging
from kvxfer.device.pinned import PinnedRegions
from kvxfer.errors import InvalidInputError

__all__ = ["run"]

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def run(
    layers: int = 8,
    num_blocks: int = 1024,
    block_shape: tuple[int, ...] = (16, 8, 2, 128),
    dtype: str = "bfloat16",
    count: int = 256,
    mesh_shape: tuple[int, int] | None = None,
    iters: int = 10,
    seed: int = 0,
    recompile_trials: int = 100,
) -> dict[str, float | int]:
    """Measure gather bandwidth, recompiles and fingerprint cost.

    **Arguments:**

    - `layers`, `num_blocks`, `block_shape`, `dtype`: the caches,
      `layers x [num_blocks, *block_shape]`. `block_shape[1]` is sharded over `'model'`.
    - `count`: how many random distinct block ids each timed gather copies.
    - `mesh_shape`: the `('data', 'model')` mesh; needs that many JAX devices. By default
      `(1, m)`, `m` the most of 8, 4, 2, 1 that the devices and `block_shape[1]` allow.
    - `iters`: timed rounds; each figure is the best round.
    - `seed`: for the cache contents and block ids.
    - `recompile_trials`: gathers with random counts in `[1, count]` after warm-up,
      over which compilations are counted.

    **Returns:**

    A dict: `gather_gbps`, `memcpy_gbps` (numpy `copyto` of the same bytes),
    `gather_over_memcpy`, `naive_over_memcpy` (per layer: jitted take, `device_get`,
    numpy scatter into a host mirror of the cache, the shape of vLLM's TPU path),
    `recompiles_after_warmup` (backend compilations during the trials),
    `fingerprint_overhead` (extra time of `fingerprints=True`, as a fraction),
    `gather_into_over_memcpy` (P's path into staging, fingerprints included),
    `gather_over_device_put` (against `device_put_gbps`), `pinned_over_device_put`,
    `pinned_over_gather_into` and `pinned_in_place` (pinned staging, above), plus `bytes`
    copied per gather, `platform`, `devices`, `naive_gbps`, `gather_into_gbps` and
    `pinned_gbps`.
    """
    if mesh_shape is None:
        model = next(m for m in (8, 4, 2, 1)
                     if len(jax.devices()) % m == 0 and block_shape[1] % m == 0)
        mesh_shape = (1, model)
    if (len(mesh_shape) != 2 or mesh_shape[0] * mesh_shape[1] > len(jax.devices())
            or block_shape[1] % mesh_shape[1]):
        raise InvalidInputError(
            f"mesh_shape must be (data, model) with data * model <= {len(jax.devices())} "
            f"devices and model dividing block_shape[1] = {block_shape[1]}, got {mesh_shape}")
    mesh = jax.make_mesh(mesh_shape, ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec(None, None, "model"))
    caches = _random_caches(layers, (num_blocks, *block_shape), np.dtype(dtype), sharding, seed)
    rng = np.random.default_rng(seed)
    ids = rng.choice(num_blocks, size=count, replace=False).astype(np.int32)
    nbytes = layers * count * int(np.prod(block_shape)) * np.dtype(dtype).itemsize

    pinned = _Pinned(caches, count, lambda one_device: _random_caches(
        layers, (num_blocks, *block_shape), np.dtype(dtype), one_device, seed))
    timed = _timed(caches, ids, nbytes, sharding, pinned)
    for fn in timed.values():  # warm-up: compile, fault in pages
        jax.block_until_ready(fn())
    best = {name: float("inf") for name in timed}
    for _ in range(iters):  # interleaved, so load from other processes hits all alike
        for name, fn in timed.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            best[name] = min(best[name], time.perf_counter() - start)

    recompiles = _count_recompiles(caches, num_blocks, count, recompile_trials, rng)
    gbps = {name: nbytes / t / 1e9 for name, t in best.items()}
    return {
        "gather_gbps": gbps["gather"],
        "memcpy_gbps": gbps["memcpy"],
        "gather_over_memcpy": gbps["gather"] / gbps["memcpy"],
        "naive_over_memcpy": gbps["naive"] / gbps["memcpy"],
        "recompiles_after_warmup": recompiles,
        "fingerprint_overhead": (best["gather_fp"] - best["gather"]) / best["gather"],
        "bytes": nbytes,
        "naive_gbps": gbps["naive"],
        "gather_into_gbps": gbps["gather_into"],
        "gather_into_over_memcpy": gbps["gather_into"] / gbps["memcpy"],
        "device_put_gbps": gbps["device_put"],
        "gather_over_device_put": gbps["gather"] / gbps["device_put"],
        "pinned_gbps": gbps["pinned"],
        "pinned_over_device_put": gbps["pinned"] / gbps["device_put"],
        "pinned_over_gather_into": gbps["pinned"] / gbps["gather_into"],
        "pinned_in_place": pinned.in_place,
        "platform": jax.devices()[0].platform,
        "devices": mesh.size,
    }


def _random_caches(
    layers: int, shape: tuple[int, ...], dtype: np.dtype, sharding: NamedSharding, seed: int
) -> list[jax.Array]:
    """Random bit patterns (NaN payloads included), generated on device."""
    udtype = np.dtype(f"uint{8 * dtype.itemsize}")

    def bits(key: jax.Array) -> jax.Array:
        return lax.bitcast_convert_type(jax.random.bits(key, shape, udtype), jnp.dtype(dtype))

    make = jax.jit(bits, out_shardings=sharding)
    keys = jax.random.split(jax.random.key(seed), layers)
    return [make(k) for k in keys]


def _timed(caches: list[jax.Array], ids: np.ndarray, nbytes: int, sharding: NamedSharding,
           pinned: _Pinned) -> dict[str, Callable[[], object]]:
    """What `run` times, by name: memcpy of the same bytes, the gathers, and the references."""
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    naive = _naive_path(caches, sharding)
    count = len(ids)
    piece = Piece.local(caches)
    staging = piece_staging(CacheLayout.from_caches(caches), piece, count)  # numpy
    rows = np.arange(count)
    on_device = _gathered_on_device(caches, ids, sharding)
    to_host = sharding.with_memory_kind("pinned_host")
    return {
        "memcpy": lambda: np.copyto(dst, src),
        "gather": lambda: gather_blocks(caches, ids),
        "gather_fp": lambda: gather_blocks(caches, ids, fingerprints=True),
        "naive": lambda: naive(ids),
        "gather_into": lambda: gather_piece_into(caches, ids, staging, rows, piece),
        "device_put": lambda: jax.device_put(on_device, to_host),
        "pinned": lambda: pinned(ids),
    }


class _Pinned:
    """P's gather into pinned staging on one device (`kvxfer.device.pinned`): the caches
    (or, made by `remake` on their first device, the same bits), into one run of slots at
    an offset in staging of twice as many. `in_place`: every call took the in-place path (False where
    `pinned_regions` refused the regions, or the numpy backend copies)."""

    def __init__(self, caches: list[jax.Array], count: int,
                 remake: Callable[[NamedSharding], list[jax.Array]]):
        mesh = caches[0].sharding.mesh
        if mesh.size != 1:  # made there: resharding 8 ways onto one device is slow on CPU
            mesh = Mesh(mesh.devices.reshape(-1)[:1].reshape(1, 1), ("data", "model"))
            caches = remake(NamedSharding(mesh, PartitionSpec()))
        self.caches, self.piece = caches, Piece.local(caches)
        self.staging = piece_staging(CacheLayout.from_caches(caches), self.piece, 2 * count,
                                     caches)
        self.regions = self.staging.regions
        self.slots = np.arange(count) + count // 2
        self.in_place = isinstance(self.regions, PinnedRegions)

    def __call__(self, ids: np.ndarray) -> None:
        arrays = getattr(self.regions, "arrays", None)
        gather_piece_into(self.caches, ids, self.staging, self.slots, self.piece)
        self.in_place &= arrays is not None and all(a.is_deleted() for a in arrays)


def _gathered_on_device(caches: list[jax.Array], ids: np.ndarray,
                        sharding: NamedSharding) -> list[jax.Array]:
    """The gathered blocks, per layer, as device arrays: what `device_put` then moves."""
    take = jax.jit(lambda c, i: jnp.take(c, i, axis=0), out_shardings=sharding)
    device_ids = jax.device_put(ids, NamedSharding(sharding.mesh, PartitionSpec()))
    return [take(c, device_ids) for c in caches]


def _naive_path(caches: list[jax.Array], sharding: NamedSharding) -> Callable[[np.ndarray], None]:
    """Per layer: gather on device, `device_get`, numpy scatter into a host mirror."""
    mirror = [np.empty(c.shape, c.dtype) for c in caches]
    take = jax.jit(lambda c, i: jnp.take(c, i, axis=0, mode="clip"))
    ids_sharding = NamedSharding(sharding.mesh, PartitionSpec())

    def copy(ids: np.ndarray) -> None:
        device_ids = jax.device_put(ids, ids_sharding)
        for cache, host in zip(caches, mirror):
            host[ids] = jax.device_get(take(cache, device_ids))

    return copy


def _count_recompiles(
    caches: list[jax.Array], num_blocks: int, count: int, trials: int, rng: np.random.Generator
) -> int:
    """Backend compilations over `trials` gathers of random counts, after one per bucket."""
    n = 1
    while True:  # warm-up: one gather per bucket up to count's
        gather_blocks(caches, np.arange(n) % num_blocks)
        if bucket_size(n) >= bucket_size(count):
            break
        n = bucket_size(n) + 1
    compiles = 0

    def listener(event: str, duration: float, **kwargs: object) -> None:
        nonlocal compiles
        if event == _COMPILE_EVENT:
            compiles += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for _ in range(trials):
            k = int(rng.integers(1, count + 1))
            ids = rng.choice(num_blocks, size=k, replace=k > num_blocks)
            jax.block_until_ready(gather_blocks(caches, ids))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return compiles
