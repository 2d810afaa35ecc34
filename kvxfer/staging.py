"""Host staging: the host arrays NIXL registers, and which request's blocks live where.

One numpy region per layer, shaped `[num_slots, *block_shape]`, allocated and
registered once (by `kvxfer.transport`) and reused for every request: a save
copies kernel blocks into slots, a read on D lands in slots, and nothing is
registered in steady state. A block copied again by a later chunk (the block
that straddles a chunk boundary) goes back to the slot it already has, so the
newest copy replaces the old one and D always reads the newest.

Placement. `placement="runs"` (default) hands each request contiguous runs of
slots, in the order its blocks are first staged (token order, since saves go
by token position), so D reads a request as a few large NIXL descriptors per
layer whatever its block ids are. `placement="mirror"` is vLLM's layout: slot
`i` holds kernel block `i`, so descriptors follow the engine's (scattered) ids.
Measured with `kvxfer.bench.nixl` (two processes on loopback, 2 cores shared
with other jobs, 8 layers x 256 randomly placed 64 KiB blocks, 134 MB,
`UCX_TLS=cma,tcp,self`, ratio to a numpy memcpy of the same bytes timed
between the reads): runs read 8 descriptors at 0.87-0.92x memcpy; mirror
reads 2048 descriptors at 0.55-0.64x. With UCX's default transports the
gap is the same (runs 0.48-0.86x, mirror 0.42-0.62x, noisy). Hence runs. A
request whose blocks do not fit one free run is given several (first fit,
then the largest free runs), which is still correct, only less coalesced.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvxfer.blocks import coalesce, is_int
from kvxfer.errors import InvalidInputError, KvxferError, LayoutMismatchError

Placement = Literal["runs", "mirror"]

_ALIGN = 4096  # page-align regions: registration pins whole pages


class StagingFullError(KvxferError):
    """No free staging slots are left for a request."""


class UnknownRequestError(KvxferError, KeyError):
    """A request id (or one of its blocks) is not staged."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


def _aligned_region(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A page-aligned array whose pages are all mapped.

    Written once here: otherwise the first save or read into each page pays
    its page fault on the transfer path (measured: a 64 MB read into fresh
    pages took 4x as long as into touched ones).
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    offset = (-raw.ctypes.data) % _ALIGN
    region = raw[offset : offset + nbytes]
    region.fill(0)
    return region.view(dtype).reshape(shape)


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
        for start, length in self._free.allocate(num_blocks):
            req.spare.extend(range(start, start + length))

    def assign(self, req_id: Hashable, kernel_ids: Sequence[int]) -> list[int]:
        """Slots for `kernel_ids` of `req_id`, allocating any block not yet staged.

        A block already staged for the request keeps its slot.
        """
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

    def requests(self) -> list[Hashable]:
        return list(self._requests)

    def free(self, req_id: Hashable) -> None:
        """Release every slot of `req_id` (staged or reserved)."""
        req = self._requests.pop(req_id, None)
        if req is None:
            raise UnknownRequestError(f"request {req_id!r} is not staged")
        if self.placement == "runs":
            for start, length in coalesce(sorted([*req.slots.values(), *req.spare])):
                self._free.release(start, length)

    def _request(self, req_id: Hashable) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise UnknownRequestError(f"request {req_id!r} is not staged")
        return req


class Staging(SlotMap):
    """Registered host regions, and the (request, key) -> slot map of a `SlotMap`.

    **Arguments:**

    - `num_layers`: one region per layer (per KV cache array).
    - `num_slots`: blocks each region holds.
    - `block_shape`: shape of one kernel block, e.g. `(tokens, heads, p, dim)`.
    - `dtype`: the cache dtype (a numpy dtype; `ml_dtypes` names work once imported).
    - `placement`: `"runs"` (contiguous slots per request) or `"mirror"` (slot = block id).

    Besides the block regions, `prints` (`uint32[num_slots, num_layers]`) holds
    each staged block's fingerprints, one row per slot: P writes them where it
    gathers, D reads them with the blocks (one more descriptor per run), so
    they travel with the bytes they vouch for and never through the engine.
    With `prints_per_layer=k` it is `uint32[num_slots, k, num_layers]`: one
    sum per unit of a block's piece (`kvxfer.pieces`).
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        block_shape: Sequence[int],
        dtype: Any = np.uint8,
        placement: Placement = "runs",
        prints_per_layer: int | None = None,
    ) -> None:
        if not is_int(num_layers) or num_layers <= 0:
            raise InvalidInputError(f"Staging num_layers must be a positive int, got {num_layers!r}")
        if prints_per_layer is not None and (not is_int(prints_per_layer) or prints_per_layer <= 0):
            raise InvalidInputError(
                f"Staging prints_per_layer must be None or a positive int, got {prints_per_layer!r}")
        super().__init__(num_slots, placement)
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = np.dtype(dtype)
        self.regions: list[np.ndarray] = [
            _aligned_region((num_slots, *self.block_shape), self.dtype) for _ in range(num_layers)
        ]
        self.prints_per_layer = prints_per_layer
        per_slot = (num_layers,) if prints_per_layer is None else (prints_per_layer, num_layers)
        self.prints = _aligned_region((num_slots, *per_slot), np.dtype(np.uint32))
        self.block_bytes = self.regions[0][0].nbytes

    @property
    def num_layers(self) -> int:
        return len(self.regions)

    def region_addresses(self) -> list[tuple[int, int]]:
        """`(base address, length in bytes)` of each layer's region, for registration."""
        return [(r.ctypes.data, r.nbytes) for r in self.regions]

    def prints_address(self) -> tuple[int, int]:
        """`(base address, length in bytes)` of the fingerprint region."""
        return self.prints.ctypes.data, self.prints.nbytes

    def stage(
        self, req_id: Hashable, kernel_ids: Sequence[int], rows_per_layer: Sequence[Any]
    ) -> list[int]:
        """Copy blocks into `req_id`'s slots; returns the slots.

        `rows_per_layer[l]` is array-like `[len(kernel_ids), *block_shape]`
        (numpy, or a host jax array) of the staging dtype, holding the blocks in
        `kernel_ids` order. Rows of another dtype raise `LayoutMismatchError`.
        """
        if len(rows_per_layer) != self.num_layers:
            raise InvalidInputError(
                f"got rows for {len(rows_per_layer)} layers, staging has {self.num_layers}"
            )
        expected = (len(kernel_ids), *self.block_shape)
        arrays = [np.asarray(rows) for rows in rows_per_layer]
        for layer, rows in enumerate(arrays):
            if rows.shape != expected:
                raise InvalidInputError(
                    f"layer {layer}: rows shape {rows.shape} != expected {expected}"
                )
            # Copying would cast silently (1e300 into bf16 is inf): the bytes must match.
            if rows.dtype != self.dtype:
                raise LayoutMismatchError(
                    f"layer {layer}: rows have dtype {rows.dtype}, staging holds {self.dtype}"
                )
        slots = self.assign(req_id, kernel_ids)
        for region, rows in zip(self.regions, arrays, strict=True):
            i = 0
            for start, length in coalesce(slots):
                region[start : start + length] = rows[i : i + length]
                i += length
        return slots

    def rows(self, layer: int, slots: Sequence[int]) -> np.ndarray:
        """A copy of the blocks in `slots` of one layer, `[len(slots), *block_shape]`."""
        return self.regions[layer][np.asarray(slots, dtype=np.int64)]
