"""What P and D say to each other: transfer params and notification messages (no NIXL).

`ReadParams` are P's `kv_transfer_params` for one request: P's agent,
instance, address and generation, the request's secret (which its staged
blocks' tags are derived from, `kvxfer.device.staging.block_tags`) and its prompt's
digest, and per KV cache group the staging keys (kernel positions) and P
slots of its blocks; with `sources`, every process of a multi-host P and
the units it stages. They pass through the engine and
its proxies, so `ReadParams.parse` checks every field. Notifications are a
magic prefix and versioned JSON (`encode_message`, `decode_message`).
"""


from __future__ import annotations

import array
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvxfer.errors import InvalidInputError, TransferError
from kvxfer.plan.blocks import is_int
from kvxfer.plan.slots import SlotMap

__all__ = ["PROTOCOL_VERSION", "SIGNED", "WHOLE", "WIRE_INT_LIMIT", "ReadParams", "Source",
           "StreamParams", "bound_secret", "check_piece", "decode_message", "done_token",
           "encode_message", "hash_hex", "is_done_token", "is_generation", "is_stream_id",
           "is_wire_index", "message_field", "new_instance", "new_secret", "new_stream_id",
           "params_forged", "parse_entries", "parse_sources", "prompt_digest", "sign_params"]

PROTOCOL_VERSION = 14


_MAGIC = b"kvxfer:"


def encode_message(kind: str, /, **fields: Any) -> bytes:
    """A kvxfer notification: magic prefix, then versioned JSON."""
    return _MAGIC + json.dumps({"v": PROTOCOL_VERSION, "t": kind, **fields}).encode()


def decode_message(raw: bytes, sender: str) -> dict[str, Any]:
    """Parse a kvxfer notification from `sender`; `TransferError` if it is not one."""
    if not isinstance(raw, bytes) or not raw.startswith(_MAGIC):
        raise TransferError(f"message from {sender!r} is not a kvxfer message: {raw[:32]!r}")
    try:
        msg = json.loads(raw[len(_MAGIC) :])
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise TransferError(
            f"message from {sender!r} is corrupt or truncated ({len(raw)} bytes): {e}"
        ) from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise TransferError(f"message from {sender!r} has no type: {str(msg)[:80]}")
    if msg.get("v") != PROTOCOL_VERSION:
        raise TransferError(
            f"peer {sender!r} speaks kvxfer protocol {msg.get('v')!r}, "
            f"this side speaks {PROTOCOL_VERSION}"
        )
    return msg


def message_field(msg: Mapping[str, Any], key: str, check: Callable[[Any], bool], what: str,
           sender: str) -> Any:
    """`msg[key]` if `check` accepts it, else a `TransferError` naming the field and value."""
    value = msg.get(key)
    if not check(value):
        raise TransferError(
            f"{msg.get('t')!r} message from {sender!r}: field {key!r} must be {what}, "
            f"got {value!r:.80}")
    return value


WIRE_INT_LIMIT = 1 << 63
"""Every int read off the wire (block keys, slots, generations) is below this, as numpy's
int64 holds it: a larger one would raise OverflowError where D indexes its staging."""


def is_wire_index(value: object) -> bool:
    """A non-negative int that a peer may send: a block key or a staging slot."""
    return is_int(value) and 0 <= value < WIRE_INT_LIMIT


def is_generation(value: object) -> bool:
    return is_int(value) and 1 <= value < WIRE_INT_LIMIT


def new_instance() -> str:
    """A fresh P instance id: drawn at every start, so params outlive no restart."""
    return secrets.token_hex(8)


def new_secret(key: str | None = None, req_id: str = "", count: int = 0) -> str:
    """A request's secret, 32 hex digits: 128 bits from the OS's CSPRNG or, with `key` (a
    P instance's own secret key, hex), derived from it, the request id and a count (BLAKE2b
    keyed), so that every process of a P across hosts derives the same one. It travels
    only in that request's params; P derives its staged blocks' tags from it."""
    if key is None:
        return secrets.token_hex(16)
    return hashlib.blake2b(f"{req_id}\0{count}".encode(), key=bytes.fromhex(key),
                           digest_size=16).hexdigest()


