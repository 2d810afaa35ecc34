"""D's P peers: the handshake, what each P advertised, and which start of it is live.

D fetches P's agent metadata (from P's listener, or by name from etcd),
makes sure P can answer, then says `hello` (`kvxfer.nixl.handshake`); P
answers with a `layout` message: its instance, its cache layout and, per
group, its staging regions. D checks them against its own before any read. A P restarted under the same
name is a new instance: `is_past` says which instances of a name are gone, so
params from before a restart are refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer.device.staging import Staging
from kvxfer.errors import LayoutMismatchError, TransferError
from kvxfer.nixl.agent import TransportConfig, send
from kvxfer.nixl.complaints import Complaints
from kvxfer.nixl.wire import ReadParams, Source, check_piece, decode_message

__all__ = ["MAX_ADVERTS", "LayoutCheck", "Peer", "PeerGroup", "Peers"]

logger = logging.getLogger(__name__)

MAX_ADVERTS = 1024
"""The most answers to a `hello` kept until a handshake takes them."""

LayoutCheck = Callable[[Mapping[str, Any], Mapping[str, Any]], None]
"""`(local, remote) -> None`, raising `LayoutMismatchError` where P's blocks cannot land in D's
(`kvxfer.device.layout.check_block_compatible`)."""


@dataclass
class PeerGroup:
    """One KV cache group's staging on a P agent, as it advertised it."""

    regions: list[tuple[int, int]]  # per layer, (base address, length in bytes)
    prints: tuple[int, int]  # the fingerprint region
    tags: tuple[int, int]  # the tag region
    block_bytes: int
    num_slots: int


@dataclass
class Peer:
    """A connected P agent."""

    name: str
    instance: str
    groups: list[PeerGroup]
    layout: dict[str, Any]
    piece: tuple[int, int, int]  # (lo, hi, units) its staging holds of each block
    last_heartbeat: float = 0.0


