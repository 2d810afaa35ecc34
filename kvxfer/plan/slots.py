"""Staging slots: which request's blocks sit in which slots (plain Python, no memory).

`SlotMap` is the bookkeeping of a `kvxfer.device.staging.Staging`, usable without
the regions, so an engine's scheduler process can hand out slots while the
worker that owns the registered memory copies into them. With
`placement="runs"` (the default) each request gets contiguous runs of slots
in the order its blocks are first staged, so D reads it as a few large NIXL
descriptors whatever its block ids; `"mirror"` is vLLM's layout, slot `i`
holding kernel block `i`. A block staged again keeps its slot.
"""


from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvxfer.errors import InvalidInputError, StagingFullError, UnknownRequestError
from kvxfer.plan.blocks import coalesce, is_int

__all__ = ["Placement", "SlotAllocator", "SlotMap"]

Placement = Literal["runs", "mirror"]


class SlotAllocator:
    """Free slots as sorted, merged `(start, length)` runs; hands out runs."""

    def __init__(self, num_slots: int) -> None:
        if not is_int(num_slots) or num_slots < 0:
            raise InvalidInputError(f"num_slots must be a non-negative int, got {num_slots!r}")
        self.num_slots = num_slots
        self._starts: list[int] = [0] if num_slots else []
        self._lengths: list[int] = [num_slots] if num_slots else []

    @property
    def num_free(self) -> int:
        return sum(self._lengths)

    def allocate(self, n: int) -> list[tuple[int, int]]:
        """`n` slots as runs `(start, length)`: one run if any free run fits (first fit)."""
        if n > self.num_free:
            raise StagingFullError(f"need {n} staging slots, only {self.num_free} free")
        for i, length in enumerate(self._lengths):
            if length >= n:
                start = self._starts[i]
                self._take(i, n)
                return [(start, n)]
        runs = []
        while n:
            i = max(range(len(self._lengths)), key=self._lengths.__getitem__)
            take = min(n, self._lengths[i])
            runs.append((self._starts[i], take))
            self._take(i, take)
            n -= take
        return runs

    def _take(self, i: int, n: int) -> None:
        if self._lengths[i] == n:
            del self._starts[i], self._lengths[i]
        else:
            self._starts[i] += n
            self._lengths[i] -= n

    def release(self, start: int, length: int) -> None:
        """Return a run; merges with free neighbours.

        Raises `InvalidInputError` naming the run, before any change, if it is
        not inside `[0, num_slots)` or overlaps a free run (a double release).
        """
        if not (is_int(start) and is_int(length) and length > 0
                and 0 <= start and start + length <= self.num_slots):
            raise InvalidInputError(
                f"cannot release slot run (start {start!r}, length {length!r}): not a "
                f"non-empty run inside [0, {self.num_slots})"
            )
        i = bisect.bisect_left(self._starts, start)
        # Free runs are disjoint and sorted: only the neighbours on each side can overlap.
        overlaps = (i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start) or (
            i < len(self._starts) and self._starts[i] < start + length)
        if overlaps:
            raise InvalidInputError(
                f"cannot release slot run (start {start}, length {length}): it overlaps free "
                f"slots (a double release)"
            )
        self._starts.insert(i, start)
        self._lengths.insert(i, length)
        if i + 1 < len(self._starts) and start + length == self._starts[i + 1]:
            self._lengths[i] += self._lengths[i + 1]
            del self._starts[i + 1], self._lengths[i + 1]
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
            self._lengths[i - 1] += self._lengths[i]
            del self._starts[i], self._lengths[i]


@dataclass
class _Request:
    slots: dict[int, int] = field(default_factory=dict)  # kernel id -> slot
    spare: list[int] = field(default_factory=list)  # reserved, not yet used, in order
    borrowed: set[int] = field(default_factory=set)  # keys whose slots another owner frees


