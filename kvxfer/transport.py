"""NIXL transport: agents, handshake, descriptors, reads, notifications, leases.

The only kvxfer module that imports NIXL (`_nixl()`). One agent per process,
UCX backend, registering the regions of one `kvxfer.staging.Staging` per KV
cache group once.

Identity. A P transport draws a random `instance` id at every start; it is in
its advertisement, in every param set it hands out, and in every `done` and
`hb` D sends back. A P restarted under the same agent name is a new instance:
params from before the restart are refused (D reports the request failed,
and the new P acks any `done` for another instance with `ok: false`), so a
read can never be served by blocks of an unrelated prefill. A request id is
held once at a time.

Handshake, all NIXL-native. Both agents run NIXL's metadata listener. D
fetches P's agent metadata from P's listener (`fetch_remote_metadata`, polled
with a deadline), pushes its own to P (`send_local_metadata`) so P can answer,
then sends a `hello` notification. P answers with a `layout` notification:
versioned JSON carrying its instance, its cache layout (the caller's dict)
and, per group, its staging regions (base addresses, lengths, block bytes).
D checks it against its own before any read and raises `LayoutMismatchError`
naming the differing fields. Bytes that are not a kvxfer message, truncated
JSON, or another version raise `TransferError` naming the peer.

With `TransportConfig.etcd_endpoints` no listener runs: every agent
publishes its metadata to etcd (NIXL's metadata service) under its name when
it starts and withdraws it when it closes; D fetches P's by name, and P
fetches D's by name when D's `hello` arrives. The rest is the same.

Reads. P's `hold(req_id)` starts a lease and returns the transfer params
(JSON-able; the engine forwards them to D as vLLM forwards
`kv_transfer_params`): P's agent name, instance, address, a generation and,
per group, the staging keys of the request's blocks (what the caller staged
them under: `kvxfer.connector` uses table positions) and their P slots. A
caller that makes the params elsewhere (vLLM's scheduler process, which must
hand them out before the worker has saved the last chunk) builds them with
`ReadParams(...).to_dict()` and starts the lease with `lease(req_id,
generation)`. D's `start_read` stages the same keys in its own slots and
posts one NIXL READ with one descriptor per (group, layer, run of slots
contiguous on both sides), plus one per run for the slots' fingerprint rows
(`Staging.prints`), so a request staged in one slot run costs one descriptor
per layer and one more. READs are posted on a thread of D's own, in order:
over UCX `cma` the post is the copy itself, done while NIXL holds the agent
(it releases the GIL), so any NIXL call from the engine's thread would wait
for it. While a post is under way `poll` leaves the agent alone: the
engine's thread spends about 1 ms in kvxfer while a 64 MiB request is read
in `bench e2e`, against 4.3-4.9 ms when polls waited on the agent. The agent
runs in NIXL's thread-safe mode. A read that fails while its post is under
way cancels it if it has not started, else waits for it (before, the post
ran inside `start_read`), then for NIXL to release it, before its slots are
reused. A post that never returned would stall D's reads, as it stalled
`start_read` before.

Completion and leases. When the READ is done D sends `done(req, instance,
generation)`; P frees the request's slots and answers `ack` with `ok` true
only if the request was still held under that instance and generation. P
frees a held request when D says done or when its lease expires (`lease_s`,
extended by D's `hb` heartbeats); every lease is scanned on each `poll`.
Soundness of a late read: P frees only inside `poll`, and a lease once
expired is never revived, so "held when the `done` arrived" implies "held
during the whole read" (the READ completed before `done` was sent). D reports
a request finished only after an `ok` ack; a read of freed (possibly reused)
slots gets `ok: false` and is reported failed, never delivered as data.

Failures never hang D. Every read has a deadline (`transfer_timeout_s`) from
`start_read` to the ack; a transfer error, a disconnected peer, a refused
ack, stale params, or the deadline yields the request id and the logical
block ids the caller gave as failed, for the engine to recompute. A peer
whose READ or notification fails is dropped (its other reads fail with it)
and the next request to it connects afresh, so a restarted P is reached again
on its old port or a new one. D's slots of a failed read are released only
once NIXL has released the transfer (an in-flight READ could otherwise land
in slots reused by another request).

Hostile or malformed peers. A notification whose fields have the wrong type
or range is logged and dropped alone; the rest of the batch is handled, and
`poll` never raises because of what a peer sent.

Heterogeneous TP. The transport moves staged blocks as bytes; whether two
layouts may exchange them is the `layout_check`'s call. The default
(`check_layouts`) rejects a peer whose `tp_size` differs, for staging that
holds one rank's shard of each block: with `[blocks, tokens, heads, p, dim]`
a head slice is not contiguous inside a block, so per-rank staging would need
a heads-outer layout or per-token descriptors. `kvxfer.connector` instead
stages whole blocks gathered from all of a process's shards and checks only
the block bytes (`check_block_compatible`), so P and D may shard differently
and D re-shards on scatter.

Single-threaded for the caller: call each transport from one thread (the
engine's). D posts its READs from a thread of its own (see Reads).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.blocks import coalesce_pairs, is_int
from kvxfer.errors import InvalidInputError, LayoutMismatchError, TransferError
from kvxfer.staging import SlotMap, Staging

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 3
_MAGIC = b"kvxfer:"
_MAX_BIND_TRIES = 8
_REFETCH_S = 0.25  # how often `connect` asks for a peer's metadata again


@dataclass(frozen=True)
class TransportConfig:
    """Everything the transport reads, in one place.

    - `name`: this agent's name; P's name is what D connects to. Unique among
      the live agents of a process.
    - `host`: the address this agent is reached at (advertised by P in params).
    - `listen_port`: NIXL metadata listener port; 0 picks a free one.
    - `handshake_timeout_s`: deadline of `connect`.
    - `transfer_timeout_s`: deadline of one read, from `start_read` to P's ack.
    - `lease_s`: how long P holds a request's blocks without news from D.
    - `heartbeat_interval_s`: how often D extends leases of requests it still wants.
    - `ucx_tls`: `UCX_TLS` for this agent's UCX context (set only while the agent
      is created); `cma,tcp,self` reads host memory faster between processes
      on one machine than UCX's default choice. None keeps UCX's default.
    - `num_threads`: UCX backend worker threads (0: NIXL's default).
    - `progress_wake_us`: the timeout, in microseconds, of the `poll()` in which
      NIXL's UCX progress thread waits for events (it wakes at once when one
      arrives; the timeout only bounds a missed wake-up; NIXL rounds it up to
      whole milliseconds). NIXL's Python API passes 0, and then the thread
      spins: every agent holds a whole core while idle (measured: 3.0 CPU-s
      per 3 s idle, against 0.06 with 1,000). 0 keeps NIXL's spinning thread.
    - `etcd_endpoints`: NIXL's central metadata service (`NIXL_ETCD_ENDPOINTS`,
      for example `http://10.0.0.2:2379`). Every agent publishes its metadata
      there under its name and fetches its peers' by name, so many P and D
      agents need no pairwise listener handshake; no listener is started
      (`listen_port` is unused, params still carry `host`). None: D fetches
      from P's listener at `host:listen_port`, as between two processes.

    Per-slot prepared descriptor lists (`prep_xfer_dlist`) were measured and
    dropped: with runs placement they were no faster (0.79-0.89x memcpy vs
    0.87-0.92x), NIXL merging adjacent per-slot descriptors itself.
    """

    name: str
    host: str = "127.0.0.1"
    listen_port: int = 0
    handshake_timeout_s: float = 10.0
    transfer_timeout_s: float = 10.0
    lease_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    ucx_tls: str | None = "cma,tcp,self"
    num_threads: int = 0
    progress_wake_us: int = 1000
    etcd_endpoints: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.isprintable():
            raise InvalidInputError(f"TransportConfig name must be a non-empty printable str, "
                                    f"got {self.name!r}")
        if not isinstance(self.host, str) or not self.host:
            raise InvalidInputError(f"TransportConfig host must be a non-empty str, got {self.host!r}")
        if not is_int(self.listen_port) or not 0 <= self.listen_port <= 65535:
            raise InvalidInputError(
                f"TransportConfig listen_port must be an int in [0, 65535], got {self.listen_port!r}")
        for name in ("handshake_timeout_s", "transfer_timeout_s", "lease_s", "heartbeat_interval_s"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not math.isfinite(value) or value <= 0):
                raise InvalidInputError(
                    f"TransportConfig {name} must be a positive finite number of seconds, "
                    f"got {value!r}")
        if self.heartbeat_interval_s >= self.lease_s:
            raise InvalidInputError(
                f"TransportConfig heartbeat_interval_s {self.heartbeat_interval_s} must be shorter "
                f"than lease_s {self.lease_s}, or heartbeats cannot keep a lease alive")
        if self.ucx_tls is not None and (not isinstance(self.ucx_tls, str) or not self.ucx_tls):
            raise InvalidInputError(
                f"TransportConfig ucx_tls must be None or a non-empty str, got {self.ucx_tls!r}")
        if not is_int(self.num_threads) or self.num_threads < 0:
            raise InvalidInputError(
                f"TransportConfig num_threads must be a non-negative int, got {self.num_threads!r}")
        if not is_int(self.progress_wake_us) or not 0 <= self.progress_wake_us <= 10**7:
            raise InvalidInputError(f"TransportConfig progress_wake_us must be an int in "
                                    f"[0, 10_000_000], got {self.progress_wake_us!r}")
        if self.etcd_endpoints is not None and not (
                isinstance(self.etcd_endpoints, str) and self.etcd_endpoints.isprintable()
                and all(e.startswith(("http://", "https://")) and len(e) > 8
                        for e in self.etcd_endpoints.split(","))):
            raise InvalidInputError(
                f"TransportConfig etcd_endpoints must be None or comma-separated http(s):// "
                f"URLs, got {self.etcd_endpoints!r}")
        if self.etcd_endpoints is not None and self.listen_port != 0:
            raise InvalidInputError(
                f"TransportConfig listen_port {self.listen_port} is unused with etcd_endpoints "
                f"(no listener runs); leave it 0")

    @property
    def uses_etcd(self) -> bool:
        return self.etcd_endpoints is not None


def _nixl() -> tuple[Any, Any]:
    """`(nixl_agent, nixl_agent_config)`: the one place NIXL is imported."""
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config
    # NIXL's Python logger prints INFO to stdout, which would corrupt `--json`
    # output: keep its records on stderr and, unless NIXL_LOG_LEVEL says
    # otherwise, at WARNING.
    nixl_logger = logging.getLogger("nixl")
    for handler in nixl_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (racy: callers retry if it is taken meanwhile)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_live_names: set[str] = set()
_live_lock = threading.Lock()


def _claim_name(name: str) -> None:
    """Two live agents of one process may not share a name (NIXL tells peers apart by it)."""
    with _live_lock:
        if name in _live_names:
            raise InvalidInputError(
                f"a NIXL agent named {name!r} is already live in this process; "
                f"close it first or pick another name")
        _live_names.add(name)


def _release_name(name: str) -> None:
    with _live_lock:
        _live_names.discard(name)


def _create_agent(config: TransportConfig) -> tuple[Any, int]:
    """`(agent, listen port)`; the port is 0 with etcd (no listener)."""
    nixl_agent, nixl_agent_config = _nixl()
    api = sys.modules.get(nixl_agent.__module__)  # what the two helpers below reach into
    tries = _MAX_BIND_TRIES if config.listen_port == 0 and not config.uses_etcd else 1
    # Both are read when the agent is created, and only then.
    env = {"UCX_TLS": config.ucx_tls, "NIXL_ETCD_ENDPOINTS": config.etcd_endpoints}
    old = {key: os.environ.get(key) for key in env}
    try:
        for key, value in env.items():
            if value is not None:
                os.environ[key] = value
            elif key == "NIXL_ETCD_ENDPOINTS":
                os.environ.pop(key, None)  # listener mode: never an inherited etcd
        for attempt in range(tries):
            port = 0 if config.uses_etcd else config.listen_port or free_port()
            nixl_config = nixl_agent_config(
                enable_listen_thread=not config.uses_etcd, listen_port=port,
                num_threads=config.num_threads, sync_mode=_strict_sync(api),
            )
            try:
                with _progress_wake(api, config.progress_wake_us):
                    return nixl_agent(config.name, nixl_config), port
            except RuntimeError as e:
                if "bind" not in str(e).lower() or attempt == tries - 1:
                    raise TransferError(
                        f"cannot create NIXL agent {config.name!r} on port {port}: {e}"
                    ) from e
        raise AssertionError("unreachable")
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _strict_sync(api: Any) -> Any:
    """NIXL's thread-safe agent mode (D posts READs from a thread of its own). NIXL picks
    it itself only with a listener; None where `api` (NIXL's Python API module) does not
    name it (then NIXL's default applies)."""
    return getattr(getattr(api, "nixl_thread_sync_t", None), "NIXL_THREAD_SYNC_STRICT", None)


@contextlib.contextmanager
def _progress_wake(api: Any, wake_us: int) -> Iterator[None]:
    """While an agent is created: its progress thread's poll timeout is `wake_us`.

    `nixl_agent.__init__` builds its C++ config from the bindings' `nixlAgentConfig`
    and sets `pthrDelay = 0` (a spinning thread), with no argument to change it.
    For the constructor's duration only, the bindings hand it a subclass whose
    `pthrDelay` is at least `wake_us`. Where the API has another shape, the agent
    is created as NIXL makes it, with a warning.
    """
    bindings = getattr(api, "nixlBind", None)
    with _patch_lock:  # agents created on two threads at once would patch over each other
        base = getattr(bindings, "nixlAgentConfig", None)
        if wake_us == 0 or base is None or not isinstance(getattr(base, "pthrDelay", None),
                                                         property):
            if wake_us:
                logger.warning("cannot set NIXL's progress-thread wake-up; its thread may spin")
            yield
            return
        delay = base.pthrDelay

        class _Config(base):  # type: ignore[misc, valid-type]
            pthrDelay = property(delay.fget, lambda self, us: delay.fset(self, max(us, wake_us)))

        bindings.nixlAgentConfig = _Config
        try:
            yield
        finally:
            bindings.nixlAgentConfig = base


_patch_lock = threading.Lock()


def _new_patch_lock() -> None:
    global _patch_lock
    _patch_lock = threading.Lock()  # a forked child may inherit it held


os.register_at_fork(after_in_child=_new_patch_lock)


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


def _field(msg: Mapping[str, Any], key: str, check: Callable[[Any], bool], what: str,
           sender: str) -> Any:
    """`msg[key]` if `check` accepts it, else a `TransferError` naming the field and value."""
    value = msg.get(key)
    if not check(value):
        raise TransferError(
            f"{msg.get('t')!r} message from {sender!r}: field {key!r} must be {what}, "
            f"got {value!r:.80}")
    return value


def _is_generation(value: object) -> bool:
    return is_int(value) and value >= 1


LayoutCheck = Callable[[Mapping[str, Any], Mapping[str, Any]], None]

_PER_RANK_KEYS = frozenset({"tp_rank"})


def check_layouts(local: Mapping[str, Any], remote: Mapping[str, Any]) -> None:
    """Default peer check: every layout field but per-rank ones must be equal.

    Raises `LayoutMismatchError` listing each differing field with both values.
    """
    if local.get("tp_size") != remote.get("tp_size"):
        raise LayoutMismatchError(
            f"heterogeneous TP is not supported: peer tp_size={remote.get('tp_size')!r}, "
            f"local tp_size={local.get('tp_size')!r}"
        )
    diffs = [
        f"{key}: peer={remote.get(key)!r} local={local.get(key)!r}"
        for key in sorted(set(local) | set(remote))
        if key not in _PER_RANK_KEYS and local.get(key) != remote.get(key)
    ]
    if diffs:
        raise LayoutMismatchError("peer cache layout differs: " + "; ".join(diffs))


def _stagings(staging: Staging | Sequence[Staging]) -> list[Staging]:
    """One staging per KV cache group; a single `Staging` is one group."""
    out = [staging] if isinstance(staging, Staging) else list(staging)
    if not out or not all(isinstance(s, Staging) for s in out):
        raise InvalidInputError(
            f"staging must be a Staging or a non-empty list of them (one per KV cache group), "
            f"got {staging!r:.80}")
    return out


def _start_agent(config: TransportConfig, stagings: Sequence[Staging]) -> tuple[Any, int, Any]:
    """`(agent, listen port, registration)`: a new agent under a name no live agent has."""
    if not isinstance(config, TransportConfig):
        raise InvalidInputError(f"config must be a TransportConfig, got {config!r:.80}")
    _claim_name(config.name)
    try:
        agent, port = _create_agent(config)
        regs = [(addr, n, 0, "") for s in stagings
                for addr, n in [*s.region_addresses(), s.prints_address()]]
        reg = agent.register_memory(regs, "DRAM")
        if config.uses_etcd:
            try:  # under our name, with the registered regions: peers fetch it by name
                agent.send_local_metadata()
            except Exception as e:
                _close_agent(agent, reg, config.name, etcd=False)
                raise TransferError(f"NIXL agent {config.name!r} cannot publish its metadata "
                                    f"to etcd at {config.etcd_endpoints}: {e}") from e
        return agent, port, reg
    except BaseException:
        _release_name(config.name)
        raise


def _close_agent(agent: Any, reg: Any, who: str, etcd: bool = False) -> None:
    if etcd:
        try:  # peers that fetch it now find nothing, not a dead agent
            agent.invalidate_local_metadata()
        except Exception as e:  # closing must not raise: the process may be going down
            logger.warning("%s metadata invalidation failed: %s", who, e)
    try:
        agent.deregister_memory(reg)
    except Exception as e:
        logger.warning("%s deregister failed: %s", who, e)


def _send(nixl: Any, peer: str, kind: str, /, **fields: Any) -> None:
    try:
        nixl.send_notif(peer, encode_message(kind, **fields))
    except Exception as e:  # NIXL raises its own exception types for a gone peer
        raise TransferError(f"cannot send {kind!r} to peer {peer!r}: {e}") from e


def _free_everywhere(stagings: Sequence[Staging], req_id: str) -> None:
    for staging in stagings:
        if req_id in staging:
            staging.free(req_id)


# ---------------------------------------------------------------------- params


def new_instance() -> str:
    """A fresh P instance id: drawn at every start, so params outlive no restart."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Source:
    """One P process of a multi-host P instance: its agent and the units `[lo, hi)` it stages."""

    peer: str
    lo: int
    hi: int


@dataclass(frozen=True)
class ReadParams:
    """P's transfer params for one request, checked (`ReadParams.parse`).

    `keys[g]` are the staging keys of group `g`'s blocks, `slots[g]` their P slots.
    `sources` (empty for a P of one process, which stages whole blocks) lists
    every process of a multi-host P and the units of each block it stages
    (`kvxfer.pieces`), of `units`; every one of them stages the same slots.
    """

    peer: str
    instance: str
    host: str
    port: int
    req_id: str
    generation: int
    keys: tuple[tuple[int, ...], ...]
    slots: tuple[tuple[int, ...], ...]
    sources: tuple[Source, ...] = ()
    units: int = 0

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
        keys, slots = [], []
        for g, group in enumerate(groups):
            k = group.get("keys") if isinstance(group, Mapping) else None
            s = group.get("slots") if isinstance(group, Mapping) else None
            if not (isinstance(k, list) and isinstance(s, list) and len(k) == len(s)
                    and all(is_int(x) and x >= 0 for x in k + s)):
                raise InvalidInputError(
                    f"transfer params group {g} must have equal-length lists of non-negative int "
                    f"'keys' and 'slots', got {group!r:.120}")
            if len(set(k)) != len(k) or len(set(s)) != len(s):
                raise InvalidInputError(f"transfer params group {g} repeats a key or a slot")
            keys.append(tuple(k))
            slots.append(tuple(s))
        if not any(keys):
            raise InvalidInputError("transfer params name no block in any group")
        sources, units = _parse_sources(params.get("sources"), params.get("units"))
        return cls(
            peer=get("peer", is_str, "a non-empty str"),
            instance=get("instance", is_str, "a non-empty str"),
            host=get("host", is_str, "a non-empty str"),
            # 0: P has no listener; D finds it by name in etcd.
            port=get("port", lambda v: is_int(v) and 0 <= v <= 65535, "an int port"),
            req_id=get("req_id", is_str, "a non-empty str"),
            generation=get("generation", _is_generation, "a positive int"),
            keys=tuple(keys),
            slots=tuple(slots),
            sources=sources,
            units=units,
        )

    @classmethod
    def staged(cls, slot_maps: Sequence[SlotMap], req_id: str, *, peer: str, instance: str,
               host: str, port: int, generation: int, sources: Sequence[Source] = (),
               units: int = 0) -> ReadParams | None:
        """The params of everything `req_id` has staged, one slot map per group (None if nothing)."""
        keys = [m.blocks(req_id) if req_id in m else [] for m in slot_maps]
        if not any(keys):
            return None
        return cls(peer=peer, instance=instance, host=host, port=port, req_id=req_id,
                   generation=generation, keys=tuple(map(tuple, keys)),
                   slots=tuple(tuple(m.slots(req_id, k)) if k else ()
                               for m, k in zip(slot_maps, keys)),
                   sources=tuple(sources), units=units)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able params (what `parse` reads back)."""
        out = {
            "peer": self.peer, "instance": self.instance, "host": self.host, "port": self.port,
            "req_id": self.req_id, "generation": self.generation,
            "groups": [{"keys": list(k), "slots": list(s)} for k, s in zip(self.keys, self.slots)],
        }
        if self.sources:
            out["units"] = self.units
            out["sources"] = [{"peer": s.peer, "units": [s.lo, s.hi]} for s in self.sources]
        return out

    @property
    def peers(self) -> list[str]:
        """Every P agent that stages a piece of the request (P's one agent for one process)."""
        return [s.peer for s in self.sources] if self.sources else [self.peer]


def _parse_sources(sources: object, units: object) -> tuple[tuple[Source, ...], int]:
    """Multi-host P's `sources` and `units` (absent for one process), checked.

    The distinct unit ranges must tile `[0, units)`; several sources with one
    range are replicas (a cache replicated over the mesh).
    """
    if sources is None and units is None:
        return (), 0
    if not is_int(units) or units <= 0:
        raise InvalidInputError(f"transfer params field 'units' must be a positive int, "
                                f"got {units!r:.80}")
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


# ---------------------------------------------------------------------- P side


@dataclass
class _Lease:
    generation: int
    expires: float
    done_by: set[int] = field(default_factory=set)  # D processes (readers) that said done


def _check_piece(piece: object) -> tuple[int, int, int] | None:
    if piece is None:
        return None
    if not (isinstance(piece, (tuple, list)) and len(piece) == 3 and all(is_int(v) for v in piece)
            and 0 <= piece[0] < piece[1] <= piece[2]):
        raise InvalidInputError(f"piece must be None or (lo, hi, units) with 0 <= lo < hi <= "
                                f"units, got {piece!r:.80}")
    return (int(piece[0]), int(piece[1]), int(piece[2]))


class PrefillTransport:
    """P side: serves staged blocks to D and frees them on `done` or lease expiry.

    **Arguments:**

    - `config`: `TransportConfig`; `config.name` is the name D connects to.
    - `staging`: the staging P saves blocks into, one per KV cache group (a
      single `Staging` is one group); their regions are registered here.
    - `layout`: JSON-able cache layout advertised to D at handshake.
    - `instance`: this start's identity (`new_instance()` when None); a
      scheduler that hands out params in another process draws it and passes
      it here.
    - `piece`: `(lo, hi, units)` for one process of a multi-host P, whose
      staging holds units `[lo, hi)` of each block (`kvxfer.pieces`); None
      for whole blocks.

    With several D processes (readers), P frees a request's slots once every
    one of them has said done (each names itself and their count), or when
    its lease expires.
    """

    def __init__(self, config: TransportConfig, staging: Staging | Sequence[Staging],
                 layout: Mapping[str, Any], instance: str | None = None,
                 piece: tuple[int, int, int] | None = None):
        self.config, self.stagings, self.layout = config, _stagings(staging), dict(layout)
        if instance is not None and (not isinstance(instance, str) or not instance):
            raise InvalidInputError(f"instance must be a non-empty str, got {instance!r}")
        self.piece = _check_piece(piece)
        self.instance = instance or new_instance()
        self.agent, self.port, self._reg = _start_agent(config, self.stagings)
        self._leases: dict[str, _Lease] = {}
        self._next_generation = 1
        self._hellos: dict[str, float] = {}  # D agent -> deadline to answer by
        self._freed: list[str] = []

    @property
    def staging(self) -> Staging:
        """The first group's staging (the only one for a single-group model)."""
        return self.stagings[0]

    def advertisement(self) -> dict[str, Any]:
        """What D receives at handshake (the `layout` message's fields)."""
        return {
            "agent": self.config.name,
            "instance": self.instance,
            "piece": list(self.piece) if self.piece else None,
            "layout": self.layout,
            "groups": [{"regions": [list(r) for r in s.region_addresses()],
                        "prints": list(s.prints_address()),
                        "block_bytes": s.block_bytes, "num_slots": s.num_slots}
                       for s in self.stagings],
        }

    def hold(self, req_id: str, now: float | None = None) -> dict[str, Any]:
        """Start `req_id`'s lease; returns the params D needs to read it.

        Call once the request's last chunk is staged. A request is held once:
        holding it again before it is freed raises `InvalidInputError`.
        """
        if req_id in self._leases:
            raise InvalidInputError(f"request {req_id!r} is already held for D")
        params = ReadParams.staged(self.stagings, req_id, peer=self.config.name,
                                   instance=self.instance, host=self.config.host,
                                   port=self.port, generation=self._next_generation)
        if params is None:
            raise InvalidInputError(f"request {req_id!r} has nothing staged to hold")
        self.lease(req_id, params.generation, now)
        return params.to_dict()

    def lease(self, req_id: str, generation: int, now: float | None = None) -> None:
        """Start `req_id`'s lease under a `generation` its params already name.

        For a caller that made the params itself (vLLM's scheduler process
        hands them out before the worker has saved the last chunk): the
        generation must be fresh for this instance, else a late `done` for an
        earlier hold could free this one.
        """
        now = time.monotonic() if now is None else now
        if req_id in self._leases:
            raise InvalidInputError(f"request {req_id!r} is already held for D")
        if not _is_generation(generation) or generation < self._next_generation:
            raise InvalidInputError(f"request {req_id!r}: generation {generation!r} is not "
                                    f"fresh (next is {self._next_generation})")
        self._next_generation = generation + 1
        self._leases[req_id] = _Lease(generation, now + self.config.lease_s)
        logger.debug("P %s holds %s gen %s", self.config.name, req_id, generation)

    def held(self) -> list[str]:
        return list(self._leases)

    def poll(self, now: float | None = None) -> list[str]:
        """Handle D's notifications and reap expired leases.

        Returns the request ids freed since the last call (read by D, or expired).
        Never raises because of what a peer sent: a bad message is logged and dropped.
        """
        now = time.monotonic() if now is None else now
        for sender, messages in self.agent.get_new_notifs().items():
            for raw in messages:
                try:
                    self._handle(sender, decode_message(raw, sender), now)
                except TransferError as e:
                    logger.warning("P %s ignores a message: %s", self.config.name, e)
        self._answer_hellos(now)
        for req_id in [r for r, lease in self._leases.items() if lease.expires <= now]:
            logger.debug("P %s lease of %s expired", self.config.name, req_id)
            self._free(req_id)
        freed, self._freed = self._freed, []
        return freed

    def _handle(self, sender: str, msg: dict[str, Any], now: float) -> None:
        kind = msg["t"]
        if kind == "hello":
            self._hellos[sender] = now + self.config.handshake_timeout_s
            if self.config.uses_etcd:  # D published it there before saying hello
                try:
                    self.agent.fetch_remote_metadata(sender)
                except Exception as e:
                    logger.warning("P %s cannot fetch %s's metadata: %s", self.config.name,
                                   sender, e)
        elif kind == "done":
            req_id = _field(msg, "req_id", lambda v: isinstance(v, str), "a str", sender)
            generation = _field(msg, "generation", _is_generation, "a positive int", sender)
            instance = _field(msg, "instance", lambda v: isinstance(v, str), "a str", sender)
            readers = _field(msg, "readers", lambda v: v is None or (is_int(v) and v >= 1),
                             "a positive int", sender) or 1
            reader = _field(msg, "reader", lambda v: v is None or (is_int(v) and 0 <= v < readers),
                            f"an int in [0, {readers})", sender) or 0
            lease = self._leases.get(req_id)
            ok = (instance == self.instance and lease is not None
                  and lease.generation == generation)
            if ok:
                lease.done_by.add(reader)
                if len(lease.done_by) >= readers:  # every D process has read its units
                    self._free(req_id)
            logger.debug("P %s done %s gen %s from %s ok=%s", self.config.name, req_id,
                         generation, sender, ok)
            try:
                _send(self.agent, sender, "ack", req_id=req_id, generation=generation, ok=ok)
            except TransferError as e:
                logger.warning("P %s: %s", self.config.name, e)
        elif kind == "hb":
            instance = _field(msg, "instance", lambda v: isinstance(v, str), "a str", sender)
            reqs = _field(msg, "reqs", lambda v: isinstance(v, list) and all(
                isinstance(r, list) and len(r) == 2 and isinstance(r[0], str)
                and _is_generation(r[1]) for r in v), "a list of [req_id, generation]", sender)
            if instance != self.instance:
                return
            for req_id, generation in reqs:
                lease = self._leases.get(req_id)
                if lease is not None and lease.generation == generation:
                    lease.expires = max(lease.expires, now + self.config.lease_s)
        else:
            logger.warning("P %s ignores %r message from %s", self.config.name, kind, sender)

    def _answer_hellos(self, now: float) -> None:
        for peer, deadline in list(self._hellos.items()):
            if self.agent.check_remote_metadata(peer):
                del self._hellos[peer]
                try:
                    _send(self.agent, peer, "layout", **self.advertisement())
                except TransferError as e:
                    logger.warning("P %s: %s", self.config.name, e)
            elif now > deadline:
                del self._hellos[peer]
                logger.warning("P %s: no metadata from %s, hello dropped", self.config.name, peer)

    def _free(self, req_id: str) -> None:
        del self._leases[req_id]
        _free_everywhere(self.stagings, req_id)
        self._freed.append(req_id)

    def close(self) -> None:
        """Deregister staging and drop the agent (its listener stops with it)."""
        if self.agent is None:
            return
        _close_agent(self.agent, self._reg, f"P {self.config.name}", self.config.uses_etcd)
        self.agent = None
        _release_name(self.config.name)


# ---------------------------------------------------------------------- D side


@dataclass
class _PeerGroup:
    regions: list[tuple[int, int]]
    prints: tuple[int, int]
    block_bytes: int
    num_slots: int


@dataclass
class _Peer:
    name: str
    instance: str
    groups: list[_PeerGroup]
    layout: dict[str, Any]
    piece: tuple[int, int, int] | None = None  # (lo, hi, units) of a multi-host P process
    last_heartbeat: float = 0.0


@dataclass
class _Leg:
    """One P agent's part of a read: what D reads from it, and where its `done` stands."""

    peer: str
    handle: Any = None
    posting: Future | None = None  # the poster thread's `_post`, until `_advance` takes its handle
    # "xfer": READ posted (or being posted); "read": nothing (more) to read, done not
    # yet sent; "ack": done sent, waiting for P's ack; "ok": P acked.
    state: str = "xfer"


@dataclass
class _Read:
    req_id: str  # D's id (the caller's)
    p_req_id: str  # P's id, from the params: what every message to P names
    instance: str
    generation: int
    logical_ids: list[int]
    deadline: float
    legs: dict[str, _Leg] = field(default_factory=dict)  # every P agent holding a piece
    started: float = field(default_factory=time.monotonic)


class DecodeTransport:
    """D side: handshakes with P peers, reads requests into staging, reports outcomes.

    **Arguments:**

    - `config`: `TransportConfig`.
    - `staging`: where reads land, one per KV cache group (a single `Staging`
      is one group); each must match P's block bytes and layer count.
    - `layout`: this side's JSON-able cache layout, checked against each peer's.
    - `layout_check`: `(local, remote) -> None`, raising `LayoutMismatchError`;
      defaults to `check_layouts`.
    - `piece`: `(lo, hi, units)` for one process of a multi-host D, whose
      staging holds units `[lo, hi)` of each block (`kvxfer.pieces`); None
      for whole blocks.
    - `reader`: `(rank, count)`: this D process among its instance's. P frees a
      request once all `count` have said done.

    Multi-host reads. Params with `sources` name every P process and its
    units. This D process reads from each process holding units it needs
    exactly those units (one descriptor per block, or per run of slots where
    the ranges match whole; of replicas, the one `rank` picks), and sends
    `done` to every P process of the request, read from or not, so each frees
    its slots; the read finishes once all of them have acked. Whether every D
    process finished is the engine's to agree on (`kvxfer.connector`).
    """

    def __init__(
        self,
        config: TransportConfig,
        staging: Staging | Sequence[Staging],
        layout: Mapping[str, Any],
        layout_check: LayoutCheck = check_layouts,
        piece: tuple[int, int, int] | None = None,
        reader: tuple[int, int] = (0, 1),
    ):
        self.config, self.stagings, self.layout = config, _stagings(staging), dict(layout)
        self.layout_check = layout_check
        self.piece = _check_piece(piece)
        if not (isinstance(reader, (tuple, list)) and len(reader) == 2
                and all(is_int(v) for v in reader) and 0 <= reader[0] < reader[1]):
            raise InvalidInputError(f"reader must be (rank, count) with 0 <= rank < count, "
                                    f"got {reader!r:.80}")
        self.reader = (int(reader[0]), int(reader[1]))
        self.agent, self.port, self._reg = _start_agent(config, self.stagings)
        self._peers: dict[str, _Peer] = {}
        self._instances: dict[str, str] = {}  # peer -> the instance last connected to
        self._past: dict[str, set[str]] = {}  # peer -> instances known to be gone
        self._adverts: dict[str, dict[str, Any] | TransferError] = {}
        self._reads: dict[str, _Read] = {}
        self._expected: dict[str, tuple[list[str], str, int]] = {}  # req -> (peers, instance, gen)
        self._zombies: list[tuple[str, Any]] = []  # (req, handle) failed but still in flight
        # READs are posted on a thread of their own: over UCX `cma` the post itself
        # copies the bytes (NIXL releases the GIL meanwhile), which would hold the
        # engine's thread for the whole read.
        self._poster = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-post-{config.name}")
        self._done: list[str] = []
        self._failed: dict[str, list[int]] = {}

    @property
    def staging(self) -> Staging:
        """The first group's staging (the only one for a single-group model)."""
        return self.stagings[0]

    # -- handshake

    def connect(self, peer: str, host: str, port: int) -> dict[str, Any]:
        """Handshake with P agent `peer` at `host:port`; returns its layout.

        With `etcd_endpoints`, `peer`'s metadata is fetched by name from etcd
        (`host` and `port` are unused). Raises `TransferError` if the peer does
        not answer within
        `handshake_timeout_s` or sends a bad advertisement, and
        `LayoutMismatchError` if its layout is incompatible.
        """
        if peer in self._peers:
            return self._peers[peer].layout
        deadline = time.monotonic() + self.config.handshake_timeout_s
        self._adverts.pop(peer, None)
        etcd = self.config.uses_etcd
        where = f"in etcd at {self.config.etcd_endpoints}" if etcd else f"at {host}:{port}"
        if not etcd and port == 0:
            raise TransferError(f"peer {peer!r} has no listener (port 0: it publishes its "
                                f"metadata in etcd); give this D etcd_endpoints")
        # From P's listener, or by name from etcd (where D published its own at start).
        source = () if etcd else (host, port)
        try:
            self.agent.fetch_remote_metadata(peer, *source)
            refetch = time.monotonic() + _REFETCH_S
            while not self.agent.check_remote_metadata(peer):
                now = time.monotonic()
                if now > deadline:
                    raise TransferError(
                        f"peer {peer!r} {where} sent no NIXL metadata within "
                        f"{self.config.handshake_timeout_s}s (unknown peer or not "
                        f"{'published' if etcd else 'listening'})"
                    )
                if now > refetch:
                    # NIXL may first spend a fetch on a cached socket to a previous
                    # listener at that address (a restarted P), which it then closes;
                    # a P starting up may not have published yet.
                    self.agent.fetch_remote_metadata(peer, *source)
                    refetch = now + _REFETCH_S
                time.sleep(0.002)
            if not etcd:
                self.agent.send_local_metadata(host, port)
            _send(self.agent, peer, "hello", agent=self.config.name)
        except TransferError:
            self._forget(peer)
            raise
        except Exception as e:
            self._forget(peer)
            raise TransferError(f"handshake with peer {peer!r} at {host}:{port} failed: {e}") from e
        while peer not in self._adverts:
            if time.monotonic() > deadline:
                self._forget(peer)
                raise TransferError(
                    f"peer {peer!r} {where} sent no layout within "
                    f"{self.config.handshake_timeout_s}s"
                )
            self._drain_notifs()
            time.sleep(0.002)
        advert = self._adverts.pop(peer)
        try:
            if isinstance(advert, TransferError):
                raise advert
            self._peers[peer] = self._accept(peer, advert)
        except Exception:
            self._forget(peer)
            raise
        instance = self._peers[peer].instance
        if self._instances.get(peer, instance) != instance:  # a new start of that P
            self._past.setdefault(peer, set()).add(self._instances[peer])
        self._instances[peer] = instance
        logger.debug("D %s connected to %s (instance %s) at %s:%s", self.config.name, peer,
                     self._peers[peer].instance, host, port)
        return self._peers[peer].layout

    def _accept(self, peer: str, advert: dict[str, Any]) -> _Peer:
        try:
            layout = dict(advert["layout"])
            instance = advert["instance"]
            if not isinstance(instance, str) or not instance:
                raise ValueError(f"instance {instance!r}")
            groups = [_PeerGroup([(int(a), int(n)) for a, n in g["regions"]],
                                 (int(g["prints"][0]), int(g["prints"][1])),
                                 int(g["block_bytes"]), int(g["num_slots"]))
                      for g in advert["groups"]]
            piece = _check_piece(advert.get("piece"))
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"layout message from {peer!r} is malformed: {e!r}") from None
        if (piece is None) != (self.piece is None) or (piece and piece[2] != self.piece[2]):
            raise LayoutMismatchError(
                f"peer {peer!r} stages {'units ' + str(piece) if piece else 'whole blocks'}, "
                f"local staging {'units ' + str(self.piece) if self.piece else 'whole blocks'}")
        theirs_n = piece[1] - piece[0] if piece else 1
        ours_n = self.piece[1] - self.piece[0] if self.piece else 1
        self.layout_check(self.layout, layout)
        if len(groups) != len(self.stagings):
            raise LayoutMismatchError(
                f"peer {peer!r} stages {len(groups)} KV cache groups, local staging has "
                f"{len(self.stagings)}")
        for g, (theirs, ours) in enumerate(zip(groups, self.stagings)):
            # Per unit of a piece (the whole block when not in pieces).
            if (theirs.block_bytes * ours_n != ours.block_bytes * theirs_n
                    or len(theirs.regions) != ours.num_layers):
                raise LayoutMismatchError(
                    f"peer {peer!r} group {g} stages {len(theirs.regions)} layers of "
                    f"{theirs.block_bytes}-byte blocks, local staging has {ours.num_layers} of "
                    f"{ours.block_bytes}"
                )
            if theirs.prints[1] * ours_n != theirs.num_slots * ours.prints.strides[0] * theirs_n:
                raise LayoutMismatchError(
                    f"peer {peer!r} group {g} advertises a {theirs.prints[1]}-byte fingerprint "
                    f"region for {theirs.num_slots} slots of {ours.num_layers} layers")
        return _Peer(peer, instance, groups, layout, piece)

    def _forget(self, peer: str) -> None:
        """Drop NIXL's metadata of `peer`, so the next connect fetches it afresh."""
        try:
            self.agent.remove_remote_agent(peer)
        except Exception as e:
            logger.debug("D %s remove %s: %s", self.config.name, peer, e)

    def _drop_peer(self, peer: str, why: str) -> None:
        """Disconnect `peer` (gone, restarted or failing); its reads fail with it."""
        state = self._peers.pop(peer, None)
        if state is None:
            return
        logger.warning("D %s drops peer %s: %s", self.config.name, peer, why)
        for read in [r for r in self._reads.values() if peer in r.legs]:
            self._fail(read)
        self._forget(peer)

    def _probe(self, peer: _Peer) -> str | None:
        """The instance answering a fresh `hello` over the current connection, or None.

        Waits up to `handshake_timeout_s`; a dead or replaced peer does not answer.
        """
        self._adverts.pop(peer.name, None)
        deadline = time.monotonic() + self.config.handshake_timeout_s
        try:
            _send(self.agent, peer.name, "hello", agent=self.config.name)
        except TransferError:
            return None
        while time.monotonic() < deadline:
            self._drain_notifs()
            advert = self._adverts.pop(peer.name, None)
            if isinstance(advert, dict):
                instance = advert.get("instance")
                return instance if isinstance(instance, str) else None
            if advert is not None:
                return None
            time.sleep(0.002)
        return None

    # -- reads

    def expect(self, params: Mapping[str, Any]) -> None:
        """Keep P's lease on a request alive (heartbeats) until `start_read` takes it."""
        p = ReadParams.parse(params, len(self.stagings))
        self._expected[p.req_id] = (p.peers, p.instance, p.generation)

    def start_read(self, req_id: str, params: Mapping[str, Any],
                   logical_ids: Sequence[int]) -> None:
        """Post the READ of `req_id`'s blocks from P into D's staging, under P's keys.

        `logical_ids` are the engine's (D's) block ids the request's blocks
        land in: what is reported if the read fails. Raises
        `InvalidInputError` for malformed params or a request already being
        read, before any state changes; never raises for a peer problem: the
        request is then reported failed by `poll`.
        """
        if req_id in self._reads or any(z == req_id for z, _ in self._zombies):
            raise InvalidInputError(f"request {req_id!r} is already being read")
        if any(req_id in s for s in self.stagings):
            raise InvalidInputError(
                f"request {req_id!r} still holds D staging from an earlier read; free it first")
        p = ReadParams.parse(params, len(self.stagings))
        if not isinstance(logical_ids, Sequence) or not all(
                is_int(b) and b >= 0 for b in logical_ids):
            raise InvalidInputError(f"logical_ids of {req_id!r} must be a list of non-negative "
                                    f"int block ids, got {logical_ids!r:.80}")
        self._expected.pop(p.req_id, None)
        stale = [peer for peer in p.peers if self._is_stale(peer, p.instance)]
        read = _Read(req_id, p.req_id, p.instance, p.generation, list(logical_ids),
                     time.monotonic() + self.config.transfer_timeout_s)
        self._reads[req_id] = read
        try:
            if stale:
                raise TransferError(f"params of {req_id!r} are from P instance {p.instance} of "
                                    f"{stale}, which is not the live one (P restarted)")
            plan = self._plan(p)
            read.legs = {peer: _Leg(peer, state="xfer" if plan[peer] else "read")
                         for peer in p.peers}
            for source in p.sources or [Source(p.peer, 0, 1)]:
                self._check_source(p, source)
            d_slots = [s.assign(req_id, keys) for s, keys in zip(self.stagings, p.keys)]
        except Exception as e:  # any failure here is this request's, not the engine's
            logger.warning("D %s cannot read %s from %s: %s", self.config.name, req_id, p.peers, e)
            self._fail(read)
            return
        for peer, span in plan.items():
            if span is not None:
                read.legs[peer].posting = self._poster.submit(
                    self._post, self._peers[peer], p.slots, d_slots, span, req_id)

    def _is_stale(self, peer: str, instance: str) -> bool:
        """Whether params naming `instance` of `peer` are from a P that is gone."""
        if instance in self._past.get(peer, ()):
            return True
        connected = self._peers.get(peer)
        if connected is not None and connected.instance != instance:
            # Params from a restarted P, or stale ones: ask the connected P who it is.
            if self._probe(connected) == connected.instance:
                return True  # the connected P is alive: these params are not its own
            self._drop_peer(peer, f"params name instance {instance}, the connected "
                                  f"instance {connected.instance} does not answer")
        return False

    def _plan(self, p: ReadParams) -> dict[str, tuple[int, int] | None]:
        """Per P agent of the request, the units this D process reads from it (None: none).

        One P process: the whole block, `(0, 1)`. Several: from each distinct unit
        range that overlaps this process's piece, the overlap, read from one of the
        sources holding that range (replicas: the one this reader's rank picks).
        """
        if not p.sources:
            if self.piece is not None:
                raise TransferError(f"params of {p.req_id!r} are from a P of whole blocks, "
                                    f"this D process holds units {self.piece}")
            return {p.peer: (0, 1)}
        if self.piece is None or p.units != self.piece[2]:
            raise TransferError(f"params of {p.req_id!r} name {p.units} units per block, this D "
                                f"process holds {self.piece or 'whole blocks'}")
        plan: dict[str, tuple[int, int] | None] = {s.peer: None for s in p.sources}
        lo, hi = self.piece[:2]
        for span in sorted({(s.lo, s.hi) for s in p.sources}):
            a, b = max(span[0], lo), min(span[1], hi)
            if a < b:
                holders = [s.peer for s in p.sources if (s.lo, s.hi) == span]
                plan[holders[self.reader[0] % len(holders)]] = (a, b)
        return plan

    def _check_source(self, p: ReadParams, source: Source) -> None:
        """Connect to `source`'s P agent and check it is the instance and piece the params name."""
        if source.peer not in self._peers:
            self.connect(source.peer, p.host, p.port)
        peer = self._peers[source.peer]
        if peer.instance != p.instance:
            self._past.setdefault(source.peer, set()).add(p.instance)
            raise TransferError(
                f"params of {p.req_id!r} are from P instance {p.instance}, but {source.peer!r} "
                f"is now instance {peer.instance} (P restarted)")
        if p.sources and peer.piece != (source.lo, source.hi, p.units):
            raise TransferError(f"params of {p.req_id!r} say {source.peer!r} stages units "
                                f"[{source.lo}, {source.hi}) of {p.units}, it advertised "
                                f"{peer.piece}")
        for g, (slots, group) in enumerate(zip(p.slots, peer.groups)):
            bad = [s for s in slots if s >= group.num_slots]
            if bad:
                raise TransferError(f"params of {p.req_id!r} name P slots {bad[:4]} of group "
                                    f"{g}, past {source.peer!r}'s {group.num_slots}")

    def _post(self, peer: _Peer, p_slots: Sequence[Sequence[int]],
              d_slots: Sequence[Sequence[int]], span: tuple[int, int], req_id: str) -> Any:
        """Post one READ of units `span` of every slot from `peer` (whole blocks: `(0, 1)`)."""
        theirs_piece, ours_piece = peer.piece or (0, 1, 1), self.piece or (0, 1, 1)
        local, remote = [], []
        for theirs, ours, ps, ds in zip(peer.groups, self.stagings, p_slots, d_slots, strict=True):
            if not ps:
                continue
            # Blocks, then the fingerprint rows of the same slots; per unit, `size` bytes.
            p_row = theirs.prints[1] // theirs.num_slots
            for p_bases, d_bases, p_stride, d_stride in (
                    ([a for a, _ in theirs.regions], [a for a, _ in ours.region_addresses()],
                     theirs.block_bytes, ours.block_bytes),
                    ([theirs.prints[0]], [ours.prints_address()[0]], p_row,
                     ours.prints.strides[0])):
                size = d_stride // (ours_piece[1] - ours_piece[0])
                length = (span[1] - span[0]) * size
                whole = length == p_stride == d_stride  # slot runs coalesce
                runs = np.asarray(coalesce_pairs(ps, ds) if whole
                                  else [(a, b, 1) for a, b in zip(ps, ds)],
                                  dtype=np.uint64).reshape(-1, 3)
                lengths = runs[:, 2] * length
                p_off = (span[0] - theirs_piece[0]) * size
                d_off = (span[0] - ours_piece[0]) * size
                for p_base, d_base in zip(p_bases, d_bases, strict=True):
                    remote.append(np.stack([p_base + p_off + runs[:, 0] * p_stride, lengths,
                                            0 * lengths], 1))
                    local.append(np.stack([d_base + d_off + runs[:, 1] * d_stride, lengths,
                                           0 * lengths], 1))
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(np.concatenate(local), "DRAM"),
            self.agent.get_xfer_descs(np.concatenate(remote), "DRAM"),
            peer.name,
        )
        try:
            state = self.agent.transfer(handle)
        except Exception as e:  # part of it may be posted: `_advance` finds it in error
            logger.warning("D %s: NIXL raised posting the READ of %s from %s: %s",
                           self.config.name, req_id, peer.name, e)
            return handle
        if state == "ERR":
            self._release(handle)
            raise TransferError(f"NIXL refused the READ of {req_id!r} from {peer.name!r}")
        logger.debug("D %s posted READ of %s from %s (%s descriptors)", self.config.name, req_id,
                     peer.name, sum(len(x) for x in local))
        return handle

    def poll(self, now: float | None = None) -> tuple[list[str], dict[str, list[int]]]:
        """Advance reads; returns `(finished, failed)` since the last call.

        `finished`: request ids whose blocks are in staging and confirmed by P
        (the caller copies them out, then frees them in every staging).
        `failed`: request id -> the logical ids given to `start_read`; their
        slots are freed here.
        """
        now = time.monotonic() if now is None else now
        if not self._posting():
            self._drain_notifs()
            for read in list(self._reads.values()):
                if read.req_id in self._reads:  # else failed with a peer meanwhile
                    self._advance(read)
                if now > read.deadline and read.req_id in self._reads:
                    logger.warning("D %s read of %s timed out in states %s", self.config.name,
                                   read.req_id, {p: leg.state for p, leg in read.legs.items()})
                    self._fail(read)
            self._heartbeat(now)
            self._reap_zombies()
        done, self._done = self._done, []
        failed, self._failed = self._failed, {}
        return done, failed

    def _posting(self) -> bool:
        """Whether the poster thread is inside NIXL. Over UCX `cma` a post copies the
        bytes while holding the agent, so any NIXL call from this thread would wait for
        the whole copy: `poll` leaves the agent alone until it is done (notifications
        wait in UCX; deadlines are checked at the next poll)."""
        return any(leg.posting is not None and not leg.posting.done()
                   for read in self._reads.values() for leg in read.legs.values())

    def _advance(self, read: _Read) -> None:
        """Check `read`'s posted READs; once all are done, say done to every P agent."""
        for leg in read.legs.values():
            if leg.state != "xfer":
                continue
            if leg.posting is not None:
                if not leg.posting.done():
                    continue
                posting, leg.posting = leg.posting, None
                try:
                    leg.handle = posting.result()
                except Exception as e:
                    self._fail(read)
                    self._drop_peer(leg.peer, f"posting the READ of {read.req_id} failed: {e}")
                    return
            try:
                state = self.agent.check_xfer_state(leg.handle)
            except Exception as e:
                logger.warning("D %s xfer state of %s: %s", self.config.name, read.req_id, e)
                state = "ERR"
            if state == "DONE":
                self._release(leg.handle)
                leg.handle, leg.state = None, "read"
            elif state == "ERR":
                self._fail(read)
                self._drop_peer(leg.peer, f"READ of {read.req_id} failed")
                return
        if any(leg.state == "xfer" for leg in read.legs.values()):
            return
        for leg in read.legs.values():
            if leg.state == "read":
                try:
                    _send(self.agent, leg.peer, "done", req_id=read.p_req_id,
                          instance=read.instance, generation=read.generation,
                          readers=self.reader[1], reader=self.reader[0])
                    leg.state = "ack"
                except TransferError as e:
                    self._fail(read)
                    self._drop_peer(leg.peer, str(e))
                    return

    def _drain_notifs(self) -> None:
        for sender, messages in self.agent.get_new_notifs().items():
            for raw in messages:
                try:
                    msg = decode_message(raw, sender)
                    if msg["t"] == "layout":
                        self._adverts[sender] = msg
                    elif msg["t"] == "ack":
                        self._on_ack(sender, msg)
                    else:
                        logger.warning("D %s ignores %r message from %s", self.config.name,
                                       msg["t"], sender)
                except TransferError as e:
                    if sender not in self._peers and not isinstance(self._adverts.get(sender),
                                                                    dict):
                        self._adverts[sender] = e  # a handshake in progress fails loudly
                    logger.warning("D %s ignores a message: %s", self.config.name, e)

    def _on_ack(self, sender: str, msg: dict[str, Any]) -> None:
        req_id = _field(msg, "req_id", lambda v: isinstance(v, str), "a str", sender)
        generation = _field(msg, "generation", _is_generation, "a positive int", sender)
        ok = _field(msg, "ok", lambda v: isinstance(v, bool), "a bool", sender)
        read = next((r for r in self._reads.values() if r.p_req_id == req_id
                     and sender in r.legs and r.generation == generation), None)
        if read is None or read.legs[sender].state != "ack":
            return
        if not ok:
            logger.warning("D %s: P %s no longer held %s (lease expired or P restarted)",
                           self.config.name, sender, read.req_id)
            self._fail(read)
            return
        read.legs[sender].state = "ok"
        if all(leg.state == "ok" for leg in read.legs.values()):
            del self._reads[read.req_id]
            self._done.append(read.req_id)
            logger.debug("D %s read %s in %.4fs", self.config.name, read.req_id,
                         time.monotonic() - read.started)

    def _heartbeat(self, now: float) -> None:
        wanted: dict[str, list[list[Any]]] = {}
        for read in self._reads.values():
            for peer in read.legs:
                wanted.setdefault(peer, []).append([read.p_req_id, read.generation])
        for req_id, (peers, _, generation) in self._expected.items():
            for peer in peers:
                wanted.setdefault(peer, []).append([req_id, generation])
        for peer, reqs in wanted.items():
            state = self._peers.get(peer)
            if state is None or now - state.last_heartbeat < self.config.heartbeat_interval_s:
                continue
            state.last_heartbeat = now
            try:
                _send(self.agent, peer, "hb", instance=state.instance, reqs=reqs)
            except TransferError as e:
                self._drop_peer(peer, str(e))

    def _fail(self, read: _Read) -> None:
        if self._reads.pop(read.req_id, None) is None:
            return
        self._failed[read.req_id] = list(read.logical_ids)
        # A post not started is cancelled; one under way is waited for (before posts
        # ran on their own thread, it was waited for inside `start_read`). Then D's
        # slots wait for every READ NIXL has not released (it could still land).
        pending = [leg.posting for leg in read.legs.values()
                   if leg.posting is not None and not leg.posting.cancel()]
        futures.wait(pending)
        for leg in read.legs.values():
            posting, leg.posting = leg.posting, None
            if posting is None or posting.cancelled():
                continue
            if posting.exception() is not None:
                logger.warning("D %s: posting the READ of %s from %s failed: %s",
                               self.config.name, read.req_id, leg.peer, posting.exception())
            else:
                leg.handle = posting.result()
        held = [leg.handle for leg in read.legs.values()
                if leg.handle is not None and not self._release(leg.handle)]
        if held:
            self._zombies += [(read.req_id, h) for h in held]
        else:
            _free_everywhere(self.stagings, read.req_id)

    def _release(self, handle: Any) -> bool:
        try:
            handle.release()
            return True
        except Exception:
            return False

    def _reap_zombies(self) -> None:
        still = [(req_id, h) for req_id, h in self._zombies if not self._release(h)]
        for req_id in {r for r, _ in self._zombies} - {r for r, _ in still}:
            _free_everywhere(self.stagings, req_id)
        self._zombies = still

    def free(self, req_id: str) -> None:
        """Release the staging of a finished request, once its blocks are copied out."""
        _free_everywhere(self.stagings, req_id)

    def pending(self) -> list[str]:
        """Request ids with a read in progress."""
        return list(self._reads)

    def close(self) -> None:
        """Deregister staging and drop the agent (its listener stops with it)."""
        if self.agent is None:
            return
        self._poster.shutdown(wait=True, cancel_futures=True)  # none may start on a closed agent
        _close_agent(self.agent, self._reg, f"D {self.config.name}", self.config.uses_etcd)
        self.agent = None
        _release_name(self.config.name)
