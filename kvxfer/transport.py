"""NIXL transport: agents, handshake, descriptors, reads, notifications, leases.

The only kvxfer module that imports NIXL (`_nixl()`). One agent per process,
UCX backend, registering the `kvxfer.staging.Staging` regions once.

Handshake, all NIXL-native. Both agents run NIXL's metadata listener. D
fetches P's agent metadata from P's listener (`fetch_remote_metadata`, polled
with a deadline), pushes its own to P (`send_local_metadata`) so P can answer,
then sends a `hello` notification. P answers with a `layout` notification:
versioned JSON carrying P's cache layout (the caller's dict: shapes, dtype,
block size, kernel ratio, TP size/rank, sharding) and its staging regions
(base addresses, lengths, block bytes). D checks it against its own before
any read and raises `LayoutMismatchError` naming the differing fields. Bytes
that are not a kvxfer message, truncated JSON, or another version raise
`TransferError` naming the peer.

Reads. P's `hold(req_id)` starts a lease and returns the transfer params
(JSON-able; the engine forwards them to D as vLLM forwards
`kv_transfer_params`): P's agent name, address, a generation, the request's
kernel block ids and their P slots. D's `start_read` assigns its own slots and
posts one NIXL READ with one descriptor per (layer, run of slots contiguous on
both sides), so a request staged in one slot run costs one descriptor per
layer.

Completion and leases. When the READ is done D sends `done(req, generation)`;
P frees the request's slots and answers `ack` with `ok` true only if the
request was still held under that generation. P frees a held request when D
says done or when its lease expires (`lease_s`, extended by D's `hb`
heartbeats); every lease is scanned on each `poll`. Soundness of a late read:
P frees only inside `poll`, and a lease once expired is never revived, so "held
when the `done` arrived" implies "held during the whole read" (the READ
completed before `done` was sent). D reports a request finished only after an
`ok` ack; a read of freed (possibly reused) slots gets `ok: false` and is
reported failed, never delivered as data.

Failures never hang D. Every read has a deadline (`transfer_timeout_s`) from
`start_read` to the ack; a transfer error, a disconnected peer, a refused
ack, or the deadline yields the request id and its logical block ids (in D's
ids) as failed, for the engine to recompute. D's slots of a failed read are
released only once NIXL has released the transfer (an in-flight READ could
otherwise land in slots reused by another request).

Heterogeneous TP. The transport moves staged blocks as bytes; whether two
layouts may exchange them is the `layout_check`'s call. The default
(`check_layouts`) rejects a peer whose `tp_size` differs, for staging that
holds one rank's shard of each block: with `[blocks, tokens, heads, p, dim]`
a head slice is not contiguous inside a block, so per-rank staging would need
a heads-outer layout or per-token descriptors. `kvxfer.connector` instead
stages whole blocks gathered from all of a process's shards and checks only
the block bytes (`check_block_compatible`), so P and D may shard differently
and D re-shards on scatter.

Single-threaded: call each transport from one thread (the engine's).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.blocks import coalesce_pairs, to_logical_ids
from kvxfer.errors import InvalidInputError, LayoutMismatchError, TransferError
from kvxfer.staging import Staging

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
_MAGIC = b"kvxfer:"
_MAX_BIND_TRIES = 8


@dataclass(frozen=True)
class TransportConfig:
    """Everything the transport reads, in one place.

    - `name`: this agent's name; P's name is what D connects to.
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
    - `prepped`: read through `prep_xfer_dlist`/`make_prepped_xfer` (per-slot
      descriptor lists prepared once) instead of per-request coalesced lists.
      Off by default: measured with `kvxfer.bench.nixl` (runs placement) it
      was no faster (0.79-0.89x memcpy vs 0.87-0.92x), NIXL merging the
      adjacent per-slot descriptors itself.
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
    prepped: bool = False


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


