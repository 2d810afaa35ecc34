"""Staging regions that are pinned-host JAX buffers, which P's gather writes in place.

On the XLA backend a gather lands its blocks in pinned host memory, and
copying them from there into staging NIXL registered is one more host copy
of every byte. Where one device holds a process's piece (one GPU or TPU chip
per process), staging avoids it: each layer's region is a pinned-host
`jax.Array` on that device, `[num_slots, *slot_shape]` of the unsigned type
of the caches' width, allocated here (`pinned_regions`), and P's gather
(`kvxfer.device._xla_pieces`, through `write_chunks`) is a jitted program
that donates the regions and writes its unit-major rows into them with
`dynamic_update_slice` at the slot, which XLA aliases to its output: the
rows go from the device straight into the registered bytes, and every
buffer keeps its address (the form `kvxfer bench gather` measures as
`pinned_*`). The regions are also numpy
arrays over the same bytes (`PinnedRegions` is a sequence of them), so NIXL
registers them, D reads into them and everything else reads them as it
reads any staging.

Why this and not a pool of registered gather outputs: an output registered
per save would cost a NIXL registration (and a handshake of its address)
per step, and its address would have to travel in the params; these regions
are registered once, as numpy staging is, and nothing else changes. Its
cost is one program per power-of-two chunk of each run of slots (`runs`
placement makes a save one or a few runs). Nothing here was measured on an
accelerator yet (`scripts/accel-check` measures it; on XLA:CPU, 8 layers of
128 MiB in all: 5.2 GB/s against 8.6 for a gather into a fresh pinned-host
array).

Donation keeping the address is checked, never assumed: `pinned_regions`
writes once at construction and keeps the regions only if every buffer kept
its address (else it returns None and the caller allocates numpy staging);
every save checks again once its writes are done. A save whose write failed
or moved a buffer raises `TransferError` and leaves the regions `broken` for
good, since their views and NIXL's registration may then name freed memory
(D's fingerprint check refuses whatever it reads there); every later save
raises too. The regions are where JAX's pinned-host allocator put them, not
page-aligned as numpy staging is (NIXL pins the pages they touch).

Where the caches span several devices, each device's rows land in its own
pinned buffer, so a slot would be split across buffers that D cannot read
as one: that needs per-shard regions in the protocol (docs/internals.md),
and there the gather still copies once on the host.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvxfer.device._xla import _uint
from kvxfer.device.staging import check_fits
from kvxfer.errors import TransferError
from kvxfer.plan.blocks import coalesce_pairs

__all__ = ["PinnedRegions", "chunk_sizes", "pinned_regions", "write_chunks", "write_programs"]

logger = logging.getLogger("kvxfer.device.staging")


class PinnedRegions(Sequence[np.ndarray]):
    """One pinned-host region per layer on the one device of `mesh`: the `jax.Array`s
    (`arrays`, replaced by each write with arrays at the same addresses) and, as the
    sequence's items, writable numpy arrays over the same bytes (each keeps these regions
    alive). Once a write fails or moves a buffer the regions are `broken` (the views and
    NIXL's registration may name freed memory): every later write raises."""

    def __init__(self, mesh: Mesh, num_layers: int, shape: tuple[int, ...], dtype: np.dtype):
        self.mesh, self.dtype = mesh, np.dtype(dtype)
        self.device = mesh.devices.flat[0]
        self.sharding = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
        zeros = jax.jit(lambda: jnp.zeros(shape, _uint(self.dtype)),  # touches every page
                        out_shardings=self.sharding)
        self.arrays = [zeros() for _ in range(num_layers)]
        self.addresses = _addresses(self.arrays)
        self.broken: str | None = None
        self._views = [_numpy_over(a, self.dtype, self) for a in self.arrays]

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, layer):  # type: ignore[override]
        return self._views[layer]

    def on_device_of(self, mesh: Mesh) -> bool:
        """Whether a gather from caches on `mesh` can write here: the same one device."""
        return mesh.size == 1 and mesh.devices.flat[0] == self.device

    def write(self, rows: Sequence[tuple[jax.Array, int]]) -> None:
        """Write `rows` (`(stacked rows on the device, first slot)` per chunk) in place, one
        dispatch each; `TransferError` if one fails or moves a buffer (then `broken`)."""
        write = _write_fn(self.sharding, len(self))
        self.run(lambda arrays, stacked, at: (write(arrays, stacked, at), None),
                 [(stacked, jnp.int32(slot)) for stacked, slot in rows])

    def run(self, program: Callable[..., tuple[list[jax.Array], Any]],
            calls: Sequence[tuple[Any, ...]]) -> list[Any]:
        """`arrays, out = program(arrays, *args)` for each `args` of `calls` (a program that
        donates the regions and returns them written); the `out`s. `TransferError` if one
        fails or moves a buffer (then `broken`), checked once all are done."""
        if self.broken:
            raise TransferError(f"P's pinned staging is unusable: {self.broken}")
        outs = []
        try:
            for args in calls:
                self.arrays, out = program(self.arrays, *args)
                outs.append(out)
            jax.block_until_ready(self.arrays)
            moved = _addresses(self.arrays) != self.addresses
        except Exception as e:  # donated, maybe freed: the views may name freed memory
            self.broken = f"a write failed: {e}"
            raise TransferError(f"P's pinned staging: {self.broken}") from e
        if moved:
            self.broken = ("a donated write moved its buffers: NIXL's registration is stale (this "
                           "backend does not alias donated pinned-host buffers here)")
            raise TransferError(f"P's pinned staging: {self.broken}")
        return outs


