"""Gather whole KV blocks from device caches into host memory, and scatter them back.

    host = gather_blocks(caches, block_ids)
    caches = scatter_blocks(caches, host, block_ids)               # or rows=...
    caches, prints = scatter_blocks(caches, host, block_ids, fingerprints=True)
    prints = fingerprint_blocks(caches, block_ids)

The functional API, for callers that hold their own host arrays; a connector's
staging holds pieces and copies with `kvxfer.device.pieces` (which picks its
backend here: `backend`, `KVXFER_BACKEND`). All take `list[jax.Array]` (one
array per layer, blocks on axis 0, kernel block ids) and do all layers in one
call. Each function checks its inputs, then makes one call into the backend
`backend(mesh)` picks: `kvxfer.device._xla` (jitted `shard_map` programs; TPU,
GPU) or `kvxfer.device._numpy` (numpy on the caches' own buffers; XLA:CPU).
`gather_blocks` is always the XLA program: its output is new pinned-host
arrays. A scatter writes into the donated caches' own buffers on both, so it
costs what its blocks cost whatever the size of the caches. Fingerprints
(`kvxfer.device.fingerprint`) are per whole block and independent of
sharding, so D (TP 8) checks P's (TP 4) on its own devices.
docs/internals.md has the measurements behind these choices.
"""

from __future__ import annotations

import numbers
import os
import warnings
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from kvxfer.device import _numpy, _xla, pinned
from kvxfer.device._numpy import host_threads
from kvxfer.device._xla import MIN_BUCKET, bucket_size
from kvxfer.device.fingerprint import SUMS, compare_fingerprints, host_fingerprint
from kvxfer.device.layout import CacheLayout
from kvxfer.errors import InvalidInputError, LayoutMismatchError
from kvxfer.plan.blocks import is_int

__all__ = ["MIN_BUCKET", "GatheredBlocks", "ScatteredBlocks", "backend", "backend_for", "backend_setting",
           "block_fingerprints", "bucket_size", "check_fingerprints", "compare_fingerprints",
           "fingerprint_blocks", "gather_blocks", "gather_into", "host_threads", "precompile",
           "scatter_blocks",
           "staging_regions"]

BACKENDS = ("auto", "xla", "numpy")
"""What `KVXFER_BACKEND` may say: `auto` (the default: `numpy` where every device of the
mesh is a CPU, else `xla`), `xla` or `numpy` (XLA:CPU only). `host`, its name before
2026-12-06, is read as `numpy` with a `DeprecationWarning`."""


def backend_setting() -> str:
    """`KVXFER_BACKEND` (default `auto`), checked: the one place it is read."""
    choice = os.environ.get("KVXFER_BACKEND", "auto")
    if choice == "host":
        warnings.warn("KVXFER_BACKEND=host is now KVXFER_BACKEND=numpy ('host' names a "
                      "machine in kvxfer); 'host' still selects it for now",
                      DeprecationWarning, stacklevel=2)
        return "numpy"
    if choice not in BACKENDS:
        raise InvalidInputError(f"KVXFER_BACKEND must be one of {BACKENDS}, got {choice!r}")
    return choice


def backend(mesh: Mesh) -> str:
    """The backend that copies for caches on `mesh`: `"xla"` or `"numpy"`.

    Raises `InvalidInputError` naming a bad `KVXFER_BACKEND`, or `numpy` for a mesh that
    is not on CPUs.
    """
    return backend_for(d.platform for d in mesh.devices.flat)


def backend_for(platforms: Iterable[str]) -> str:
    """`backend`, for devices of these platforms."""
    choice = backend_setting()
    platforms = sorted(set(platforms))
    if choice == "auto":
        return "numpy" if platforms == ["cpu"] else "xla"
    if choice == "numpy" and platforms != ["cpu"]:
        raise InvalidInputError(f"KVXFER_BACKEND=numpy copies on XLA:CPU buffers only; the "
                                f"caches are on {platforms}")
    return choice