class Peers:
    """D's connected P agents, on D's NIXL agent.

    **Arguments:**

    - `agent`: D's NIXL agent; `config`: its `TransportConfig`.
    - `stagings`: D's staging, one per group (P's must match its block bytes).
    - `layout`, `layout_check`: D's advertised layout and the check of P's against it.
    - `piece`: `(lo, hi, units)` D's staging holds of each block.
    - `on_ack`: `(sender, message)`, called with each `ack` as it is read (D's read
      state machine); a `TransferError` it raises is a malformed message.
    - `on_chunk`: the same for each `chunk` and `wait` of a stream.

    Notifications are read here (`drain`), wherever D waits for a peer.
    """

    def __init__(self, agent: Any, config: TransportConfig, stagings: Sequence[Staging],
                 layout: Mapping[str, Any], layout_check: LayoutCheck,
                 piece: tuple[int, int, int],
                 on_ack: Callable[[str, dict[str, Any]], None],
                 on_chunk: Callable[[str, dict[str, Any]], None] | None = None):
        self.agent, self.config, self.stagings = agent, config, stagings
        self.layout, self.layout_check, self.piece = dict(layout), layout_check, piece
        self.on_ack, self.on_chunk = on_ack, on_chunk
        self._peers: dict[str, Peer] = {}
        self._instances: dict[str, str] = {}  # peer -> the instance last connected to
        self._past: dict[str, set[str]] = {}  # peer -> instances known to be gone
        self._adverts: dict[str, dict[str, Any] | TransferError] = {}
        self.complaints = Complaints(f"D {config.name}", logger)  # bad messages, once a minute

    def __contains__(self, name: object) -> bool:
        return name in self._peers

    def get(self, name: str) -> Peer | None:
        return self._peers.get(name)

    def verified_names(self) -> list[str]:
        """Every P agent D completed a handshake with (connected now or before), oldest first."""
        return list(self._instances)

    def is_past(self, name: str, instance: str) -> bool:
        """Whether `instance` of P agent `name` is known to be gone (P restarted)."""
        return instance in self._past.get(name, ())

    def mark_past(self, name: str, instance: str) -> None:
        self._past.setdefault(name, set()).add(instance)

    def take_advert(self, peer: str) -> dict[str, Any] | TransferError | None:
        """`peer`'s answer to a `hello` read by `drain`, once (None: none yet)."""
        return self._adverts.pop(peer, None)

    def connected(self, peer: str, advert: dict[str, Any]) -> Peer:
        """Accept `peer`'s advertisement (`LayoutMismatchError` if D cannot read from it)."""
        accepted = self._accept(peer, advert)
        self._peers[peer] = accepted
        instance = accepted.instance
        if self._instances.get(peer, instance) != instance:  # a new start of that P
            self.mark_past(peer, self._instances[peer])
        self._instances[peer] = instance
        return accepted

    def _accept(self, peer: str, advert: dict[str, Any]) -> Peer:
        """Check P's advertisement against D's staging and layout."""
        try:
            layout = dict(advert["layout"])
            instance = advert["instance"]
            if not isinstance(instance, str) or not instance:
                raise ValueError(f"instance {instance!r}")
            groups = [PeerGroup([(int(a), int(n)) for a, n in g["regions"]],
                                (int(g["prints"][0]), int(g["prints"][1])),
                                (int(g["tags"][0]), int(g["tags"][1])),
                                int(g["block_bytes"]), int(g["num_slots"]))
                      for g in advert["groups"]]
            piece = check_piece(advert.get("piece"))
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"layout message from {peer!r} is malformed: {e!r}") from None
        if piece[2] != self.piece[2]:
            raise LayoutMismatchError(
                f"peer {peer!r} stages units {piece[:2]} of {piece[2]} per block, local "
                f"staging units {self.piece[:2]} of {self.piece[2]}")
        theirs_n, ours_n = piece[1] - piece[0], self.piece[1] - self.piece[0]
        self.layout_check(self.layout, layout)
        if len(groups) != len(self.stagings):
            raise LayoutMismatchError(
                f"peer {peer!r} stages {len(groups)} KV cache groups, local staging has "
                f"{len(self.stagings)}")
        for g, (theirs, ours) in enumerate(zip(groups, self.stagings)):
            # Per unit of a piece.
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
            if theirs.tags[1] != theirs.num_slots * ours.tags.strides[0]:
                raise LayoutMismatchError(
                    f"peer {peer!r} group {g} advertises a {theirs.tags[1]}-byte tag region for "
                    f"{theirs.num_slots} slots")
        return Peer(peer, instance, groups, layout, piece)

    def check_source(self, p: ReadParams, source: Source) -> None:
        """Check connected `source`'s P agent is the instance and piece the params name."""
        peer = self.get(source.peer)
        if peer is None:
            raise TransferError(f"P agent {source.peer!r} of {p.req_id!r} is not connected")
        if peer.instance != p.instance:
            self.mark_past(source.peer, p.instance)
            raise TransferError(
                f"params of {p.req_id!r} are from P instance {p.instance}, but {source.peer!r} "
                f"is now instance {peer.instance} (P restarted)")
        if peer.piece != (source.lo, source.hi, p.units):
            raise TransferError(f"params of {p.req_id!r} say {source.peer!r} stages units "
                                f"[{source.lo}, {source.hi}) of {p.units}, it advertised "
                                f"{peer.piece}")
        for g, (slots, group) in enumerate(zip(p.slots, peer.groups)):
            bad = [s for s in slots if s >= group.num_slots]
            if bad:
                raise TransferError(f"params of {p.req_id!r} name P slots {bad[:4]} of group "
                                    f"{g}, past {source.peer!r}'s {group.num_slots}")

    def heartbeat(self, wanted: Callable[[], Mapping[str, list[list[Any]]]], now: float
                  ) -> dict[str, str]:
        """Send `hb` to each connected peer in `wanted()` (`[P's request id, generation, done
        token]` per request) whose last one is `heartbeat_interval_s` old; returns the peers
        it failed for, with why. `wanted` is called only when one is due: D's engine calls
        this every step."""
        interval = self.config.heartbeat_interval_s
        if all(now - peer.last_heartbeat < interval for peer in self._peers.values()):
            return {}
        failed = {}
        for name, reqs in wanted().items():
            peer = self._peers.get(name)
            if peer is None or now - peer.last_heartbeat < self.config.heartbeat_interval_s:
                continue
            peer.last_heartbeat = now
            try:
                send(self.agent, name, "hb", instance=peer.instance, reqs=reqs)
            except TransferError as e:
                failed[name] = str(e)
        return failed

    def say_done(self, requests: Sequence[tuple[str, list[str], str, int, str]],
                 reader: tuple[int, int]) -> dict[str, str]:
        """`done` for each `(P's request id, P agents, instance, generation, done token)` to
        each connected agent of that instance (a gone or restarted one lets the lease lapse);
        returns the peers it failed for, with why."""
        failed = {}
        for req_id, names, instance, generation, token in requests:
            for name in names:
                peer = self._peers.get(name)
                if peer is None or peer.instance != instance or name in failed:
                    continue
                try:
                    self.send_done(name, req_id, instance, generation, token, reader)
                except TransferError as e:
                    failed[name] = str(e)
        return failed

    def send_done(self, name: str, req_id: str, instance: str, generation: int, token: str,
                  reader: tuple[int, int]) -> None:
        """Tell P agent `name` that D (process `reader[0]` of `reader[1]`) no longer needs
        P's request `req_id` of that instance and generation, with the `done_token` of its
        secret; `TransferError` if it fails."""
        send(self.agent, name, "done", req_id=req_id, instance=instance, generation=generation,
             token=token, readers=reader[1], reader=reader[0])

    def forget(self, peer: str) -> None:
        """Drop NIXL's metadata of `peer`, so the next connect fetches it afresh."""
        try:
            self.agent.remove_remote_agent(peer)
        except Exception as e:
            logger.debug("D %s remove %s: %s", self.config.name, peer, e)

    def drop(self, peer: str) -> bool:
        """Disconnect `peer` (`forget` it once its reads are settled); whether it was connected."""
        return self._peers.pop(peer, None) is not None

    def _keep_advert(self, sender: str, advert: dict[str, Any] | TransferError) -> None:
        """Keep `sender`'s answer until a handshake takes it: at most `MAX_ADVERTS`, the
        oldest dropped first (any agent may send a `layout` nobody asked for)."""
        self._adverts.pop(sender, None)
        self._adverts[sender] = advert
        while len(self._adverts) > MAX_ADVERTS:
            del self._adverts[next(iter(self._adverts))]

    def drain(self) -> None:
        """Read D's notifications: advertisements for the handshake, acks to `on_ack`.

        Never raises because of what a peer sent: a bad message is logged and
        dropped (and fails a handshake with that peer in progress).
        """
        for sender, messages in self.agent.get_new_notifs().items():
            for raw in messages:
                try:
                    msg = decode_message(raw, sender)
                    if msg["t"] == "layout":
                        self._keep_advert(sender, msg)
                    elif msg["t"] == "ack":
                        self.on_ack(sender, msg)
                    elif msg["t"] in ("chunk", "wait") and self.on_chunk is not None:
                        self.on_chunk(sender, msg)
                    else:
                        self.complaints.note(sender, "unknown_type", f"a {msg['t']!r} message")
                except TransferError as e:
                    if sender not in self._peers and not isinstance(self._adverts.get(sender),
                                                                    dict):
                        self._keep_advert(sender, e)  # a handshake in progress fails loudly
                    self.complaints.note(sender, "malformed", e)