class SlotMap:
    """Which request's blocks sit in which staging slots: the bookkeeping of a `Staging`.

    Needs no memory and no JAX, so an engine's scheduler process can hand out
    slots (vLLM's scheduler-side connector) while the worker that owns the
    registered regions copies into the slots it is told.

    **Arguments:**

    - `num_slots`: slots in each region.
    - `placement`: `"runs"` (contiguous slots per request) or `"mirror"` (slot = block id).
    """

    def __init__(self, num_slots: int, placement: Placement = "runs") -> None:
        if not is_int(num_slots) or num_slots <= 0:
            raise InvalidInputError(f"Staging num_slots must be a positive int, got {num_slots!r}")
        if placement not in ("runs", "mirror"):
            raise InvalidInputError(f"placement must be 'runs' or 'mirror', got {placement!r}")
        self.num_slots = num_slots
        self.placement = placement
        self._free = SlotAllocator(num_slots)
        self._requests: dict[Hashable, _Request] = {}
        self.reclaim: Callable[[int], None] | None = None
        """Called with how many slots a request lacks before it is refused: a host pool
        (`kvxfer.plan.pool.Pool`) evicts entries to free them."""

    @property
    def num_free_slots(self) -> int:
        return self._free.num_free if self.placement == "runs" else self.num_slots

    def reserve(self, req_id: Hashable, num_blocks: int) -> None:
        """Reserve `num_blocks` contiguous slots for blocks `req_id` will stage later.

        Optional: a request whose full length is known up front (the prompt)
        gets one run even when its blocks are staged over several steps.
        """
        if self.placement != "runs" or num_blocks <= 0:
            return
        req = self._requests.setdefault(req_id, _Request())
        self._make_room(num_blocks)
        for start, length in self._free.allocate(num_blocks):
            req.spare.extend(range(start, start + length))

    def assign(self, req_id: Hashable, kernel_ids: Sequence[int]) -> list[int]:
        """Slots for `kernel_ids` of `req_id`, allocating any block not yet staged.

        A block already staged for the request keeps its slot. Keys must be
        non-negative ints (kernel positions, or kernel ids with mirror placement);
        anything else raises `InvalidInputError` naming it, before any change.
        """
        bad = [k for k in kernel_ids if not is_int(k) or k < 0]
        if bad:
            raise InvalidInputError(f"request {req_id!r}: staging keys must be non-negative "
                                    f"ints, got {bad[:4]!r}")
        req = self._requests.setdefault(req_id, _Request())
        if self.placement == "mirror":
            for k in kernel_ids:
                if not 0 <= k < self.num_slots:
                    raise InvalidInputError(
                        f"kernel block id {k} outside the {self.num_slots}-slot mirror"
                    )
                req.slots[k] = k
            return list(kernel_ids)
        new = [k for k in dict.fromkeys(kernel_ids) if k not in req.slots]
        missing = len(new) - len(req.spare)
        if missing > 0:
            self._make_room(missing)
            try:
                runs = self._free.allocate(missing)
            except StagingFullError as e:
                if not req.slots and not req.spare:
                    del self._requests[req_id]
                raise StagingFullError(f"request {req_id!r}: {e}") from None
            for start, length in runs:
                req.spare.extend(range(start, start + length))
        for k, slot in zip(new, req.spare, strict=False):
            req.slots[k] = slot
        del req.spare[: len(new)]
        return [req.slots[k] for k in kernel_ids]

    def borrow(self, req_id: Hashable, kernel_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Name slots another owner holds (a host pool's entries) as `req_id`'s blocks
        `kernel_ids`: its params read them, `free` leaves them to their owner. Keys the
        request has staged already raise `InvalidInputError`, before any change."""
        req = self._requests.setdefault(req_id, _Request())
        taken = [k for k in kernel_ids if k in req.slots]
        if taken or len(kernel_ids) != len(slots):
            if not req.slots and not req.spare:
                del self._requests[req_id]
            raise InvalidInputError(f"request {req_id!r}: cannot borrow {len(slots)} slots for "
                                    f"keys {list(kernel_ids)[:8]} (staged already: {taken[:4]})")
        req.slots.update(zip(kernel_ids, slots))
        req.borrowed.update(kernel_ids)

    def borrowed(self, req_id: Hashable) -> set[int]:
        """The keys of `req_id` whose slots it borrowed (`borrow`)."""
        return set(self._request(req_id).borrowed)

    def slot(self, req_id: Hashable, kernel_id: int) -> int:
        """The slot holding kernel block `kernel_id` of `req_id`."""
        return self.slots(req_id, [kernel_id])[0]

    def slots(self, req_id: Hashable, kernel_ids: Sequence[int]) -> list[int]:
        """Slots holding `kernel_ids` of `req_id`, in order."""
        req = self._request(req_id)
        missing = [k for k in kernel_ids if k not in req.slots]
        if missing:
            raise UnknownRequestError(
                f"request {req_id!r} has no staged kernel blocks {missing}"
            )
        return [req.slots[k] for k in kernel_ids]

    def blocks(self, req_id: Hashable) -> list[int]:
        """Kernel ids staged for `req_id`, in the order they were first staged."""
        return list(self._request(req_id).slots)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._requests

    def free(self, req_id: Hashable) -> None:
        """Release every slot of `req_id` (staged or reserved)."""
        req = self._requests.pop(req_id, None)
        if req is None:
            raise UnknownRequestError(f"request {req_id!r} is not staged")
        if self.placement == "runs":
            own = [s for k, s in req.slots.items() if k not in req.borrowed]
            for start, length in coalesce(sorted([*own, *req.spare])):
                self._free.release(start, length)

    def detach(self, req_id: Hashable, kernel_ids: Sequence[int]) -> list[int]:
        """Take `kernel_ids`' slots away from `req_id` without freeing them: their new owner
        (a host pool's entry) gives them back with `release_slots`."""
        slots = self.slots(req_id, kernel_ids)
        req = self._requests[req_id]
        for k in kernel_ids:
            del req.slots[k]
        return slots

    def release_slots(self, slots: Sequence[int]) -> None:
        """Free slots `detach` took from a request."""
        for start, length in coalesce(sorted(slots)):
            self._free.release(start, length)

    def _make_room(self, slots: int) -> None:
        short = slots - self._free.num_free
        if short > 0 and self.reclaim is not None:
            self.reclaim(short)

    def _request(self, req_id: Hashable) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise UnknownRequestError(f"request {req_id!r} is not staged")
        return req
