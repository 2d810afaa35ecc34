"""Sealed staging: staged KV encrypted where NIXL registers it, opened only by its reader.

NIXL serves a staging region to any agent that holds this instance's metadata, and carries
it over the link as it lies. With `seal_kv` (`kvxfer.connector.config.ConnectorConfig`) P
gathers each block into memory NIXL does not register and writes it into its slot sealed
(every layer's row of the slot and the slot's fingerprint row), AES-256 in counter mode,
under a key derived from the secret the slot's tag is bound to
(`kvxfer.nixl.wire.bound_secret`: a request's secret bound to its prompt, or a pool entry's
bound to the block's hash; the tag mixes another key derived from it, so a tag gives the
seal key away no more than the secret). What a peer reads, and what crosses the link,
is then ciphertext; a reader derives the key only from the params' secret and its own
prompt or block hashes, as it checks the tags. A pooled block lent to a peer stays sealed:
P's own loads from its pool open a copy (`opened`), never the slot.

    clear = scratch(staging, len(slots))                         # P: gathers into it,
    seal(staging, group, slots, secrets, count, clear, first, units)  # then seals into slots
    staging, rows, _ = opened(staging, group, rows, first, units)  # D or P, before a scatter

Each write has a nonce of its own, `count << 24 | slot` (the worker's save count: the same
on every process of an instance, so a reader that takes the blocks of one process and the
tags of another opens them alike), kept beside the tag in the slot's tag row
(`kvxfer.device.staging.TAG_ROW`), which D reads with the tags; nonce 0 is a slot not
sealed. A slot holds a process's piece of each block, unit-major (`kvxfer.device.pieces`),
from unit `first` on: each unit's bytes take the stream at the unit's own place in the
whole block, so a reader whose processes split the units otherwise opens them alike. Keys
are fresh per instance start (its secrets are), so a nonce is never used twice
under one key. The cipher gives secrecy, not integrity: the fingerprints, sealed with the
block and checked after opening, catch a torn or wrong read as they do unsealed.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvxfer.device.staging import TAG_WORDS, Staging
from kvxfer.errors import InvalidInputError

__all__ = ["SLOT_BITS", "nonces_of", "opened", "scratch", "seal", "seal_key"]

SLOT_BITS = 24
"""Bits of a nonce that name the slot: a sealed staging holds at most 2**24 slots."""

@functools.lru_cache(maxsize=4096)
def seal_key(secret: str) -> bytes:
    """The AES-256 key of the blocks whose tags are bound to `secret` (32 hex digits)."""
    try:
        raw = bytes.fromhex(secret)
    except (TypeError, ValueError):
        raise InvalidInputError(f"a bound secret is 32 hex digits, got {secret!r:.40}") from None
    return hmac.new(raw, b"kvxfer seal v1", hashlib.sha256).digest()


def nonces_of(count: int, slots: Sequence[int] | np.ndarray) -> np.ndarray:
    """`uint32[len(slots), 2]` (low word, high word): the nonces of save `count`'s writes into
    `slots`."""
    s = np.asarray(slots, np.uint64)
    if count <= 0 or count >= 2 ** (64 - SLOT_BITS):
        raise InvalidInputError(f"a save count is in [1, 2**{64 - SLOT_BITS}), got {count!r}")
    if len(s) and int(s.max()) >= 2 ** SLOT_BITS:
        raise InvalidInputError(f"a sealed staging holds at most 2**{SLOT_BITS} slots, got "
                                f"slot {int(s.max())}")
    n = (np.uint64(count) << np.uint64(SLOT_BITS)) | s
    return np.stack([(n & np.uint64(0xFFFFFFFF)).astype(np.uint32),
                     (n >> np.uint64(32)).astype(np.uint32)], axis=1)


def seal(staging: Staging, group: int, slots: Sequence[int], secrets: Sequence[str],
         count: int, clear: Staging, first: int = 0, units: int | None = None) -> None:
    """Encrypt the blocks and fingerprints gathered into `clear` (a `scratch`, which NIXL
    never registers: row `i` for `slots[i]`, rows past them unused) into `slots` of `staging` (KV cache group
    `group`), each under `seal_key(secrets[i])` and a nonce of save `count`, and write the
    nonces into the slots' tag rows: the clear bytes never lie where NIXL reads. The staging
    holds units `first` on of each block's `units` (None: all of them). The slots' secrets
    are kept on the staging (`Staging.secrets`) for this process's own loads."""
    if not (len(secrets) == len(slots) <= clear.num_slots):
        raise InvalidInputError(f"seal: {len(secrets)} secrets and {clear.num_slots} clear rows "
                                f"for {len(slots)} slots")
    nonces = nonces_of(count, slots)
    pairs = list(zip(clear.regions, staging.regions)) + [(clear.prints, staging.prints)]
    rooms = {id(r): _Rows(r, 1) for _, r in pairs}  # for a slot with no row past it
    for i, (slot, secret, nonce) in enumerate(zip(slots, secrets, nonces)):
        streams = _streams(seal_key(secret), nonce, group, staging, first, units)
        for (stream, _), (src, region) in zip(streams, pairs):
            size = region[0].nbytes
            if slot + 1 < len(region):  # the room a write asks for runs into the next row
                room = memoryview(region.view(np.uint8).reshape(-1))[slot * size:][: size + 15]
                stream.update_into(_bytes(src[i]), room)
            else:
                stream.update_into(_bytes(src[i]), rooms[id(region)].room(0))
                region[slot] = rooms[id(region)].rows[0]
        staging.secrets[int(slot)] = secret
    staging.tags[np.asarray(slots, np.int64), TAG_WORDS:] = nonces


