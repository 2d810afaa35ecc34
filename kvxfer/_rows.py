"""Row copies between a shard's block buffer and host rows, as slice copies where rows run
together, and the host threads they run on.

Both backends copy blocks between a device shard's rows and host rows (staging):
the host backend from and into the caches' own buffers, the XLA backend from
its pinned-host gather output into staging. Copies run in destination order,
as slices wherever rows run together in either direction, so a table
allocated from a free list that hands blocks out in descending order (vLLM
frees a request's blocks tail first) copies in runs too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from kvxfer.errors import InvalidInputError

__all__ = ["RowCopies", "host_threads", "run_per_shard", "slice_runs"]


class RowCopies:
    """`dst[to[i]] = src[frm[i]]` for the blocks a shard holds, as slice copies where
    rows run together.

    `ids` are block ids (global), `rows` the matching host rows; `ids_are_dst` says
    which side the shard's buffer is. The rows each block range holds, and their
    runs, are worked out once per call and reused for every layer and inner piece.
    """

    def __init__(self, ids: np.ndarray, rows: np.ndarray, ids_are_dst: bool):
        self.ids, self.rows, self.ids_are_dst = ids, rows, ids_are_dst
        self._plans: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, list | None]] = {}

    def copy(self, shard: jax.Shard, dst: np.ndarray, src: np.ndarray) -> None:
        first, size = shard.index[0].start or 0, shard.data.shape[0]
        plan = self._plans.get((first, size))
        if plan is None:
            local = self.ids - first
            inside = (local >= 0) & (local < size)
            held, rows = local[inside], self.rows[inside]
            to, frm = (held, rows) if self.ids_are_dst else (rows, held)
            runs = slice_runs(frm, to)
            plan = self._plans[(first, size)] = (to, frm, runs if 2 * len(runs) <= len(to)
                                                 else None)
        to, frm, runs = plan
        if not len(to):
            return
        if runs is not None:  # mostly contiguous: no temporary
            for s, d, n in runs:
                if n > 0:
                    dst[d : d + n] = src[s : s + n]
                else:
                    dst[d : d - n] = src[s + n + 1 : s + 1][::-1]
        else:
            dst[to] = src[frm]


def slice_runs(frm: np.ndarray, to: np.ndarray) -> list[tuple[int, int, int]]:
    """`dst[to[i]] = src[frm[i]]` (`to` distinct) as runs `(s, d, n)`: `dst[d:d+|n|]`
    gets rows `s, s+1, ...` of `src` for `n > 0`, rows `s, s-1, ...` for `n < 0`.

    In destination order, so a table allocated from a free list that hands out
    blocks in descending order (vLLM frees a request's blocks tail first) still
    copies in runs.
    """
    order = np.argsort(to, kind="stable")
    runs: list[tuple[int, int, int]] = []
    for d, s in zip(to[order].tolist(), frm[order].tolist()):
        if runs:
            s0, d0, n = runs[-1]
            if d == d0 + abs(n):
                if s == s0 + n and n > 0:
                    runs[-1] = (s0, d0, n + 1)
                    continue
                if s == s0 - abs(n) and (n < 0 or n == 1):
                    runs[-1] = (s0, d0, -abs(n) - 1)
                    continue
        runs.append((s, d, 1))
    return runs


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
