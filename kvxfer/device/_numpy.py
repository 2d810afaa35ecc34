"""The numpy backend (XLA:CPU): numpy copies and hashes on the caches' own buffers.

On XLA:CPU a device buffer is host memory, so copies between the caches and
host arrays are numpy slice copies on views of the buffers themselves
(`buffer_view`), with no dispatch: a scatter into donated caches writes
into the very buffers the returned caches own, and costs what its blocks
cost whatever the size of the caches (an XLA:CPU scatter into a donated
bf16 buffer copies the whole buffer). Each shard's copy, and the hash of the
rows it just copied, is one task on a few threads (`host_threads`). What
numpy cannot do goes through `kvxfer.device._xla`: handing the buffers over
(`own_buffers`, a donated identity) and hashing pieces that are not whole
32-bit words. docs/internals.md has the figures.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from kvxfer.device import _xla
from kvxfer.device._rows import RowCopies
from kvxfer.device.fingerprint import SUMS, combine_sums, fmix32, piece_weights, sums_words, word_sums
from kvxfer.device.layout import CacheLayout
from kvxfer.errors import InvalidInputError

__all__ = ["BufferHashes", "buffer_view", "copy_then_hash", "fingerprint",
           "host_threads", "own_buffers", "run_per_shard", "scatter"]


# The backend: what `kvxfer.device.gather` calls once its inputs are checked.


def scatter(layout: CacheLayout, mesh: Mesh, caches: Sequence[jax.Array],
            host_blocks: Sequence[jax.Array | np.ndarray], ids: np.ndarray, src: np.ndarray,
            fingerprints: bool) -> tuple[list[jax.Array], np.ndarray | None]:
    """Write rows `src` of `host_blocks` into blocks `ids` of the caches' own buffers.

    The caches are donated to an identity (which waits for every pending use of
    the buffers and hands them over without a copy), then written with numpy:
    the buffer pointers do not change. Returns the new caches and, with
    `fingerprints`, the prints of the blocks as they landed.
    """
    hosts = [np.asarray(h) for h in host_blocks]  # before donating: they may be the caches
    threads = host_threads()  # a bad setting is refused before the caches are donated
    hashes = BufferHashes.of(layout, ids) if fingerprints else None
    new = own_buffers(layout, mesh)(list(caches))
    jax.block_until_ready(new)
    copies = RowCopies(ids, src, ids_are_dst=True)
    tasks = []
    for layer, (cache, host) in enumerate(zip(new, hosts)):
        for shard in cache.addressable_shards:  # every replica: each has its own buffer
            view = buffer_view(shard.data)
            tasks.append(functools.partial(
                copy_then_hash, copies, shard, view, host[(slice(None), *shard.index[1:])],
                hashes if shard.replica_id == 0 else None, layer))
    run_per_shard(tasks, threads)
    if not fingerprints:
        return new, None
    if hashes is None:
        return new, fingerprint(layout, mesh, new, ids)
    return new, hashes.result()


def fingerprint(layout: CacheLayout, mesh: Mesh, caches: Sequence[jax.Array],
                ids: np.ndarray) -> np.ndarray:
    """`uint32[num_layers, n, 3]`: the prints of blocks `ids`, summed from the caches' buffers."""
    hashes = BufferHashes.of(layout, ids)
    if hashes is None:
        return np.asarray(_xla.fingerprint_async(layout, mesh, caches, ids))[:, : len(ids)]
    jax.block_until_ready(list(caches))
    run_per_shard([functools.partial(hashes.add, layer, shard, buffer_view(shard.data))
                   for layer, cache in enumerate(caches)
                   for shard in cache.addressable_shards if shard.replica_id == 0])
    return hashes.result()


# Host copies on several threads.
#
# One task per shard: its rows are copied, then hashed by the same thread while
# they are in its core's cache, as other threads copy other shards. numpy's
# copies and `einsum` release the GIL. Tasks touch disjoint buffers and rows;
# `BufferHashes` adds each task's sums under a lock.


_pool: tuple[int, ThreadPoolExecutor] | None = None


_pool_lock = threading.Lock()


def host_threads() -> int:
    """Threads for host copies: `KVXFER_HOST_THREADS`, else this process's cores, at most 8."""
    raw = os.environ.get("KVXFER_HOST_THREADS")
    if raw is not None:
        if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
            raise InvalidInputError(f"KVXFER_HOST_THREADS must be a positive int, got {raw!r}")
        return int(raw)
    return max(1, min(8, len(os.sched_getaffinity(0))))


