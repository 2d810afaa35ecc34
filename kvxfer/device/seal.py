"""Sealed staging: staged KV encrypted where NIXL registers it, opened only by its reader.

NIXL serves a staging region to any agent that holds this instance's metadata, and carries
it over the link as it lies. With `seal_kv` (`kvxfer.connector.config.ConnectorConfig`) P
encrypts each block it stages where it lies: every layer's row of the slot and the slot's
fingerprint row, AES-256 in counter mode, under a key derived from the secret the slot's
tag is bound to (`kvxfer.nixl.wire.bound_secret`: a request's secret bound to its prompt,
or a pool entry's bound to the block's hash). What a peer reads, and what crosses the link,
is then ciphertext; a reader derives the key only from the params' secret and its own
prompt or block hashes, as it checks the tags. A pooled block lent to a peer stays sealed:
P's own loads from its pool open a copy (`opened`), never the slot.

    seal(staging, group, slots, secrets, count, first)   # P, after the gather, before the tags
    staging, rows, _ = opened(staging, group, rows, first)  # D or P, before a scatter

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

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvxfer.device.staging import TAG_WORDS, Staging
from kvxfer.errors import InvalidInputError

__all__ = ["SLOT_BITS", "nonces_of", "opened", "seal", "seal_key"]

SLOT_BITS = 24
"""Bits of a nonce that name the slot: a sealed staging holds at most 2**24 slots."""

_PRINTS_ROW = 0xFFFF  # the "layer" of the fingerprint row in the counter block


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
         count: int, first: int = 0) -> None:
    """Encrypt the blocks and fingerprints just gathered into `slots` (of KV cache group
    `group`; the staging holds units `first` on of each block) in place, each under
    `seal_key(secrets[i])` and a nonce of save `count`, and write the nonces into the slots'
    tag rows. The slots' secrets are kept on the staging (`Staging.secrets`) for this
    process's own loads."""
    if len(secrets) != len(slots):
        raise InvalidInputError(f"seal: {len(secrets)} secrets for {len(slots)} slots")
    nonces = nonces_of(count, slots)
    for slot, secret, nonce in zip(slots, secrets, nonces):
        key = seal_key(secret)
        for row, region in _rows(staging):
            _crypt_into(key, nonce, group, row, region[slot], region[slot], _at(staging, region, first))
        staging.secrets[int(slot)] = secret
    staging.tags[np.asarray(slots, np.int64), TAG_WORDS:] = nonces


def opened(staging: Staging, group: int, rows: Sequence[int], first: int = 0
           ) -> tuple[Staging, np.ndarray, list[int]]:
    """The blocks and fingerprints of staging `rows` (units `first` on of each block) in the
    clear, for a scatter: `staging` and `rows` themselves where none is sealed, else a
    scratch `Staging` of `len(rows)` slots holding them opened, and its rows. The third item
    lists the positions in `rows` that could not be opened (sealed, with no secret kept for
    the slot): their fingerprints are left zero, so they fail their check."""
    at = np.asarray(rows, np.int64)
    nonces = staging.tags[at, TAG_WORDS:] if len(at) else np.zeros((0, 2), np.uint32)
    sealed = nonces.any(axis=1)
    if not sealed.any():
        return staging, at, []
    out = Staging(staging.num_layers, len(at), staging.block_shape, staging.dtype,
                  prints_per_layer=staging.prints_per_layer)
    unknown = []
    for i, (slot, nonce, is_sealed) in enumerate(zip(at.tolist(), nonces, sealed)):
        secret = staging.secrets.get(slot) if is_sealed else None
        if is_sealed and secret is None:
            unknown.append(i)
            continue
        key = seal_key(secret) if secret else None
        for (row, src), (_, dst) in zip(_rows(staging), _rows(out)):
            _crypt_into(key, nonce, group, row, src[slot], dst[i], _at(staging, src, first))
    return out, np.arange(len(at), dtype=np.int64), unknown


def _rows(staging: Staging) -> list[tuple[int, np.ndarray]]:
    """Each region a slot has a row in, sealed, with the row's number in the counter block:
    every layer's, then the fingerprints'."""
    return [*enumerate(staging.regions), (_PRINTS_ROW, staging.prints)]


def _at(staging: Staging, region: np.ndarray, first: int) -> int:
    """Where in the whole block's row a slot's row of `region` starts: at unit `first`."""
    return first * (region[0].nbytes // (staging.prints_per_layer or 1))


def _crypt_into(key: bytes | None, nonce: np.ndarray, group: int, row: int, src: np.ndarray,
                dst: np.ndarray, at: int) -> None:
    """`dst` = `src` under the counter stream of (`key`, `nonce`, `group`, `row`) from byte
    `at` on: encrypted or opened alike (None: a plain copy). `src` may be `dst`."""
    if key is None:
        dst[...] = src
        return
    iv = ((int(nonce[1]) << 32 | int(nonce[0])).to_bytes(8, "big") + group.to_bytes(2, "big")
          + row.to_bytes(2, "big") + (at // 16).to_bytes(4, "big"))
    stream = Cipher(algorithms.AES(key), modes.CTR(iv)).encryptor()
    stream.update(bytes(at % 16))  # the stream from byte `at` on
    plain = np.ascontiguousarray(src).view(np.uint8).reshape(-1)
    dst.view(np.uint8).reshape(-1)[:] = np.frombuffer(stream.update(memoryview(plain)), np.uint8)
