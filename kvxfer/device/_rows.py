"""Row copies between a shard's block buffer and host rows, as slice copies where rows run together.

Both backends copy blocks between a device shard's rows and host rows (staging):
the numpy backend from and into the caches' own buffers, the XLA backend from
its pinned-host gather output into staging. Copies run in destination order,
as slices wherever rows run together in either direction, so a table
allocated from a free list that hands blocks out in descending order (vLLM
frees a request's blocks tail first) copies in runs too.
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["RowCopies", "slice_runs"]


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
