"""D's loads: where each block P sends lands in D's caches, and which loads are under way.

A `Load` is one request D reads: per group, P's kernel positions (its staging keys),
the D kernel ids they land in (the same position of D's block table,
`kvxfer.plan.blocks.kernel_placement`), and D's logical ids, which a failure reports.
`Load.read` checks P's parsed params against D's table and places every block before
anything is read; `Load.stream` reserves every entry of D's table past what D holds
for a stream, whose blocks P names only as it goes and `Load.arrived` places as they
come. `Loads` holds the loads under way, so that no two write one D block. Pure: no
transport and no caches (`decode.py` drives those), so a bad table or a block D
cannot place fails the request (`InvalidInputError`) before any read starts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvxfer.connector.scheduler import LoadRequest
from kvxfer.device.layout import CacheLayout
from kvxfer.errors import InvalidInputError
from kvxfer.nixl.wire import ReadParams
from kvxfer.plan.blocks import NULL_BLOCK, is_int, kernel_placement, table_entries

__all__ = ["Load", "Loads", "kernel_hashes", "table_ids"]


@dataclass
class Load:
    """One request's blocks, per group: P's kernel positions (`keys`; a stream's: those
    arrived so far) and D's kernel ids they land in (`kernel_ids`, aligned with `keys`);
    D's logical ids of every group (what a failure reports); the kernel ids per group it
    may write, no other load's (`reserved`; a read's are its `kernel_ids`); and a
    stream's D table per group, to place its blocks as they arrive (`tables`)."""

    keys: list[list[int]]
    kernel_ids: list[list[int]]
    logical_ids: list[int]
    reserved: list[list[int]] = field(default_factory=list)
    tables: list[list[int]] | None = None
    need: list[tuple[int, int]] | None = None  # per group, the table entries it must cover

    def uncovered(self, layouts: Sequence[CacheLayout], req_id: str) -> str | None:
        """Why this load leaves out a block of D's table it must load (`LoadRequest.need`):
        the table entries of the first group short of one; None where it covers them all."""
        for g, ((lo, hi), keys, layout) in enumerate(zip(self.need or (), self.keys, layouts)):
            r, named = layout.kernel_ratio, set(keys)
            missing = [i for i in range(lo, hi) if any(i * r + j not in named for j in range(r))]
            if missing:
                return (f"request {req_id!r} group {g}: its params name no block for table "
                        f"entries {missing[:8]}{'...' if len(missing) > 8 else ''} of the "
                        f"{hi - lo} D loads ({lo} to {hi - 1}); not loading them would leave "
                        f"them whatever D's blocks held before")
        return None

    @classmethod
    def read(cls, layouts: Sequence[CacheLayout], req_id: str, request: LoadRequest,
             params: ReadParams) -> tuple[ReadParams, Load]:
        """The load of P's finished `params` (`LoadRequest.parse_params`) into D's table:
        the params to read (without the blocks D already holds) and the load;
        `InvalidInputError` where the params are for another prompt or D's table cannot
        hold a block P sends."""
        if request.prompt is not None and params.prompt != request.prompt:
            raise InvalidInputError(
                f"request {req_id!r}: its params are for "
                f"{'another prompt' if params.prompt else 'a prompt P was not given'}; D's "
                f"prompt differs from the one P computed")
        tables, have = _tables(layouts, req_id, request)
        upto = request.upto
        if upto is not None and (not isinstance(upto, (list, tuple)) or len(upto) != len(layouts)
                                 or not all(is_int(u) and u >= 0 for u in upto)):
            raise InvalidInputError(f"request {req_id!r}: 'upto' must be {len(layouts)} "
                                    f"non-negative int(s), got {upto!r:.80}")
        load = cls([], [], [])
        keep_keys, keep_slots = [], []
        logical: dict[int, None] = {}
        for g, (keys, slots, ours) in enumerate(zip(params.keys, params.slots, layouts)):
            kept = [(key, slot) for key, slot in zip(keys, slots)
                    if have[g] <= key // ours.kernel_ratio < (math.inf if upto is None else upto[g])]
            kernel_ids, entries = _place(req_id, g, [k for k, _ in kept], tables[g], ours)
            logical.update(dict.fromkeys(block for _, block in entries))
            keep_keys.append(tuple(k for k, _ in kept))
            keep_slots.append(tuple(s for _, s in kept))
            load.keys.append([k for k, _ in kept])
            load.kernel_ids.append(kernel_ids)
        load.logical_ids, load.reserved = list(logical), load.kernel_ids
        load.need = _need(layouts, req_id, request)
        why = load.uncovered(layouts, req_id)
        if why is not None:
            raise InvalidInputError(why)
        return replace(params, keys=tuple(keep_keys), slots=tuple(keep_slots)), load

    @classmethod
    def stream(cls, layouts: Sequence[CacheLayout], req_id: str, request: LoadRequest
               ) -> tuple[Load, list[int]]:
        """A stream's load before any block arrived, and per group the kernel position below
        which D holds the blocks: every kernel id of D's tables past what D holds is reserved
        (P names what it sends only as it goes), and fails with the request."""
        tables, have = _tables(layouts, req_id, request)
        load = cls([[] for _ in tables], [[] for _ in tables], [], [], tables,
                   _need(layouts, req_id, request))
        for table, h, layout in zip(tables, have, layouts):
            entries = [(i, b) for i, b in enumerate(table) if i >= h and b != NULL_BLOCK]
            load.reserved.append([k for _, k in kernel_placement(entries, layout.kernel_ratio)])
            load.logical_ids += [b for _, b in entries if b not in load.logical_ids]
        return load, [h * layout.kernel_ratio for h, layout in zip(have, layouts)]

    def arrived(self, layouts: Sequence[CacheLayout], req_id: str,
                keys: list[list[int]]) -> Load:
        """What to write of `keys` (per group) now in staging: a stream's placed in D's table
        now, and added to this load's."""
        part = Load([], [], self.logical_ids)
        if self.tables is None:  # placed when the read started
            for g, group_keys in enumerate(keys):
                at = dict(zip(self.keys[g], self.kernel_ids[g]))
                part.keys.append(list(group_keys))
                part.kernel_ids.append([at[k] for k in group_keys])
            return part
        for g, (group_keys, table, layout) in enumerate(zip(keys, self.tables, layouts)):
            ids, _ = _place(req_id, g, group_keys, table, layout)
            part.keys.append(list(group_keys))
            part.kernel_ids.append(ids)
            self.keys[g] += group_keys
            self.kernel_ids[g] += ids
        return part


class Loads(Mapping[str, Load]):
    """The loads under way, by request id, and which of them may write each D kernel block:
    a request whose table gives it a block another load still writes is refused
    (`check`), so the blocks of one step's scatter are disjoint. A load's blocks are free
    again once it is popped, a stream's reserved ones included."""

    def __init__(self, num_groups: int):
        self._loads: dict[str, Load] = {}
        self._writers: list[dict[int, str]] = [{} for _ in range(num_groups)]  # kernel id -> load

    def __getitem__(self, req_id: str) -> Load:
        return self._loads[req_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loads)

    def __len__(self) -> int:
        return len(self._loads)

    def check(self, req_id: str, load: Load) -> None:
        """`InvalidInputError` naming a D block of `load` that a load under way writes."""
        for g, (writers, ids) in enumerate(zip(self._writers, load.reserved)):
            taken = next((k for k in ids if k in writers), None)
            if taken is not None:
                raise InvalidInputError(
                    f"request {req_id!r} group {g}: D's kernel block {taken} is being loaded "
                    f"for request {writers[taken]!r}")

    def add(self, req_id: str, load: Load) -> None:
        """`load` is under way (its blocks passed `check`)."""
        self._loads[req_id] = load
        for writers, ids in zip(self._writers, load.reserved):
            writers.update(dict.fromkeys(ids, req_id))

    def pop(self, req_id: str) -> Load | None:
        """The load of `req_id`, no longer under way (None if it was not)."""
        load = self._loads.pop(req_id, None)
        if load is not None:
            for writers, ids in zip(self._writers, load.reserved):
                for k in ids:
                    writers.pop(k, None)
        return load


def table_ids(table: object) -> list[int]:
    """Every plausible block id in a (possibly malformed) table: what a failure reports."""
    ids: dict[int, None] = {}
    stack = [table]
    while stack:
        item = stack.pop()
        if is_int(item) and item > NULL_BLOCK:
            ids.setdefault(item, None)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return list(ids)


def _place(req_id: str, g: int, keys: Sequence[int], table: Sequence[int],
           layout: CacheLayout) -> tuple[list[int], list[tuple[int, int]]]:
    """D's kernel ids of P's `keys` (kernel positions) of group `g`, placed at the same
    positions of D's `table`, and the table entries they fall in; `InvalidInputError`
    where D's table cannot hold one (too short, the null block, past D's blocks, an id twice)."""
    ratio = layout.kernel_ratio
    try:
        entries = table_entries(dict.fromkeys(k // ratio for k in keys), table)
    except InvalidInputError as e:
        raise InvalidInputError(f"request {req_id!r} group {g}: P sends a block D "
                                f"cannot place: {e}") from None
    at = dict(kernel_placement(entries, ratio))
    kernel_ids = [at[k] for k in keys]
    bad = [k for k in kernel_ids if k >= layout.num_blocks]
    if bad:
        raise InvalidInputError(f"request {req_id!r} group {g}: D block ids "
                                f"{sorted({k // ratio for k in bad})[:8]} are past D's "
                                f"{layout.num_blocks // ratio} blocks")
    if len(set(kernel_ids)) != len(kernel_ids):
        raise InvalidInputError(f"request {req_id!r} group {g}: D's table repeats a block "
                                f"id at the positions P sends")
    return kernel_ids, entries


def kernel_hashes(layouts: Sequence[CacheLayout], req_id: str, request: LoadRequest
                  ) -> list[list[str]] | None:
    """`request.hashes` checked, by kernel position (what `ReadParams.tag_secrets` takes)."""
    hashes = request.hashes
    if hashes is None:
        return None
    if not (isinstance(hashes, (list, tuple)) and len(hashes) == len(layouts) and all(
            isinstance(h, (list, tuple)) and all(isinstance(x, str) for x in h) for h in hashes)):
        raise InvalidInputError(f"request {req_id!r}: 'hashes' must be {len(layouts)} list(s) "
                                f"of str block hashes, got {hashes!r:.80}")
    return [[h for h in group for _ in range(layout.kernel_ratio)]
            for group, layout in zip(hashes, layouts)]


def _need(layouts: Sequence[CacheLayout], req_id: str, request: LoadRequest
          ) -> list[tuple[int, int]] | None:
    """`request.need` checked: per group, `[lo, hi)` table entries (None: not checked)."""
    need = request.need
    if need is None:
        return None
    if not (isinstance(need, (list, tuple)) and len(need) == len(layouts) and all(
            isinstance(n, (list, tuple)) and len(n) == 2 and all(is_int(v) for v in n)
            and 0 <= n[0] <= n[1] for n in need)):
        raise InvalidInputError(f"request {req_id!r}: 'need' must be {len(layouts)} [lo, hi] "
                                f"pair(s) of table entries, got {need!r:.80}")
    return [(int(lo), int(hi)) for lo, hi in need]


def _tables(layouts: Sequence[CacheLayout], req_id: str, request: LoadRequest
            ) -> tuple[list[list[int]], list[int]]:
    """D's block table per group, and how many leading entries of each D holds, checked."""
    table, have = request.table, request.have
    tables = [table] if len(layouts) == 1 and _is_id_list(table) else table
    if (not isinstance(tables, (list, tuple)) or len(tables) != len(layouts)
            or not all(_is_id_list(t) for t in tables)):
        raise InvalidInputError(
            f"request {req_id!r}: D's block table must be {len(layouts)} list(s) of "
            f"non-negative int block ids, got {table!r:.120}")
    have = [0] * len(layouts) if have is None else have
    if (not isinstance(have, (list, tuple)) or len(have) != len(layouts)
            or not all(is_int(h) and h >= 0 for h in have)):
        raise InvalidInputError(f"request {req_id!r}: 'have' must be {len(layouts)} "
                                f"non-negative int(s), got {have!r:.80}")
    return [list(t) for t in tables], list(have)


def _is_id_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(is_int(b) and b >= 0 for b in value)