def run_per_shard(tasks: Sequence[Callable[[], object]], threads: int | None = None) -> None:
    """Run independent per-shard tasks on `threads` host-copy threads (`host_threads()` by
    default) and wait for all of them; the first task's error is raised once every task
    has ended."""
    global _pool
    threads = host_threads() if threads is None else threads
    if threads == 1 or len(tasks) < 2 or getattr(_in_task, "on", False):
        for task in tasks:  # inline; also from inside a task, which would wait on itself
            task()
        return
    with _pool_lock:
        if _pool is None or _pool[0] != threads:
            _pool = (threads, ThreadPoolExecutor(threads, thread_name_prefix="kvxfer-copy"))
        pool = _pool[1]
    futures = [pool.submit(_as_task, task) for task in tasks]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


_in_task = threading.local()


def _as_task(task: Callable[[], object]) -> None:
    _in_task.on = True
    try:
        task()
    finally:
        _in_task.on = False


def _forget_pool() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # a forked child has none of the threads


os.register_at_fork(after_in_child=_forget_pool)


def copy_then_hash(copies: RowCopies, shard: jax.Shard, dst: np.ndarray, src: np.ndarray,
                    hashes: BufferHashes | None, layer: int) -> None:
    copies.copy(shard, dst, src)
    if hashes is not None:  # the shard's buffer: rows just copied, while in this core's cache
        hashes.add(layer, shard, dst if copies.ids_are_dst else src)



def buffer_view(array: jax.Array) -> np.ndarray:
    """A writable numpy view of a single-device CPU array's buffer (C order), no copy.

    The view does not keep `array` alive: the caller does.
    """
    nbytes = array.size * array.dtype.itemsize
    if nbytes == 0:
        return np.empty(array.shape, array.dtype)
    raw = (ctypes.c_char * nbytes).from_address(array.unsafe_buffer_pointer())
    return np.frombuffer(raw, dtype=array.dtype).reshape(array.shape)


class BufferHashes:
    """Fingerprints summed with numpy from the caches' own buffers (XLA:CPU).

    The same values as `kvxfer.device.fingerprint.device_fingerprint`: each shard's piece of a block is
    a run of whole 32-bit words, and `word_sums` sums them against the
    weights of their indices in the whole block (`np.einsum`; an XLA:CPU
    reduction runs slower and materializes the gathered rows). Replicas are
    skipped: `add` is given each `replica_id == 0` shard of each layer once,
    and the shards' sums combine as the device's `psum` (and XOR) do. Only
    for layouts whose pieces are whole words (`of` returns None otherwise).
    """


    def __init__(self, layout: CacheLayout, ids: np.ndarray):
        self.layout, self.ids = layout, ids
        self.sums = np.zeros((layout.num_layers, len(ids), SUMS), np.uint32)
        self._lock = threading.Lock()
        self._plans: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, list | None]] = {}

    @classmethod
    def of(cls, layout: CacheLayout, ids: np.ndarray) -> BufferHashes | None:
        return cls(layout, ids) if sums_words(layout, layout.shard_block_shape[-1]) else None

    def add(self, layer: int, shard: jax.Shard, view: np.ndarray) -> None:
        """Add the words `view` (the shard's buffer) holds of the blocks in `ids`."""
        first, size = shard.index[0].start or 0, view.shape[0]
        plan = self._plans.get((first, size))
        if plan is None:
            local = self.ids.astype(np.int64) - first
            at = np.flatnonzero((local >= 0) & (local < size))
            # In block order, whatever order the ids came in: rows that run together
            # in the buffer are summed as one slice.
            at = at[np.argsort(local[at], kind="stable")]
            held = local[at]
            starts = np.flatnonzero(np.diff(held, prepend=-2) != 1)
            runs = list(zip(starts.tolist(), np.diff(starts, append=len(held)).tolist()))
            plan = self._plans[(first, size)] = (held, at,
                                                 runs if 2 * len(runs) <= len(at) else None)
        held, at, runs = plan
        if not len(at):
            return
        words = view.reshape(size, -1).view(np.uint32)
        weights = piece_weights(self.layout, shard.index[1:])
        got = np.empty((len(at), SUMS), np.uint32)  # in `at`'s order
        if runs is not None:
            for i, n in runs:
                h = int(held[i])
                word_sums(words[h : h + n], weights, out=got[i : i + n])
        else:
            word_sums(words, weights, out=got, rows=held)
        with self._lock:  # shards of one layer are summed on several threads
            total = self.sums[layer, at]
            combine_sums(total, got)
            self.sums[layer, at] = total

    def result(self) -> np.ndarray:
        """`uint32[num_layers, n, 3]`: the fingerprints."""
        return fmix32(self.sums)


@functools.lru_cache(maxsize=64)
def own_buffers(layout: CacheLayout, mesh: Mesh):
    sharding = NamedSharding(mesh, layout.partition_spec())
    return jax.jit(lambda caches: caches, out_shardings=[sharding] * layout.num_layers,
                   donate_argnums=0)