def entry_secret(key: str, group: int, block_hash: object) -> str:
    """A host pool entry's secret, 32 hex digits, derived from the P instance's key, the KV
    cache group and the block's hash (BLAKE2b keyed): the tags of a pooled block come from
    it, not from one request's secret, so every request whose hash chain holds the block
    reads the same slots, and only params P made for such a request name the secret."""
    data = block_hash if isinstance(block_hash, bytes) else repr(block_hash).encode()
    return hashlib.blake2b(b"entry\0%d\0" % group + data, key=bytes.fromhex(key),
                           digest_size=16).hexdigest()


def hash_hex(block_hash: object) -> str:
    """A block hash as params and tags name it: a vLLM block hash (bytes) in hex, anything
    else by its repr."""
    return block_hash.hex() if isinstance(block_hash, bytes) else repr(block_hash)


def bound_secret(secret: str, identity: str | None) -> str:
    """The secret a staged block's tags come from: `secret` (a request's, or a pool entry's)
    bound to what the block holds, `identity` (the prompt's digest for a request's own
    blocks, the block's hash for a pool entry; None binds nothing). P tags a block under its
    own prompt's identity and D checks it under its own prompt's, never a field of the
    params: params moved to another prompt, or a pool entry named for another block, fail
    their tags though every field of the params was P's."""
    if identity is None:
        return secret
    return hashlib.blake2b(identity.encode(), key=bytes.fromhex(secret), digest_size=16,
                           person=b"kvxfer-bind").hexdigest()


SIGNED = ("peer", "instance", "host", "port", "req_id", "generation", "secret", "groups",
          "sources", "units", "prompt", "num_prompt_tokens", "chain", "expires")
"""The params fields a holder's MAC covers (`sign_params`): every one a reader acts on. Fields a
router adds beside them (`do_remote_prefill`, a stream id) are not covered."""