def _create_agent(config: TransportConfig) -> tuple[Any, int]:
    nixl_agent, nixl_agent_config = _nixl()
    tries = _MAX_BIND_TRIES if config.listen_port == 0 else 1
    old_tls = os.environ.get("UCX_TLS")
    try:
        if config.ucx_tls is not None:
            os.environ["UCX_TLS"] = config.ucx_tls
        for attempt in range(tries):
            port = config.listen_port or free_port()
            nixl_config = nixl_agent_config(
                enable_listen_thread=True, listen_port=port, num_threads=config.num_threads
            )
            try:
                return nixl_agent(config.name, nixl_config), port
            except RuntimeError as e:
                if "bind" not in str(e).lower() or attempt == tries - 1:
                    raise TransferError(
                        f"cannot create NIXL agent {config.name!r} on port {port}: {e}"
                    ) from e
        raise AssertionError("unreachable")
    finally:
        if config.ucx_tls is not None:
            if old_tls is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = old_tls


def encode_message(kind: str, /, **fields: Any) -> bytes:
    """A kvxfer notification: magic prefix, then versioned JSON."""
    return _MAGIC + json.dumps({"v": PROTOCOL_VERSION, "t": kind, **fields}).encode()


def decode_message(raw: bytes, sender: str) -> dict[str, Any]:
    """Parse a kvxfer notification from `sender`; `TransferError` if it is not one."""
    if not raw.startswith(_MAGIC):
        raise TransferError(f"message from {sender!r} is not a kvxfer message: {raw[:32]!r}")
    try:
        msg = json.loads(raw[len(_MAGIC) :])
    except (ValueError, UnicodeDecodeError) as e:
        raise TransferError(
            f"message from {sender!r} is corrupt or truncated ({len(raw)} bytes): {e}"
        ) from None
    if not isinstance(msg, dict) or "t" not in msg:
        raise TransferError(f"message from {sender!r} has no type: {str(msg)[:80]}")
    if msg.get("v") != PROTOCOL_VERSION:
        raise TransferError(
            f"peer {sender!r} speaks kvxfer protocol {msg.get('v')!r}, "
            f"this side speaks {PROTOCOL_VERSION}"
        )
    return msg


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


def _register(agent: Any, staging: Staging) -> Any:
    regs = [(addr, n, 0, "") for addr, n in staging.region_addresses()]
    return agent.register_memory(regs, "DRAM")


def _close_agent(agent: Any, reg: Any, who: str) -> None:
    try:
        agent.deregister_memory(reg)
    except Exception as e:  # closing must not raise: the process may be going down
        logger.warning("%s deregister failed: %s", who, e)