def scratch(staging: Staging, n: int) -> Staging:
    """A `Staging` of `n` slots laid out as `staging`'s, in memory NIXL never registers and
    left unzeroed (each row is written whole): where P gathers what it seals, and where a
    reader opens what it read."""
    return Staging(staging.num_layers, n, staging.block_shape, staging.dtype,
                   prints_per_layer=staging.prints_per_layer,
                   regions=[_Rows(r, n).rows for r in staging.regions])


def opened(staging: Staging, group: int, rows: Sequence[int], first: int = 0,
           units: int | None = None) -> tuple[Staging, np.ndarray, list[int]]:
    """The blocks and fingerprints of staging `rows` (units `first` on of each block's
    `units`, as `seal`) in the clear, for a scatter: `staging` and `rows` themselves where
    none is sealed, else a scratch `Staging` of `len(rows)` slots holding them opened, and
    its rows. The third item lists the positions in `rows` that could not be opened (sealed,
    with no secret kept for the slot): their fingerprints are left zero, so they fail their
    check."""
    at = np.asarray(rows, np.int64)
    nonces = staging.tags[at, TAG_WORDS:] if len(at) else np.zeros((0, 2), np.uint32)
    sealed = nonces.any(axis=1)
    if not sealed.any():
        return staging, at, []
    out = {id(r): _Rows(r, len(at)) for r in (*staging.regions, staging.prints)}
    unknown = []
    for i, (slot, nonce, is_sealed) in enumerate(zip(at.tolist(), nonces, sealed)):
        secret = staging.secrets.get(slot) if is_sealed else None
        if not is_sealed:
            for region in (*staging.regions, staging.prints):
                out[id(region)].rows[i] = region[slot]
        elif secret is None:
            unknown.append(i)
            out[id(staging.prints)].rows[i] = 0
        else:
            for stream, region in _streams(seal_key(secret), nonce, group, staging, first, units):
                stream.update_into(_bytes(region[slot]), out[id(region)].room(i))
    clear = Staging(staging.num_layers, len(at), staging.block_shape, staging.dtype,
                    prints_per_layer=staging.prints_per_layer,
                    regions=[out[id(r)].rows for r in staging.regions])
    clear.prints[...] = out[id(staging.prints)].rows
    return clear, np.arange(len(at), dtype=np.int64), unknown


class _Rows:
    """`n` rows shaped as `region`'s, not zeroed (each is written whole), in a buffer with
    16 bytes past the last: a counter-mode write asks for 15 bytes more room than it
    writes, so each row is opened straight into place."""

    def __init__(self, region: np.ndarray, n: int):
        self.size = region[0].nbytes
        self.raw = np.empty(n * self.size + 16, np.uint8)
        self.rows = self.raw[: n * self.size].view(region.dtype).reshape(n, *region.shape[1:])

    def room(self, i: int) -> memoryview:
        return memoryview(self.raw)[i * self.size : (i + 1) * self.size + 15]


def _streams(key: bytes, nonce: np.ndarray, group: int, staging: Staging, first: int,
             units: int | None) -> list[tuple[Any, np.ndarray]]:
    """Each region a slot has a row in (every layer's, then the fingerprints'), with the
    counter stream its row is sealed under, placed at the row's first byte. The blocks'
    stream runs through the whole block, layer after layer, unit after unit; a row that
    follows on from the last takes up its stream where it ended."""
    count = staging.prints_per_layer or 1
    units = count if units is None else units
    out, stream, end = [], None, -1
    for layer, region in enumerate(staging.regions):
        unit = region[0].nbytes // count
        at = (layer * units + first) * unit
        if at != end:
            stream = _stream(key, nonce, group, 0, at)
        out.append((stream, region))
        end = at + region[0].nbytes
    unit = staging.prints[0].nbytes // count
    return [*out, (_stream(key, nonce, group, 1, first * unit), staging.prints)]


def _stream(key: bytes, nonce: np.ndarray, group: int, kind: int, at: int) -> Any:
    """The AES-CTR stream of a slot's blocks (`kind` 0) or fingerprints (1), from byte `at`
    on."""
    iv = ((int(nonce[1]) << 32 | int(nonce[0])).to_bytes(8, "big") + group.to_bytes(2, "big")
          + kind.to_bytes(2, "big") + (at // 16).to_bytes(4, "big"))
    stream = Cipher(algorithms.AES(key), modes.CTR(iv)).encryptor()
    stream.update(bytes(at % 16))
    return stream


def _bytes(row: np.ndarray) -> np.ndarray:
    """A slot's row (contiguous) as bytes, a view."""
    return row.view(np.uint8).reshape(-1)
