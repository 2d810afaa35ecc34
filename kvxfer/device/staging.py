"""Host staging: the host arrays NIXL registers, and the slot map of what lives in them.

One page-aligned numpy region per layer, `[num_slots, *block_shape]`,
allocated, touched and registered once and reused for every request, plus a
fingerprint region (`prints`) that travels with the blocks it vouches for,
and a tag region (`tags`) that binds each slot to the request and position
it holds (`block_tags`). A block copied again by a later chunk goes back to
its slot, so D always reads the newest copy.
"""


from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from kvxfer.device.fingerprint import SUMS, fmix32
from kvxfer.errors import InvalidInputError, LayoutMismatchError
from kvxfer.plan.blocks import coalesce, is_int
from kvxfer.plan.slots import Placement, SlotMap

__all__ = ["TAG_ROW", "TAG_WORDS", "Staging", "block_tags", "free_in_all", "stagings_of", "tags_of"]

_ALIGN = 4096  # page-align regions: registration pins whole pages

TAG_WORDS = 2
"""uint32 words of one slot's tag: a guess passes with probability 2**-64."""

TAG_ROW = TAG_WORDS + 2
"""uint32 words of a slot's row in the tag region: its tag, then the nonce its blocks are
sealed under (`kvxfer.device.seal`; 0: not sealed)."""


def tags_of(secrets: Sequence[str], group: int, keys: Sequence[int]) -> np.ndarray:
    """`block_tags` of each key under its own secret (`secrets[i]` for `keys[i]`): a
    request's blocks, some of them host pool entries with secrets of their own."""
    out = np.empty((len(keys), TAG_WORDS), np.uint32)
    at: dict[str, list[int]] = {}
    for i, secret in enumerate(secrets):
        at.setdefault(secret, []).append(i)
    for secret, rows in at.items():
        out[rows] = block_tags(secret, group, [keys[i] for i in rows])
    return out