def staging_regions(mesh: Mesh, num_layers: int, num_slots: int, block_shape: Sequence[int],
                    dtype: np.dtype) -> pinned.PinnedRegions | None:
    """The block regions of staging for caches on `mesh`: pinned-host buffers that the XLA
    backend's gather writes in place where `mesh` is one device (`kvxfer.device.pinned`),
    else None (numpy regions: the numpy backend copies into them itself)."""
    if not isinstance(mesh, Mesh):
        raise InvalidInputError(f"staging_regions mesh must be a jax.sharding.Mesh, got "
                                f"{mesh!r:.80}")
    for name, value in (("num_layers", num_layers), ("num_slots", num_slots)):
        if not is_int(value) or value <= 0:
            raise InvalidInputError(f"staging_regions {name} must be a positive int, got "
                                    f"{value!r}")
    if backend(mesh) != "xla":
        return None
    return pinned.pinned_regions(mesh, num_layers, num_slots, block_shape, dtype)


def _backend(mesh: Mesh) -> ModuleType:
    return _numpy if backend(mesh) == "numpy" else _xla


class GatheredBlocks(NamedTuple):
    """What `gather_blocks(..., fingerprints=True)` returns.

    - `blocks`: per layer, `[bucket, *block_shape]` in pinned host memory.
    - `fingerprints`: `uint32[num_layers, bucket, 3]` in pinned host memory.
    """

    blocks: list[jax.Array]
    fingerprints: jax.Array


class ScatteredBlocks(NamedTuple):
    """What `scatter_blocks(..., fingerprints=True)` returns.

    - `caches`: the new caches.
    - `fingerprints`: `uint32[num_layers, n, 3]`, of the blocks as they are in the new
      caches (what `fingerprint_blocks(caches, block_ids)` gives).
    """

    caches: list[jax.Array]
    fingerprints: np.ndarray


def gather_blocks(
    caches: Sequence[jax.Array],
    block_ids: Sequence[int] | np.ndarray | jax.Array,
    *,
    fingerprints: bool = False,
) -> list[jax.Array] | GatheredBlocks:
    """Copy the given blocks of every layer into pinned host memory, in one dispatch.

    **Arguments:**

    - `caches`: one array per layer, `[num_blocks, *block_shape]`, all with the same
      shape, dtype and `NamedSharding`. Not modified.
    - `block_ids`: 1-D integer kernel block ids, `[n]`, each in `[0, num_blocks)`.
      Repeats are allowed.
    - `fingerprints`: also return per-block fingerprints (independent of sharding).

    **Returns:**

    Per layer, a `[bucket_size(n), *block_shape]` array with memory kind
    `"pinned_host"`, on the caches' mesh with their `PartitionSpec` on the inner axes
    and axis 0 unsharded. Rows `0..n-1` are the requested blocks in order; later rows
    are bucket padding (copies of the last requested block). With
    `fingerprints=True`, a `GatheredBlocks(blocks, fingerprints)` instead.

    Raises `InvalidInputError` (or its subclass `LayoutMismatchError`) naming the
    offending value before anything is dispatched.
    """
    check_flag("fingerprints", fingerprints)
    layout = CacheLayout.from_caches(caches)
    ids = check_block_ids(block_ids, layout)
    out = _xla.gather(layout, caches[0].sharding.mesh, caches, ids, fingerprints)
    if fingerprints:
        return GatheredBlocks(*out)
    return out