def pinned_regions(mesh: Mesh, num_layers: int, num_slots: int, block_shape: Sequence[int],
                   dtype: np.dtype) -> PinnedRegions | None:
    """`PinnedRegions` for caches on `mesh`, or None where they cannot be used: a mesh of
    several devices, or a backend on which a donated write moved a buffer (logged).
    Staging larger than this machine's memory is refused by name first."""
    if mesh.size != 1:
        return None
    dtype = np.dtype(dtype)
    check_fits(num_layers * num_slots * math.prod(block_shape) * dtype.itemsize, num_layers,
               num_slots)
    regions = PinnedRegions(mesh, num_layers, (num_slots, *block_shape), dtype)
    probe = jnp.zeros((num_layers, 1, *block_shape), _uint(dtype))
    try:
        regions.write([(jax.device_put(probe, NamedSharding(mesh, PartitionSpec())), 0)])
    except TransferError as e:
        logger.warning("pinned staging not used on %s: %s", regions.device.platform, e)
        return None
    return regions


def write_programs(regions: PinnedRegions, max_blocks: int, take: Callable, args: tuple,
                   ids_at: int, out_on: NamedSharding) -> list[tuple[Callable, tuple]]:
    """`(program, its arguments' types)` of `write_chunks(regions, ..., take, args, ids_at,
    out_on)` for every chunk of up to `max_blocks` rows, to compile
    (`kvxfer.device._xla.compile_all`)."""
    program = _take_and_write_fn(take, ids_at, regions.sharding, out_on, len(regions))
    return [(program, (regions.arrays, args, jax.ShapeDtypeStruct((size,), np.int32),
                       jax.ShapeDtypeStruct((), np.int32)))
            for size in chunk_sizes(min(max_blocks, regions.arrays[0].shape[0]))]


def chunk_sizes(count: int) -> list[int]:
    """Every chunk size a run of 1 to `count` slots is written in (`write_chunks`)."""
    return [1 << bit for bit in range(count.bit_length())]


def write_chunks(regions: PinnedRegions, ids: np.ndarray, dst: np.ndarray, take: Callable,
                 args: tuple, ids_at: int, out_on: NamedSharding) -> list[jax.Array]:
    """Rows `ids` into slots `dst`: per power-of-two chunk of each run where ids' order and
    slots advance together, one program that takes the rows on the device and writes them
    into the donated regions (`take(*args[:ids_at], chunk ids, *args[ids_at:])`, a jitted
    function, returns `(rows per layer, what else it computed)`, the latter placed
    as `out_on`), checked once at the end. Returns what `take` computed besides the rows,
    chunk by chunk, in `ids` order.

    One program, not a take then a write: on an H200, 8 layers of 64 blocks (34 MB) took
    2.35 ms as two programs and 1.32 as one, against 1.17 for `jax.device_put` of the same
    rows (0.50 -> 0.88 of it; 0.80 -> 0.94 at 32 layers of 256 blocks, `scripts/pinned-probe`).
    """
    program = _take_and_write_fn(take, ids_at, regions.sharding, out_on, len(regions))
    calls = [(args, ids[first + start : first + start + size].astype(np.int32),
              jnp.int32(slot + start))
             for first, slot, length in coalesce_pairs(range(len(ids)), dst.tolist())
             for start, size in _chunks(length)]
    return regions.run(program, calls)


def _chunks(length: int) -> list[tuple[int, int]]:
    """`(offset, size)` covering `length` with powers of two, largest first: every size
    compiles once."""
    out, offset = [], 0
    for bit in reversed(range(length.bit_length())):
        if length >> bit & 1:
            out.append((offset, 1 << bit))
            offset += 1 << bit
    return out


@functools.lru_cache(maxsize=64)
def _write_fn(host: NamedSharding, num_layers: int):
    """`rows[l]` into the donated `regions[l]` at slot `at`, through pinned host memory."""

    def write(regions: list[jax.Array], rows: jax.Array, at: jax.Array):
        return [lax.dynamic_update_slice_in_dim(region, jax.device_put(rows[layer], host), at, 0)
                for layer, region in enumerate(regions)]

    return jax.jit(write, donate_argnums=0, out_shardings=[host] * num_layers)


@functools.lru_cache(maxsize=64)
def _take_and_write_fn(take: Callable, ids_at: int, host: NamedSharding, out_on: NamedSharding,
                       num_layers: int):
    """One program: `take`'s rows into the donated regions at slot `at`, and what else it
    computed (`write_chunks`)."""

    def take_and_write(regions: list[jax.Array], args: tuple, ids: jax.Array, at: jax.Array):
        rows, computed = take(*args[:ids_at], ids, *args[ids_at:])
        return [lax.dynamic_update_slice_in_dim(region, jax.device_put(rows[layer], host), at, 0)
                for layer, region in enumerate(regions)], computed

    return jax.jit(take_and_write, donate_argnums=0, out_shardings=([host] * num_layers, out_on))


def _addresses(arrays: Sequence[jax.Array]) -> list[int]:
    return [s.data.unsafe_buffer_pointer() for a in arrays for s in a.addressable_shards]


def _numpy_over(array: jax.Array, dtype: np.dtype, owner: PinnedRegions) -> np.ndarray:
    """A writable numpy array over `array`'s one buffer, keeping `owner` (which holds the
    array written there last) alive."""
    nbytes = array.size * array.dtype.itemsize
    raw = (ctypes.c_uint8 * nbytes).from_address(array.addressable_shards[0].data
                                                 .unsafe_buffer_pointer())
    raw.owner = owner  # type: ignore[attr-defined]
    return np.frombuffer(raw, np.uint8).view(dtype).reshape(array.shape)