def _params_mac(key: bytes, params: Mapping[str, Any]) -> str:
    signed = {k: params.get(k) for k in SIGNED}
    body = json.dumps(signed, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hmac.new(key, b"kvxfer-params\0" + body.encode(), hashlib.sha256).hexdigest()


def sign_params(params: Mapping[str, Any], key: bytes, ttl_s: float,
                now: float | None = None) -> dict[str, Any]:
    """`params` with `expires` (wall-clock seconds, `ttl_s` from `now`) and `mac`, an
    HMAC-SHA256 under the fleet key over every field in `SIGNED`: a reader holding the key
    takes only params a holder of the key issued, unedited, before they expire."""
    out = dict(params, expires=round((time.time() if now is None else now) + ttl_s, 3))
    out["mac"] = _params_mac(key, out)
    return out


def params_forged(params: Mapping[str, Any], keys: Sequence[bytes],
                  now: float | None = None) -> str | None:
    """Why a reader holding fleet `keys` refuses `params` (no MAC, one no key verifies: made
    or edited outside the fleet, or expired); None where they are good, or where the reader
    holds no key (it checks nothing)."""
    if not keys:
        return None
    mac = params.get("mac")
    if not isinstance(mac, str):
        return "they carry no MAC of the fleet key (made outside the fleet, or stripped)"
    try:
        good = any(hmac.compare_digest(_params_mac(k, params), mac) for k in keys)
    except (TypeError, ValueError):  # a value JSON cannot hold (NaN, a non-string key)
        good = False
    if not good:
        return "their MAC does not verify under the fleet key (edited, or made outside the fleet)"
    expires = params.get("expires")
    if not isinstance(expires, (int, float)) or (time.time() if now is None else now) > expires:
        return f"they expired (at {expires!r:.20})"
    return None


def done_token(secret: str) -> str:
    """What D's `done` for a request carries, 32 hex digits: derived from the request's
    secret (BLAKE2b), so only a holder of its params can free P's staging of it early,
    and the secret itself travels in no message."""
    if not _is_hex(secret, 32):
        raise InvalidInputError(f"a request secret is 32 hex digits, got {secret!r:.40}")
    return hashlib.blake2b(bytes.fromhex(secret), digest_size=16,
                           person=b"kvxfer-done").hexdigest()


def is_done_token(value: object) -> bool:
    """Whether `value` is shaped as a `done_token` (32 hex digits)."""
    return _is_hex(value, 32)


def new_stream_id() -> str:
    """A fresh stream id, 32 hex digits (128 bits from the OS's CSPRNG): what a router gives
    P (`PrefillScheduler.add_request(..., stream=)`) and D (`StreamParams`) for one request,
    so D can read its blocks while P still prefills it. Whoever knows it may read that
    request's KV: it travels only to the P and the D of that request."""
    return secrets.token_hex(16)


def is_stream_id(value: object) -> bool:
    return _is_hex(value, 32)


def prompt_digest(token_ids: Sequence[int], extra: object = None) -> str:
    """A digest of a prompt's token ids (BLAKE2b, 128 bits, hex) and of `extra`, what else its
    KV depends on (JSON-able: a LoRA adapter, a cache salt, multimodal inputs; None: nothing):
    what binds P's params, and its blocks' tags, to the prompt P computed, so D never takes
    them for another prompt."""
    try:
        raw = array.array("q", token_ids).tobytes()
    except (TypeError, OverflowError):
        raise InvalidInputError(f"prompt token ids must be ints, got {token_ids!r:.80}") from None
    digest = hashlib.blake2b(raw, digest_size=16)
    if extra is not None:
        digest.update(b"\0" + json.dumps(extra, sort_keys=True, default=repr).encode())
    return digest.hexdigest()


def _is_hex(value: object, digits: int) -> bool:
    if not isinstance(value, str) or len(value) != digits:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Source:
    """One P process of a multi-host P instance: its agent and the units `[lo, hi)` it stages."""

    peer: str
    lo: int
    hi: int


@dataclass(frozen=True)
class StreamParams:
    """What D needs to read a request while P still prefills it: P's agent and address and
    the request's stream id (the router gave P the same id). P names each block as it
    becomes final (`chunk` notifications), with the request's secret, instance and, with
    its last chunk, the generation D's `done` names (`kvxfer.nixl.prefill`)."""

    peer: str
    host: str
    port: int
    stream: str

    @classmethod
    def parse(cls, params: object) -> StreamParams:
        """Check every field; `InvalidInputError` naming the first bad one."""
        if not isinstance(params, Mapping):
            raise InvalidInputError(f"stream params must be a dict, got {type(params).__name__}")
        checks: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
            ("peer", lambda v: isinstance(v, str) and bool(v), "a non-empty str"),
            ("host", lambda v: isinstance(v, str) and bool(v), "a non-empty str"),
            ("port", lambda v: is_int(v) and 0 <= v <= 65535, "an int port"),
            ("stream", is_stream_id, "32 hex digits (a stream id)"))
        for key, check, what in checks:
            if not check(params.get(key)):
                raise InvalidInputError(f"stream params field {key!r} must be {what}, "
                                        f"got {params.get(key)!r:.80}")
        return cls(params["peer"], params["host"], params["port"], params["stream"])

    @staticmethod
    def given(params: object) -> bool:
        """Whether `params` ask for a stream (they name one) rather than P's finished params."""
        return isinstance(params, Mapping) and "stream" in params and "groups" not in params

    def to_dict(self) -> dict[str, Any]:
        return {"peer": self.peer, "host": self.host, "port": self.port, "stream": self.stream}


