"""D's transport: handshakes with P peers, reads requests into staging, reports outcomes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.blocks import coalesce_pairs, is_int
from kvxfer.errors import InvalidInputError, LayoutMismatchError, TransferError
from kvxfer.nixl.agent import (
    TransportConfig,
    _close_agent,
    _free_everywhere,
    _release_name,
    _send,
    _stagings,
    _start_agent,
)
from kvxfer.staging import Staging
from kvxfer.wire import ReadParams, Source, _check_piece, _field, _is_generation, decode_message

logger = logging.getLogger(__name__)


_REFETCH_S = 0.25  # how often `connect` asks for a peer's metadata again


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

    def expect(self, params: ReadParams) -> None:
        """Keep P's lease on a request alive (heartbeats) until `start_read` takes it."""
        p = _check_params(params, len(self.stagings))
        self._expected[p.req_id] = (p.peers, p.instance, p.generation)

    def start_read(self, req_id: str, params: ReadParams, logical_ids: Sequence[int]) -> None:
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
        p = _check_params(params, len(self.stagings))
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


def _check_params(params: object, num_groups: int) -> ReadParams:
    if not isinstance(params, ReadParams):
        raise InvalidInputError(f"params must be ReadParams (ReadParams.parse of P's dict), got "
                                f"{type(params).__name__}")
    if len(params.keys) != num_groups:
        raise InvalidInputError(f"params name {len(params.keys)} KV cache groups, this D stages "
                                f"{num_groups}")
    return params
