"""Benchmarks behind `kvxfer bench ...`: each module's `run()` returns a JSON-able dict
of figures, with a reference measured in the same run."""

import statistics
import time
from typing import Any

import numpy as np


def memcpy_gbps(nbytes: int) -> float:
    """numpy's copy of `nbytes` into another buffer, GB/s: median of 5 after a warm-up."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def random_caches(layers: int, block_shape: tuple[int, ...], tp: int, num_blocks: int,
                  seed: int) -> list[Any]:
    """`layers` bf16 caches `[num_blocks, *block_shape]` of random bits on the first `tp`
    devices, heads (axis 2) sharded over `model` of a `(1, tp)` mesh, as tpu-inference's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:tp]).reshape(1, tp), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec(None, None, "model"))
    rng = np.random.default_rng(seed)
    shape = (num_blocks, *block_shape)
    return [jax.device_put(rng.integers(0, 1 << 16, shape, np.uint16).view(jnp.bfloat16),
                           sharding) for _ in range(layers)]