@dataclass(frozen=True)
class ReadParams:
    """P's transfer params for one request, checked (`ReadParams.parse`).

    `keys[g]` are the staging keys of group `g`'s blocks, `slots[g]` their P slots.
    `entries[g]`: `(key, secret)` of the keys whose blocks are P's host pool entries, shared
    by every request whose hash chain holds them: their tags come from that entry secret
    (`entry_secret`), the other keys' from `secret`. `sources` (empty where P's scheduler
    has not yet heard from its workers: P's one agent holds every unit) lists every process
    of P and the units of each block it stages (`kvxfer.device.pieces`), of `units`; every
    one of them stages the same slots.
    """

    peer: str
    instance: str
    host: str
    port: int
    req_id: str
    generation: int
    keys: tuple[tuple[int, ...], ...]
    slots: tuple[tuple[int, ...], ...]
    secret: str
    prompt: str | None = None
    sources: tuple[Source, ...] = ()
    units: int = 0
    entries: tuple[tuple[tuple[int, str], ...], ...] = ()

    @classmethod
    def parse(cls, params: object, num_groups: int) -> ReadParams:
        """Check every field's type and range; `InvalidInputError` naming the first bad one."""
        if not isinstance(params, Mapping):
            raise InvalidInputError(f"transfer params must be a dict, got {type(params).__name__}")

        def get(key: str, check: Callable[[Any], bool], what: str) -> Any:
            value = params.get(key)
            if not check(value):
                raise InvalidInputError(f"transfer params field {key!r} must be {what}, "
                                        f"got {value!r:.80}")
            return value

        def is_str(v: object) -> bool:
            return isinstance(v, str) and bool(v)

        groups = get("groups", lambda v: isinstance(v, list) and len(v) == num_groups,
                     f"a list of {num_groups} groups")
        keys, slots, entries = [], [], []
        for g, group in enumerate(groups):
            k = group.get("keys") if isinstance(group, Mapping) else None
            s = group.get("slots") if isinstance(group, Mapping) else None
            if not (isinstance(k, list) and isinstance(s, list) and len(k) == len(s)
                    and all(is_wire_index(x) for x in k + s)):
                raise InvalidInputError(
                    f"transfer params group {g} must have equal-length lists of non-negative int "
                    f"'keys' and 'slots' below 2**63, got {group!r:.120}")
            if len(set(k)) != len(k) or len(set(s)) != len(s):
                raise InvalidInputError(f"transfer params group {g} repeats a key or a slot")
            keys.append(tuple(k))
            slots.append(tuple(s))
            entries.append(parse_entries(group.get("entries"), k, g))
        if not any(keys):
            raise InvalidInputError("transfer params name no block in any group")
        sources, units = parse_sources(params.get("sources"), params.get("units"))
        return cls(
            peer=get("peer", is_str, "a non-empty str"),
            instance=get("instance", is_str, "a non-empty str"),
            host=get("host", is_str, "a non-empty str"),
            # 0: P has no listener; D finds it by name in etcd.
            port=get("port", lambda v: is_int(v) and 0 <= v <= 65535, "an int port"),
            req_id=get("req_id", is_str, "a non-empty str"),
            generation=get("generation", is_generation, "a positive int"),
            keys=tuple(keys),
            slots=tuple(slots),
            secret=get("secret", lambda v: _is_hex(v, 32), "32 hex digits"),
            prompt=get("prompt", lambda v: v is None or _is_hex(v, 32),
                       "absent or 32 hex digits (a prompt_digest)"),
            sources=sources,
            units=units,
            entries=tuple(entries) if any(entries) else (),
        )

    @classmethod
    def staged(cls, slot_maps: Sequence[SlotMap], req_id: str, *, peer: str, instance: str,
               host: str, port: int, generation: int, secret: str,
               prompt: str | None = None, sources: Sequence[Source] = (),
               units: int = 0, entries: Sequence[Mapping[int, str]] = ()) -> ReadParams | None:
        """The params of everything `req_id` has staged, one slot map per group (None if
        nothing); `entries[g]` maps the keys of group `g` that are pool entries to their
        entry secrets."""
        keys = [m.blocks(req_id) if req_id in m else [] for m in slot_maps]
        if not any(keys):
            return None
        shared = tuple(tuple((k, e[k]) for k in ks if k in e)
                       for ks, e in zip(keys, entries)) if entries else ()
        return cls(peer=peer, instance=instance, host=host, port=port, req_id=req_id,
                   generation=generation, keys=tuple(map(tuple, keys)),
                   slots=tuple(tuple(m.slots(req_id, k)) if k else ()
                               for m, k in zip(slot_maps, keys)),
                   secret=secret, prompt=prompt, sources=tuple(sources), units=units,
                   entries=shared if any(shared) else ())

    def tag_secrets(self, group: int, prompt: str | None,
                    hashes: Sequence[str] | None) -> list[str]:
        """The secret each key of `group` has its tags from, in key order, as the reader
        checks them (`bound_secret`): a pool entry's bound to the reader's own block hash at
        that key (`hashes[key]`, by kernel position; none there binds it to no hash P made),
        the others' to the reader's own prompt digest `prompt` (None: the one these params
        name, for a reader that does not know its prompt)."""
        shared = dict(self.entries[group]) if self.entries else {}
        own = bound_secret(self.secret, self.prompt if prompt is None else prompt)
        hashes = hashes or ()
        return [own if k not in shared else bound_secret(
                    shared[k], hashes[k] if k < len(hashes) and hashes[k] else "(none)")
                for k in self.keys[group]]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able params (what `parse` reads back)."""
        out = {
            "peer": self.peer, "instance": self.instance, "host": self.host, "port": self.port,
            "req_id": self.req_id, "generation": self.generation, "secret": self.secret,
            "groups": [{"keys": list(k), "slots": list(s)} for k, s in zip(self.keys, self.slots)],
        }
        for group, shared in zip(out["groups"], self.entries):
            if shared:
                group["entries"] = [[k, secret] for k, secret in shared]
        if self.prompt is not None:
            out["prompt"] = self.prompt
        if self.sources:
            out["units"] = self.units
            out["sources"] = [{"peer": s.peer, "units": [s.lo, s.hi]} for s in self.sources]
        return out

    def from_one_agent(self, units: int) -> ReadParams:
        """These params, naming P's one agent (`peer`) as holding all `units` of each block
        where they name no sources (P's scheduler had not yet heard from its workers)."""
        if self.sources:
            return self
        return replace(self, sources=(Source(self.peer, 0, units),), units=units)

    @property
    def peers(self) -> list[str]:
        """Every P agent that stages a piece of the request (P's one agent for one process)."""
        return [s.peer for s in self.sources] if self.sources else [self.peer]


def parse_entries(entries: object, keys: Sequence[int], group: int) -> tuple[tuple[int, str], ...]:
    """A params group's (or a stream chunk's) `entries` (absent: none), checked: `[key, entry
    secret]` pairs of distinct keys the group names."""
    if entries is None:
        return ()
    named = set(keys)
    if not (isinstance(entries, list) and len(entries) <= len(keys) and all(
            isinstance(e, list) and len(e) == 2 and is_wire_index(e[0]) and e[0] in named
            and _is_hex(e[1], 32) for e in entries)
            and len({e[0] for e in entries}) == len(entries)):
        raise InvalidInputError(f"transfer params group {group} 'entries' must be distinct "
                                f"[key, 32 hex digits] pairs of the group's keys, got "
                                f"{entries!r:.120}")
    return tuple((k, secret) for k, secret in entries)


def parse_sources(sources: object, units: object) -> tuple[tuple[Source, ...], int]:
    """Multi-host P's `sources` and `units` (absent for one process), checked.

    The distinct unit ranges must tile `[0, units)`; several sources with one
    range are replicas (a cache replicated over the mesh).
    """
    if sources is None and units is None:
        return (), 0
    if not is_int(units) or not 0 < units < WIRE_INT_LIMIT:
        raise InvalidInputError(f"transfer params field 'units' must be a positive int below "
                                f"2**63, got {units!r:.80}")
    if not isinstance(sources, list) or not sources:
        raise InvalidInputError(f"transfer params field 'sources' must be a non-empty list, "
                                f"got {sources!r:.80}")
    out = []
    for entry in sources:
        peer = entry.get("peer") if isinstance(entry, Mapping) else None
        span = entry.get("units") if isinstance(entry, Mapping) else None
        if not (isinstance(peer, str) and peer and isinstance(span, list) and len(span) == 2
                and all(is_int(u) for u in span) and 0 <= span[0] < span[1] <= units):
            raise InvalidInputError(f"transfer params source must be {{'peer': name, 'units': "
                                    f"[lo, hi]}} within {units} units, got {entry!r:.80}")
        out.append(Source(peer, span[0], span[1]))
    if len({s.peer for s in out}) != len(out):
        raise InvalidInputError(f"transfer params sources repeat a peer: {[s.peer for s in out]}")
    ranges = sorted({(s.lo, s.hi) for s in out})
    if ranges[0][0] != 0 or ranges[-1][1] != units or any(
            a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        raise InvalidInputError(f"transfer params sources' unit ranges {ranges} do not tile "
                                f"[0, {units})")
    return tuple(out), units


WHOLE = (0, 1, 1)
"""The piece of a staging of plain blocks: each block one unit (`check_piece(None)`)."""


def check_piece(piece: object) -> tuple[int, int, int]:
    """`(lo, hi, units)`: the units `[lo, hi)` of `units` a staging holds of each block;
    None is `WHOLE`."""
    if piece is None:
        return WHOLE
    if not (isinstance(piece, (tuple, list)) and len(piece) == 3 and all(is_int(v) for v in piece)
            and 0 <= piece[0] < piece[1] <= piece[2]):
        raise InvalidInputError(f"piece must be None or (lo, hi, units) with 0 <= lo < hi <= "
                                f"units, got {piece!r:.80}")
    return (int(piece[0]), int(piece[1]), int(piece[2]))