def scatter_blocks(
    caches: Sequence[jax.Array],
    host_blocks: Sequence[jax.Array | np.ndarray],
    block_ids: Sequence[int] | np.ndarray | jax.Array,
    *,
    rows: Sequence[int] | np.ndarray | None = None,
    fingerprints: bool = False,
) -> list[jax.Array] | ScatteredBlocks:
    """Write blocks into the caches in place; the input caches are donated.

    **Arguments:**

    - `caches`: one array per layer, `[num_blocks, *block_shape]`, as for
      `gather_blocks`. Donated: do not use them after the call.
    - `host_blocks`: one array per layer, `[num_rows, *block_shape]`, of the caches'
      dtype (a `gather_blocks` result, numpy arrays, or staging regions).
    - `block_ids`: 1-D integer kernel block ids, `[n]`, distinct, each in
      `[0, num_blocks)`.
    - `rows`: which row of `host_blocks` goes to each block id, `[n]`, each in
      `[0, num_rows)`; by default rows `0..n-1`. Row `rows[i]` of each layer goes to
      block `block_ids[i]`.
    - `fingerprints`: also return the fingerprints of the blocks as they landed in
      the caches (D's check against the sender's). On XLA:CPU each block's rows are
      summed right after they are written, while they are in the processor's cache,
      which costs less than a separate `fingerprint_blocks`.

    **Returns:**

    The new caches, same shapes and shardings, with those blocks replaced and every
    other block unchanged (with `fingerprints=True`, a `ScatteredBlocks(caches,
    fingerprints)`). They hold the donated inputs' buffers: the cost is that of
    the `n` blocks, whatever the caches' size (see the module docstring). One
    exception on XLA:CPU: caches whose buffers JAX shares with a numpy array
    (`jax.device_put` of an aligned numpy array may not copy) cannot be donated, so
    the first scatter into them copies them once; later ones are in place.

    Raises `InvalidInputError` (or `LayoutMismatchError`) naming the offending value
    before anything is dispatched.
    """
    check_flag("fingerprints", fingerprints)
    layout = CacheLayout.from_caches(caches)
    ids = check_block_ids(block_ids, layout)
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise InvalidInputError(
            f"block_ids to scatter must be distinct; repeated: {uniq[counts > 1].tolist()}"
        )
    num_rows = _check_host_blocks(host_blocks, layout, 0 if rows is not None else len(ids))
    src = np.arange(len(ids)) if rows is None else _check_rows(rows, len(ids), num_rows)
    if len(ids) == 0:
        new = list(caches)
        return ScatteredBlocks(new, np.zeros((layout.num_layers, 0, SUMS), np.uint32)) \
            if fingerprints else new
    new, prints = _backend(caches[0].sharding.mesh).scatter(
        layout, caches[0].sharding.mesh, caches, host_blocks, ids, src, fingerprints)
    return ScatteredBlocks(new, prints) if fingerprints else new


def gather_into(
    caches: Sequence[jax.Array],
    block_ids: Sequence[int] | np.ndarray | jax.Array,
    regions: Sequence[np.ndarray],
    rows: Sequence[int] | np.ndarray,
) -> np.ndarray:
    """Deprecated: copy whole blocks into rows of existing host arrays, with their
    fingerprints (`uint32[num_layers, n, 3]`). Staging holds pieces now
    (`kvxfer.device.pieces.gather_piece_into`); this is `gather_blocks` then a host copy.

    `regions`: one writable numpy array per layer, `[num_rows, *block_shape]`; `rows`: the
    distinct row each block goes to.
    """
    warnings.warn("kvxfer.device.gather.gather_into is deprecated: staging holds pieces "
                  "(kvxfer.device.pieces.gather_piece_into)", DeprecationWarning, stacklevel=2)
    layout = CacheLayout.from_caches(caches)
    ids = check_block_ids(block_ids, layout)
    num_rows = _check_host_blocks(regions, layout, 0, "regions")
    dst = _check_rows(rows, len(ids), num_rows)
    if len(np.unique(dst)) != len(dst):
        raise InvalidInputError(f"rows to gather into must be distinct, got {dst.tolist()[:16]}")
    for i, region in enumerate(regions):
        if not isinstance(region, np.ndarray) or not region.flags.writeable:
            raise InvalidInputError(f"regions[{i}] must be a writable numpy array")
    if len(ids) == 0:
        return np.zeros((layout.num_layers, 0, SUMS), np.uint32)
    blocks, prints = _xla.gather(layout, caches[0].sharding.mesh, caches, ids, True)
    for region, gathered in zip(regions, blocks):
        region[dst] = np.asarray(gathered)[: len(ids)]
    return np.asarray(prints)[:, : len(ids)]