def block_tags(secret: str, group: int, keys: Sequence[int]) -> np.ndarray:
    """`uint32[len(keys), TAG_WORDS]`: the tags binding blocks `keys` (kernel positions) of
    KV cache group `group` to the request whose secret is `secret`.

    P writes them beside the slots it stages, D checks the ones it read against the
    params' secret and keys: params altered to name another request's slots (whose
    tags come from another secret), the request's own slots in another order, or a
    slot another request staged into since, fail. The secret travels only in that
    request's params and tags are never shown (not in errors either), so without
    the secret a tag is a 64-bit guess.
    """
    if not (isinstance(secret, str) and len(secret) == 32):
        raise InvalidInputError(f"a request secret is 32 hex digits, got {secret!r:.40}")
    words = np.frombuffer(_tag_key(secret), dtype="<u4")
    k = np.asarray(keys, dtype=np.uint64)
    lo = (k & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    hi = (k >> np.uint64(32)).astype(np.uint32) ^ np.uint32(group * 0x9E3779B1 % 2**32)
    out = np.empty((len(k), TAG_WORDS), np.uint32)
    with np.errstate(over="ignore"):
        for w in range(TAG_WORDS):
            h = fmix32(lo ^ words[2 * w])
            out[:, w] = fmix32(fmix32(h ^ hi ^ words[2 * w + 1]) + np.uint32(w + 1))
    return out


@functools.lru_cache(maxsize=4096)
def _tag_key(secret: str) -> bytes:
    """The key `block_tags` mixes: a one-way function of `secret` (BLAKE2b keyed with it).
    The mix itself can be run backwards, so a tag, which any agent with the staging's
    metadata may read, gives up at most this key, never the secret: not the secret's other
    uses (the key staged blocks are sealed under, `kvxfer.device.seal`)."""
    try:
        raw = bytes.fromhex(secret)
    except ValueError:
        raise InvalidInputError(f"a request secret is 32 hex digits, got {secret!r:.40}") from None
    return hashlib.blake2b(b"tag", key=raw, digest_size=16, person=b"kvxfer-tag").digest()


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


class Staging(SlotMap):
    """Registered host regions, and the (request, key) -> slot map of a `SlotMap`.

    **Arguments:**

    - `num_layers`: one region per layer (per KV cache array).
    - `num_slots`: blocks each region holds.
    - `block_shape`: shape of one kernel block, e.g. `(tokens, heads, p, dim)`.
    - `dtype`: the cache dtype (a numpy dtype; `ml_dtypes` names work once imported).
    - `placement`: `"runs"` (contiguous slots per request) or `"mirror"` (slot = block id).
    - `regions`: the block regions to use instead of allocating them: one writable numpy
      array per layer, `[num_slots, *block_shape]` of `dtype` (`kvxfer.device.pinned`
      gives pinned-host JAX buffers seen as numpy).

    Besides the block regions, `prints` (`uint32[num_slots, num_layers, 3]`) holds
    each staged block's fingerprints, one row per slot: P writes them where it
    gathers, D reads them with the blocks (one more descriptor per run), so
    they travel with the bytes they vouch for and never through the engine.
    With `prints_per_layer=k` it is `uint32[num_slots, k, num_layers, 3]`: one
    set of sums per unit of a block's piece (`kvxfer.device.pieces`). `tags`
    (`uint32[num_slots, TAG_ROW]`) holds each slot's `block_tags` and the nonce it is
    sealed under, read by D with the fingerprint rows. `secrets` (slot -> secret, in this
    process's memory only) keeps the secret each sealed slot opens under, as the writer or
    the reader that checked its tag knows it (`kvxfer.device.seal`).
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        block_shape: Sequence[int],
        dtype: Any = np.uint8,
        placement: Placement = "runs",
        prints_per_layer: int | None = None,
        regions: Sequence[np.ndarray] | None = None,
    ) -> None:
        if not is_int(num_layers) or num_layers <= 0:
            raise InvalidInputError(f"Staging num_layers must be a positive int, got {num_layers!r}")
        if prints_per_layer is not None and (not is_int(prints_per_layer) or prints_per_layer <= 0):
            raise InvalidInputError(
                f"Staging prints_per_layer must be None or a positive int, got {prints_per_layer!r}")
        if (isinstance(block_shape, (str, bytes)) or not isinstance(block_shape, Sequence)
                or not block_shape or not all(isinstance(d, (int, np.integer))
                                              and not isinstance(d, bool) and d > 0
                                              for d in block_shape)):
            raise InvalidInputError(f"Staging block_shape must be a non-empty sequence of positive "
                                    f"ints, got {block_shape!r:.80}")
        try:
            dtype = np.dtype(dtype)
        except TypeError as e:
            raise InvalidInputError(f"Staging dtype must be a numpy dtype, got {dtype!r:.80}") from e
        super().__init__(num_slots, placement)
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        check_fits(num_layers * num_slots * math.prod(self.block_shape) * self.dtype.itemsize,
                    num_layers, num_slots)
        self.regions: Sequence[np.ndarray] = (
            [_aligned_region((num_slots, *self.block_shape), self.dtype)
             for _ in range(num_layers)] if regions is None
            else _given_regions(regions, num_layers, (num_slots, *self.block_shape), self.dtype))
        self.prints_per_layer = prints_per_layer
        per_slot = ((num_layers, SUMS) if prints_per_layer is None
                    else (prints_per_layer, num_layers, SUMS))
        self.prints = _aligned_region((num_slots, *per_slot), np.dtype(np.uint32))
        self.tags = _aligned_region((num_slots, TAG_ROW), np.dtype(np.uint32))
        self.secrets: dict[int, str] = {}
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

    def tags_address(self) -> tuple[int, int]:
        """`(base address, length in bytes)` of the tag region."""
        return self.tags.ctypes.data, self.tags.nbytes

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

    def tag(self, slots: Sequence[int], tags: np.ndarray) -> None:
        """Write `tags` (`uint32[len(slots), TAG_WORDS]`) into the slots' tag rows, as slots
        not sealed."""
        at = np.asarray(slots, np.int64)
        self.tags[at, :TAG_WORDS] = tags
        self.tags[at, TAG_WORDS:] = 0

    def rows(self, layer: int, slots: Sequence[int]) -> np.ndarray:
        """A copy of the blocks in `slots` of one layer, `[len(slots), *block_shape]`."""
        return self.regions[layer][np.asarray(slots, dtype=np.int64)]


def _given_regions(regions: Sequence[np.ndarray], num_layers: int, shape: tuple[int, ...],
                   dtype: np.dtype) -> Sequence[np.ndarray]:
    if len(regions) != num_layers or not all(
            isinstance(r, np.ndarray) and r.shape == shape and r.dtype == dtype
            and r.flags.writeable and r.flags.c_contiguous for r in regions):
        got = [(getattr(r, "shape", None), str(getattr(r, "dtype", type(r).__name__)))
               for r in regions]
        raise InvalidInputError(f"Staging regions must be {num_layers} writable contiguous "
                                f"numpy arrays {shape} of {dtype}, got {got[:4]}")
    return regions


def check_fits(nbytes: int, num_layers: int, num_slots: int) -> None:
    """Refuse, by name, staging larger than this machine's memory (numpy would raise a bare
    `MemoryError`, or the kernel kill the process as the pages are touched)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not on this platform: nothing to compare with
        return
    if nbytes > total:
        raise InvalidInputError(
            f"staging of {num_slots} slots x {num_layers} layers needs {nbytes / 2**30:.1f} GiB, "
            f"more than this machine's {total / 2**30:.1f} GiB of memory: lower staging_blocks "
            f"(slots per layer)")


def stagings_of(staging: Staging | Sequence[Staging]) -> list[Staging]:
    """One staging per KV cache group; a single `Staging` is one group."""
    out = [staging] if isinstance(staging, Staging) else list(staging)
    if not out or not all(isinstance(s, Staging) for s in out):
        raise InvalidInputError(
            f"staging must be a Staging or a non-empty list of them (one per KV cache group), "
            f"got {staging!r:.80}")
    return out


def free_in_all(stagings: Sequence[Staging], req_id: str) -> None:
    for staging in stagings:
        if req_id in staging:
            staging.free(req_id)
