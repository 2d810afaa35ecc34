"""What tpu-inference's own `TPUConnector` needs on CPU, for `kvxfer bench serve` only.

Not on the default serving path: `general()` installs these only when `TPU_CPU_TPU_CONNECTOR=1`
(scripts/pd-up sets it with `PD_CONNECTOR=tpu`).

- `install_copies()`, a CPU shim like the attention stand-in: the connector moves KV with
  Pallas DMA kernels (`kv_transfer.multi_layer_copy` between device arrays, `copy_to_host` into
  pinned host arrays), which lower only for TPUs. They are replaced by plain JAX with the same
  arguments and results: `multi_layer_copy` copies, per layer, `chunk_sizes[c]` blocks from
  `src_offsets[c]` to `dest_offsets[c]` for each of the first `num_chunks` chunks, in the
  destination arrays (donated); `copy_to_host` puts `src` into `dest`'s sharding.
- `load_before_forward()`, the one patch that changes how the connector runs, named as such in
  the benchmark: vLLM 0.32 calls `start_load_kv` *after* the forward for asynchronous loads
  (`KVConnectorModelRunnerMixin._get_kv_connector_output`, unless the step has synchronous
  loads), while this connector writes the KV it pulled into the caches in `start_load_kv`, so
  D's first forward would read unfilled blocks (seen: 4 of 4 cold prompts decoded differently
  from P alone). The patch marks every step as having synchronous loads, which restores the
  order the connector was written for: loads start before the forward.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager

import jax
import jax.numpy as jnp
from jax import lax


def _copy_chunks(src: jax.Array, dest: jax.Array, src_offsets: jax.Array, dest_offsets: jax.Array,
                 chunk_sizes: jax.Array, num_chunks: jax.Array) -> jax.Array:
    def one_chunk(c, dest):
        def one_block(j, dest):
            row = lax.dynamic_slice_in_dim(src, src_offsets[c] + j, 1, axis=0)
            return lax.dynamic_update_slice_in_dim(dest, row.astype(dest.dtype),
                                                   dest_offsets[c] + j, axis=0)

        return lax.fori_loop(0, chunk_sizes[c], one_block, dest)

    return lax.fori_loop(0, num_chunks, one_chunk, dest)


@functools.partial(jax.jit, donate_argnums=(1,))
def _copy_layers(src, dest, src_offsets, dest_offsets, chunk_sizes, num_chunks):
    return [_copy_chunks(s, d, src_offsets, dest_offsets, chunk_sizes, num_chunks)
            for s, d in zip(src, dest)]


def multi_layer_copy(*, src_array, dest_array, src_offsets, dest_offsets, chunk_sizes,
                     num_chunks=None, **sharding_and_mesh):
    """`tpu_inference.distributed.kv_transfer.multi_layer_copy`, in plain JAX."""
    del sharding_and_mesh  # the jitted copy keeps each array's own sharding
    count = chunk_sizes.shape[0] if num_chunks is None else jnp.reshape(num_chunks, (-1,))[0]
    return _copy_layers(list(src_array), list(dest_array), src_offsets, dest_offsets,
                        chunk_sizes, jnp.asarray(count, jnp.int32))


def copy_to_host(src, dest, mesh=None, sharding_spec=None):
    """`tpu_inference.distributed.kv_transfer.copy_to_host`: `src` into `dest`'s sharding."""
    del mesh, sharding_spec
    return jax.device_put(src, dest.sharding)


def install_copies() -> None:
    from tpu_inference.distributed import kv_transfer

    kv_transfer.multi_layer_copy, kv_transfer.copy_to_host = multi_layer_copy, copy_to_host
    for name in ("tpu_inference.distributed.tpu_connector",
                 "tpu_inference.distributed.tpu_connector_hma"):
        module = sys.modules.get(name)  # imported names bound before this ran
        if module is not None:
            for attr, value in (("multi_layer_copy", multi_layer_copy),
                                ("copy_to_host", copy_to_host)):
                if hasattr(module, attr):
                    setattr(module, attr, value)


def load_before_forward() -> None:
    from vllm.v1.worker import kv_connector_model_runner_mixin as mixin_module

    mixin = mixin_module.KVConnectorModelRunnerMixin
    if getattr(mixin, "_tpu_cpu_loads_first", False):
        return
    original = mixin._get_kv_connector_output.__wrapped__  # the generator under @contextmanager

    @contextmanager
    def loads_first(scheduler_output, defer_finalize=False):
        scheduler_output.has_sync_kv_loads = True  # start_load_kv before the forward
        yield from original(scheduler_output, defer_finalize)

    mixin._get_kv_connector_output = staticmethod(loads_first)
    mixin._tpu_cpu_loads_first = True