def precompile(caches: Sequence[jax.Array], regions: Sequence[np.ndarray], max_blocks: int,
               *, saves: bool, loads: bool, fingerprints: bool = True) -> int:
    """Compile, without running anything, every program that `gather_blocks(caches, ...,
    fingerprints=True)` (`saves`) and `scatter_blocks(caches, regions, ..., fingerprints=)`
    (`loads`) run for 1 to `max_blocks` blocks; returns how many were compiled.

    XLA compiles a program per shape, and each new block count (bucket, or
    chunk for pinned staging) would otherwise compile on the transfer path: on
    XLA:CPU about 0.6-1.2 s at the first save of each size (`kvxfer bench
    gather` counts them). A connector calls it once at start-up (its
    `precompile` setting). 0 on the numpy backend, which compiles nothing.
    """
    layout = CacheLayout.from_caches(caches)
    check_precompile_args(max_blocks, saves=saves, loads=loads, fingerprints=fingerprints)
    _check_host_blocks(regions, layout, 0, "regions")
    mesh = caches[0].sharding.mesh
    if backend(mesh) != "xla":
        return 0
    return _xla.precompile(layout, mesh, caches, max_blocks, saves, loads, fingerprints)


def fingerprint_blocks(
    caches: Sequence[jax.Array], block_ids: Sequence[int] | np.ndarray | jax.Array
) -> np.ndarray:
    """Fingerprints of blocks as they are in the caches, computed where they are.

    `uint32[num_layers, n, 3]`, the values `gather_blocks(...,
    fingerprints=True)` gives for the same bytes: D checks the blocks it wrote
    against P's fingerprints with it, after the scatter.
    """
    layout = CacheLayout.from_caches(caches)
    ids = check_block_ids(block_ids, layout)
    mesh = caches[0].sharding.mesh
    return _backend(mesh).fingerprint(layout, mesh, caches, ids)


def block_fingerprints(
    layout: CacheLayout, host_blocks: Sequence[jax.Array | np.ndarray], count: int
) -> np.ndarray:
    """Fingerprints of the first `count` rows of host blocks, computed with numpy.

    Gives the same values as `gather_blocks(..., fingerprints=True)` computes on
    device, from the block bytes alone.

    **Arguments:**

    - `layout`: the layout the blocks were gathered with (it says how a block is cut
      into shards).
    - `host_blocks`: one array per layer, `[rows, *block_shape]`, `rows >= count`.
    - `count`: how many leading rows are real blocks.

    **Returns:**

    `uint32[num_layers, count, 3]`.
    """
    count = _check_count(count)
    _check_host_blocks(host_blocks, layout, count)
    return np.stack([host_fingerprint(layout, np.asarray(h)[:count]) for h in host_blocks])


def check_fingerprints(
    layout: CacheLayout,
    host_blocks: Sequence[jax.Array | np.ndarray],
    count: int,
    expected: jax.Array | np.ndarray,
) -> None:
    """Raise `CorruptionError` unless received blocks match the sender's fingerprints.

    **Arguments:**

    - `layout`: the sender's layout (checked compatible before the transfer).
    - `host_blocks`: one array per layer, `[rows, *block_shape]`, `rows >= count`, as
      received.
    - `count`: how many leading rows are real blocks.
    - `expected`: `uint32[num_layers, rows', 3]`, `rows' >= count`, the
      fingerprints `gather_blocks` returned at the source.

    The error names the first mismatching layer and block row.
    """
    count = _check_count(count)
    expected = np.asarray(expected)
    if (expected.ndim != 3 or expected.shape[0] != layout.num_layers
            or expected.shape[1] < count or expected.shape[2] != SUMS):
        raise InvalidInputError(
            f"expected fingerprints have shape {expected.shape}; need "
            f"[{layout.num_layers}, >= {count}, {SUMS}]"
        )
    compare_fingerprints(block_fingerprints(layout, host_blocks, count), expected[:, :count])