def _slot_descs(staging_regions: Sequence[tuple[int, int]], block_bytes: int) -> np.ndarray:
    """Per-slot descriptors `(addr, len, 0)` of every layer, indexed `layer * slots + slot`."""
    rows = []
    for base, nbytes in staging_regions:
        starts = base + np.arange(nbytes // block_bytes, dtype=np.uint64) * block_bytes
        rows.append(np.stack([starts, np.full_like(starts, block_bytes), 0 * starts], axis=1))
    return np.concatenate(rows).astype(np.uint64)


def _send(nixl: Any, peer: str, kind: str, /, **fields: Any) -> None:
    try:
        nixl.send_notif(peer, encode_message(kind, **fields))
    except Exception as e:  # NIXL raises its own exception types for a gone peer
        raise TransferError(f"cannot send {kind!r} to peer {peer!r}: {e}") from e


# ---------------------------------------------------------------------- P side


@dataclass
class _Lease:
    generation: int
    expires: float


class PrefillTransport:
    """P side: serves staged blocks to D and frees them on `done` or lease expiry.

    **Arguments:**

    - `config`: `TransportConfig`; `config.name` is the name D connects to.
    - `staging`: the staging P saves blocks into; its regions are registered here.
    - `layout`: JSON-able cache layout advertised to D at handshake.
    """

    def __init__(self, config: TransportConfig, staging: Staging, layout: Mapping[str, Any]):
        self.config = config
        self.staging = staging
        self.layout = dict(layout)
        self.agent, self.port = _create_agent(config)
        self._reg = _register(self.agent, staging)
        self._leases: dict[str, _Lease] = {}
        self._next_generation = 1
        self._hellos: dict[str, float] = {}  # D agent -> deadline to answer by
        self._freed: list[str] = []

    def advertisement(self) -> dict[str, Any]:
        """What D receives at handshake (the `layout` message's fields)."""
        return {
            "agent": self.config.name,
            "layout": self.layout,
            "regions": [list(r) for r in self.staging.region_addresses()],
            "block_bytes": self.staging.block_bytes,
            "num_slots": self.staging.num_slots,
        }

    def hold(self, req_id: str, now: float | None = None) -> dict[str, Any]:
        """Start `req_id`'s lease; returns the params D needs to read it.

        Call once the request's last chunk is staged.
        """
        now = time.monotonic() if now is None else now
        kernel_ids = self.staging.blocks(req_id)
        generation = self._next_generation
        self._next_generation += 1
        self._leases[req_id] = _Lease(generation, now + self.config.lease_s)
        logger.debug("P %s holds %s gen %s (%s blocks)", self.config.name, req_id,
                     generation, len(kernel_ids))
        return {
            "peer": self.config.name,
            "host": self.config.host,
            "port": self.port,
            "req_id": req_id,
            "generation": generation,
            "kernel_ids": kernel_ids,
            "slots": self.staging.slots(req_id, kernel_ids),
        }

    def held(self) -> list[str]:
        return list(self._leases)

    def poll(self, now: float | None = None) -> list[str]:
        """Handle D's notifications and reap expired leases.

        Returns the request ids freed since the last call (read by D, or expired).
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
        elif kind == "done":
            req_id, generation = msg.get("req_id"), msg.get("generation")
            lease = self._leases.get(req_id)
            ok = lease is not None and lease.generation == generation
            if ok:
                self._free(req_id)
            logger.debug("P %s done %s gen %s from %s ok=%s", self.config.name, req_id,
                         generation, sender, ok)
            try:
                _send(self.agent, sender, "ack", req_id=req_id, generation=generation, ok=ok)
            except TransferError as e:
                logger.warning("P %s: %s", self.config.name, e)
        elif kind == "hb":
            for req_id, generation in msg.get("reqs", []):
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
        if req_id in self.staging:
            self.staging.free(req_id)
        self._freed.append(req_id)

    def close(self) -> None:
        """Deregister staging and drop the agent (its listener stops with it)."""
        _close_agent(self.agent, self._reg, f"P {self.config.name}")
        self.agent = None


# ---------------------------------------------------------------------- D side


@dataclass
class _Peer:
    name: str
    regions: list[tuple[int, int]]
    block_bytes: int
    num_slots: int
    layout: dict[str, Any]
    prepped: Any = None  # remote per-slot dlist handle
    last_heartbeat: float = 0.0


@dataclass
class _Read:
    req_id: str
    peer: str
    generation: int
    local_ids: list[int]
    deadline: float
    handle: Any = None
    state: str = "xfer"  # "xfer": READ posted; "ack": waiting for P's ack
    started: float = field(default_factory=time.monotonic)


class DecodeTransport:
    """D side: handshakes with P peers, reads requests into staging, reports outcomes.

    **Arguments:**

    - `config`: `TransportConfig`.
    - `staging`: where reads land; must match P's block bytes and layer count.
    - `layout`: this side's JSON-able cache layout, checked against each peer's.
    - `kernel_ratio`: kernel blocks per logical block (failures are reported in logical ids).
    - `layout_check`: `(local, remote) -> None`, raising `LayoutMismatchError`;
      defaults to `check_layouts`.
    """

    def __init__(
        self,
        config: TransportConfig,
        staging: Staging,
        layout: Mapping[str, Any],
        kernel_ratio: int = 1,
        layout_check: LayoutCheck = check_layouts,
    ):
        self.config = config
        self.staging = staging
        self.layout = dict(layout)
        self.kernel_ratio = kernel_ratio
        self.layout_check = layout_check
        self.agent, self.port = _create_agent(config)
        self._reg = _register(self.agent, staging)
        self._local_prepped: Any = None
        self._peers: dict[str, _Peer] = {}
        self._adverts: dict[str, dict[str, Any] | TransferError] = {}
        self._reads: dict[str, _Read] = {}
        self._expected: dict[str, tuple[str, int]] = {}  # req -> (peer, generation)
        self._zombies: list[tuple[str, Any]] = []  # (req, handle) failed but still in flight
        self._done: list[str] = []
        self._failed: dict[str, list[int]] = {}

    # -- handshake

    def connect(self, peer: str, host: str, port: int) -> dict[str, Any]:
        """Handshake with P agent `peer` at `host:port`; returns its layout.

        Raises `TransferError` if the peer does not answer within
        `handshake_timeout_s` or sends a bad advertisement, and
        `LayoutMismatchError` if its layout is incompatible.
        """
        if peer in self._peers:
            return self._peers[peer].layout
        deadline = time.monotonic() + self.config.handshake_timeout_s
        self._adverts.pop(peer, None)
        try:
            self.agent.fetch_remote_metadata(peer, host, port)
            while not self.agent.check_remote_metadata(peer):
                if time.monotonic() > deadline:
                    raise TransferError(
                        f"peer {peer!r} at {host}:{port} sent no NIXL metadata within "
                        f"{self.config.handshake_timeout_s}s (unknown peer or not listening)"
                    )
                time.sleep(0.002)
            self.agent.send_local_metadata(host, port)
            _send(self.agent, peer, "hello", agent=self.config.name)
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"handshake with peer {peer!r} at {host}:{port} failed: {e}") from e
        while peer not in self._adverts:
            if time.monotonic() > deadline:
                raise TransferError(
                    f"peer {peer!r} at {host}:{port} sent no layout within "
                    f"{self.config.handshake_timeout_s}s"
                )
            self._drain_notifs()
            time.sleep(0.002)
        advert = self._adverts.pop(peer)
        if isinstance(advert, TransferError):
            raise advert
        self._peers[peer] = self._accept(peer, advert)
        logger.debug("D %s connected to %s at %s:%s", self.config.name, peer, host, port)
        return self._peers[peer].layout

    def _accept(self, peer: str, advert: dict[str, Any]) -> _Peer:
        try:
            layout = dict(advert["layout"])
            regions = [(int(a), int(n)) for a, n in advert["regions"]]
            block_bytes, num_slots = int(advert["block_bytes"]), int(advert["num_slots"])
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"layout message from {peer!r} is malformed: {e!r}") from None
        self.layout_check(self.layout, layout)
        if block_bytes != self.staging.block_bytes or len(regions) != self.staging.num_layers:
            raise LayoutMismatchError(
                f"peer {peer!r} stages {len(regions)} layers of {block_bytes}-byte blocks, "
                f"local staging has {self.staging.num_layers} of {self.staging.block_bytes}"
            )
        state = _Peer(peer, regions, block_bytes, num_slots, layout)
        if self.config.prepped:
            if self._local_prepped is None:
                self._local_prepped = self.agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT",
                    _slot_descs(self.staging.region_addresses(), self.staging.block_bytes),
                    "DRAM",
                )
            state.prepped = self.agent.prep_xfer_dlist(
                peer, _slot_descs(regions, block_bytes), "DRAM"
            )
        return state

    def _drop_peer(self, peer: str) -> None:
        if self._peers.pop(peer, None) is not None:
            try:
                self.agent.remove_remote_agent(peer)
            except Exception as e:
                logger.debug("D %s remove %s: %s", self.config.name, peer, e)

    # -- reads

    def expect(self, params: Mapping[str, Any]) -> None:
        """Keep P's lease on a request alive (heartbeats) until `start_read` takes it."""
        self._expected[params["req_id"]] = (params["peer"], int(params["generation"]))

    def start_read(
        self, req_id: str, params: Mapping[str, Any], local_kernel_ids: Sequence[int]
    ) -> None:
        """Post the READ of `req_id`'s blocks from P into D's slots for `local_kernel_ids`.

        `local_kernel_ids[i]` receives P's `params["kernel_ids"][i]`. Never
        raises for a peer problem: the request is then reported failed by `poll`.
        """
        p_ids = list(params["kernel_ids"])
        if len(p_ids) != len(local_kernel_ids) or len(params["slots"]) != len(p_ids):
            raise InvalidInputError(
                f"request {req_id!r}: P has {len(p_ids)} kernel blocks, "
                f"{len(params['slots'])} slots; D asked for {len(local_kernel_ids)}"
            )
        if req_id in self._reads:
            raise InvalidInputError(f"request {req_id!r} is already being read")
        self._expected.pop(req_id, None)
        peer = str(params["peer"])
        read = _Read(req_id, peer, int(params["generation"]), list(local_kernel_ids),
                     time.monotonic() + self.config.transfer_timeout_s)
        self._reads[req_id] = read
        try:
            if peer not in self._peers:
                self.connect(peer, str(params["host"]), int(params["port"]))
            d_slots = self.staging.assign(req_id, read.local_ids)
            read.handle = self._post(self._peers[peer], list(params["slots"]), d_slots, req_id)
        except Exception as e:  # any failure here is this request's, not the engine's
            logger.warning("D %s cannot read %s from %s: %s", self.config.name, req_id, peer, e)
            self._fail(read)

    def _post(self, peer: _Peer, p_slots: list[int], d_slots: list[int], req_id: str) -> Any:
        bb = self.staging.block_bytes
        if self.config.prepped:
            n = self.staging.num_slots
            local_idx = [layer * n + s for layer in range(self.staging.num_layers) for s in d_slots]
            remote_idx = [layer * peer.num_slots + s for layer in range(len(peer.regions))
                          for s in p_slots]
            handle = self.agent.make_prepped_xfer(
                "READ", self._local_prepped, local_idx, peer.prepped, remote_idx
            )
        else:
            runs = np.asarray(coalesce_pairs(p_slots, d_slots), dtype=np.uint64).reshape(-1, 3)
            local, remote = [], []
            for (p_base, _), (d_base, _) in zip(
                peer.regions, self.staging.region_addresses(), strict=True
            ):
                lengths = runs[:, 2] * bb
                remote.append(np.stack([p_base + runs[:, 0] * bb, lengths, 0 * lengths], 1))
                local.append(np.stack([d_base + runs[:, 1] * bb, lengths, 0 * lengths], 1))
            handle = self.agent.initialize_xfer(
                "READ",
                self.agent.get_xfer_descs(np.concatenate(local), "DRAM"),
                self.agent.get_xfer_descs(np.concatenate(remote), "DRAM"),
                peer.name,
            )
        state = self.agent.transfer(handle)
        if state == "ERR":
            raise TransferError(f"NIXL refused the READ of {req_id!r} from {peer.name!r}")
        logger.debug("D %s posted READ of %s (%s blocks)", self.config.name, req_id, len(d_slots))
        return handle

    def poll(self, now: float | None = None) -> tuple[list[str], dict[str, list[int]]]:
        """Advance reads; returns `(finished, failed)` since the last call.

        `finished`: request ids whose blocks are in staging and confirmed by P
        (the caller copies them out, then `staging.free(req_id)`). `failed`:
        request id -> logical block ids (D's) to recompute; their slots are freed here.
        """
        now = time.monotonic() if now is None else now
        self._drain_notifs()
        for read in list(self._reads.values()):
            if read.state == "xfer":
                try:
                    state = self.agent.check_xfer_state(read.handle)
                except Exception as e:
                    logger.warning("D %s xfer state of %s: %s", self.config.name, read.req_id, e)
                    state = "ERR"
                if state == "DONE":
                    self._release(read.handle)
                    read.handle = None
                    try:
                        _send(self.agent, read.peer, "done", req_id=read.req_id,
                              generation=read.generation)
                        read.state = "ack"
                    except TransferError as e:
                        logger.warning("D %s: %s", self.config.name, e)
                        self._drop_peer(read.peer)
                        self._fail(read)
                        continue
                elif state == "ERR":
                    logger.warning("D %s READ of %s from %s failed", self.config.name,
                                   read.req_id, read.peer)
                    self._drop_peer(read.peer)
                    self._fail(read)
                    continue
            if now > read.deadline and read.req_id in self._reads:
                logger.warning("D %s read of %s from %s timed out in state %s",
                               self.config.name, read.req_id, read.peer, read.state)
                self._fail(read)
        self._heartbeat(now)
        self._reap_zombies()
        done, self._done = self._done, []
        failed, self._failed = self._failed, {}
        return done, failed

    def _drain_notifs(self) -> None:
        for sender, messages in self.agent.get_new_notifs().items():
            for raw in messages:
                try:
                    msg = decode_message(raw, sender)
                except TransferError as e:
                    if sender not in self._peers:
                        self._adverts[sender] = e  # a handshake in progress fails loudly
                    logger.warning("D %s ignores a message: %s", self.config.name, e)
                    continue
                if msg["t"] == "layout":
                    self._adverts[sender] = msg
                elif msg["t"] == "ack":
                    read = self._reads.get(msg.get("req_id"))
                    if (read is None or read.peer != sender or read.state != "ack"
                            or read.generation != msg.get("generation")):
                        continue
                    if msg.get("ok") is True:
                        del self._reads[read.req_id]
                        self._done.append(read.req_id)
                        logger.debug("D %s read %s in %.4fs", self.config.name, read.req_id,
                                     time.monotonic() - read.started)
                    else:
                        logger.warning("D %s: P %s no longer held %s (lease expired)",
                                       self.config.name, sender, read.req_id)
                        self._fail(read)

    def _heartbeat(self, now: float) -> None:
        wanted: dict[str, list[tuple[str, int]]] = {}
        for read in self._reads.values():
            wanted.setdefault(read.peer, []).append((read.req_id, read.generation))
        for req_id, (peer, generation) in self._expected.items():
            wanted.setdefault(peer, []).append((req_id, generation))
        for peer, reqs in wanted.items():
            state = self._peers.get(peer)
            if state is None or now - state.last_heartbeat < self.config.heartbeat_interval_s:
                continue
            state.last_heartbeat = now
            try:
                _send(self.agent, peer, "hb", reqs=reqs)
            except TransferError as e:
                logger.warning("D %s: %s", self.config.name, e)

    def _fail(self, read: _Read) -> None:
        self._reads.pop(read.req_id, None)
        self._failed[read.req_id] = to_logical_ids(read.local_ids, self.kernel_ratio)
        if read.handle is not None and not self._release(read.handle):
            self._zombies.append((read.req_id, read.handle))
        elif read.req_id in self.staging:
            self.staging.free(read.req_id)

    def _release(self, handle: Any) -> bool:
        try:
            handle.release()
            return True
        except Exception:
            return False

    def _reap_zombies(self) -> None:
        still = []
        for req_id, handle in self._zombies:
            if self._release(handle):
                if req_id in self.staging:
                    self.staging.free(req_id)
            else:
                still.append((req_id, handle))
        self._zombies = still

    def pending(self) -> list[str]:
        """Request ids with a read in progress."""
        return list(self._reads)

    def close(self) -> None:
        """Deregister staging and drop the agent (its listener stops with it)."""
        _close_agent(self.agent, self._reg, f"D {self.config.name}")
        self.agent = None