def check_block_ids(block_ids: object, layout: CacheLayout) -> np.ndarray:
    ids = np.asarray(block_ids)
    if ids.ndim != 1:
        raise InvalidInputError(f"block_ids must be 1-D, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise InvalidInputError(f"block_ids must be integers, got dtype {ids.dtype}")
    ids = ids.astype(np.int64)
    bad = ids[(ids < 0) | (ids >= layout.num_blocks)]
    if bad.size:
        raise InvalidInputError(
            f"block ids {bad[:8].tolist()} out of range [0, {layout.num_blocks})"
        )
    return ids.astype(np.int32)


def check_precompile_args(max_blocks: object, **flags: object) -> None:
    """`precompile`'s (and `precompile_piece`'s) count and flags, refused by name."""
    if not is_int(max_blocks) or max_blocks <= 0:
        raise InvalidInputError(f"precompile max_blocks must be a positive int, got {max_blocks!r}")
    for name, value in flags.items():
        check_flag(name, value)


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be True or False, got {value!r:.80}")


def _check_count(count: object) -> int:
    """`count` as an int: it must be a non-negative integer (numpy ones too), not a bool."""
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
        raise InvalidInputError(f"count must be a non-negative int, got {count!r}")
    return int(count)


def _check_rows(rows: object, count: int, num_rows: int) -> np.ndarray:
    """`rows` as int64 `[count]`, each in `[0, num_rows)`."""
    arr = np.asarray(rows)
    if arr.shape != (count,) or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidInputError(
            f"rows must hold one integer per block id ({count}), got {np.asarray(rows).tolist()!r:.80}")
    arr = arr.astype(np.int64)
    bad = arr[(arr < 0) | (arr >= num_rows)]
    if bad.size:
        raise InvalidInputError(f"rows {bad[:8].tolist()} out of range [0, {num_rows})")
    return arr


def _check_host_blocks(host_blocks: object, layout: CacheLayout, count: int,
                       name: str = "host_blocks") -> int:
    """Check per-layer host arrays of at least `count` rows; returns their row count."""
    if isinstance(host_blocks, (jax.Array, np.ndarray)) or not isinstance(host_blocks, Sequence):
        raise InvalidInputError(
            f"{name} must be a list of per-layer arrays, got {type(host_blocks).__name__}"
        )
    if len(host_blocks) != layout.num_layers:
        raise LayoutMismatchError(
            f"{name} has {len(host_blocks)} layers; the caches have {layout.num_layers}"
        )
    for i, h in enumerate(host_blocks):
        if isinstance(h, jax.Array) and h.is_deleted():
            raise InvalidInputError(
                f"{name}[{i}] was deleted (donated to an earlier call); pass live arrays"
            )
        shape, dtype = tuple(getattr(h, "shape", ())), np.dtype(getattr(h, "dtype", object))
        if len(shape) != len(layout.shape) or shape[1:] != layout.block_shape:
            raise LayoutMismatchError(
                f"{name}[{i}] has shape {shape}; blocks have shape {layout.block_shape}"
            )
        if dtype != layout.np_dtype:
            raise LayoutMismatchError(
                f"{name}[{i}] has dtype {dtype}; the caches have {layout.dtype}"
            )
        if shape[0] < count:
            raise InvalidInputError(
                f"{name}[{i}] has {shape[0]} rows, fewer than the {count} block ids"
            )
    rows = {int(h.shape[0]) for h in host_blocks}
    if len(rows) > 1:
        raise LayoutMismatchError(f"{name} have different row counts per layer: {rows}")
    return rows.pop()
