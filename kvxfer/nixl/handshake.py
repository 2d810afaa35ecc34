"""The handshake between D and P agents, moved on in the background so neither engine waits.

`Hellos` is P's side: it answers each D agent's `hello` with P's `layout` once D's
metadata is loaded, and notices a D started again under its name. `Handshakes` is D's:
a handshake fetches P's NIXL metadata (from P's listener, or by name from
etcd), sends D's own and says `hello`; P's `layout` answer is checked and
the peer joins `Peers`. `begin` starts one and `advance` (called from D's
`poll`) moves every one on; neither waits. A handshake that fails is kept
as the answer for that peer and instance for `handshake_timeout_s`, so
every other request naming an unreachable P fails at once instead of each
waiting out its own deadline (params of a restarted P, a new instance, try
afresh). `ready` says whether a read's P agents are connected as
the instance its params name; when not, it asks the connected one who it is
(a probe), also without waiting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvxfer.errors import KvxferError, TransferError
from kvxfer.nixl.agent import gated, send
from kvxfer.nixl.complaints import Complaints
from kvxfer.nixl.etcd import Fetcher
from kvxfer.nixl.gate import Exchanges
from kvxfer.nixl.peers import Peer, Peers
from kvxfer.nixl.wire import ReadParams, new_instance
from kvxfer.stats import Recorder

__all__ = ["MAX_FAILED", "MAX_STARTS", "Handshakes", "Hellos"]

logger = logging.getLogger(__name__)

_REFETCH_S = 0.25  # how often a handshake asks for a peer's metadata again
_REHELLO_S = 1.0  # how long a handshake waits for P's answer before fetching afresh

_NO_ANSWER = object()  # a probe's answer: none within the deadline
MAX_FAILED = 1024
"""The most failed handshakes remembered at once (the oldest go first): params may name any
number of made-up P agents, and each failure is kept `handshake_timeout_s`."""
_SWEEP_S = 1.0  # how often expired failures are dropped
MAX_STARTS = 4096
"""The most D agents whose last start P remembers (the least recently heard go first)."""
MAX_WAITING = 1024
"""The most hellos P waits to answer at once (the oldest are dropped first; a D says
hello again after a second)."""


class Hellos:
    """P's side of the handshake: each D agent that said `hello` is answered with P's
    `layout` (`advertisement()`) once its NIXL metadata is loaded (pushed to P's listener,
    or fetched from etcd by `fetcher`), or dropped after `handshake_timeout_s`.

    NIXL keeps the first metadata it loads under a name and refuses another, so a D started
    again under its name (after a crash) would get P's answer at its dead start's address,
    for ever. Each `hello` names D's start; one naming another start than the last makes P
    drop the metadata it holds under that name, and the new start's loads when D pushes
    it again. What P cannot send is noted in `complaints`.
    """

    def __init__(self, agent: Any, config: Any, fetcher: Fetcher | None,
                 advertisement: Callable[[], dict[str, Any]], complaints: Complaints):
        self.agent, self.config, self.fetcher = agent, config, fetcher
        self.advertisement, self.complaints = advertisement, complaints
        self._waiting: dict[str, float] = {}  # D agent -> deadline to answer by
        self._starts: dict[str, str] = {}  # D agent -> the start its last hello named

    def __bool__(self) -> bool:
        """Whether a hello waits for its answer."""
        return bool(self._waiting)

    def heard(self, sender: str, start: object, now: float) -> None:
        """D agent `sender` said hello, naming `start` (None from a D before protocol 9)."""
        if isinstance(start, str) and start:
            start = start[:64]
            known = self._starts.pop(sender, None)
            self._starts[sender] = start  # most recently heard last
            while len(self._starts) > MAX_STARTS:
                del self._starts[next(iter(self._starts))]
            if known is not None and known != start and not gated(self.config):
                self._forget(sender)  # (through a gate, the new start's metadata replaced it)
        self._waiting.pop(sender, None)
        self._waiting[sender] = now + self.config.handshake_timeout_s  # newest last
        while len(self._waiting) > MAX_WAITING:  # made-up names: the oldest go first
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            self.complaints.note(oldest, "hello_dropped", f"over {MAX_WAITING} hellos waiting")
        if self.fetcher is not None:  # D published it in etcd before saying hello
            self.fetcher.fetch(sender)

    def _forget(self, sender: str) -> None:
        logger.debug("P %s: D agent %s started again; its earlier metadata is dropped",
                     self.config.name, sender)
        try:
            self.agent.remove_remote_agent(sender)
        except Exception as e:  # NIXL raises its own types for a name it does not hold
            logger.debug("P %s: dropping %s's metadata: %s", self.config.name, sender, e)

    def answer(self, now: float) -> None:
        """Send `layout` to each D whose metadata has arrived; drop those past their time."""
        for peer, deadline in list(self._waiting.items()):
            if self.agent.check_remote_metadata(peer):
                del self._waiting[peer]
                try:
                    send(self.agent, peer, "layout", **self.advertisement())
                except TransferError as e:
                    self.complaints.note(peer, "unanswered", e)
            elif now > deadline:
                del self._waiting[peer]
                self.complaints.note(peer, "hello_dropped", "no NIXL metadata from it in time")


@dataclass
class _Handshake:
    """A handshake under way: fetching P's metadata, then waiting for its `layout`."""

    host: str
    port: int
    deadline: float
    refetch: float  # when to ask for the metadata again
    instance: str | None = None  # the P instance the params that asked for it name
    hello_sent: bool = False
    hello_at: float = 0.0
    began: float = 0.0


class Handshakes:
    """The handshakes and probes of D's `Peers`, none of which waits; their times, failures
    and retries go to `recorder` (`d_handshake_s`, `d_handshake_failures`, `d_handshake_retries`)."""

    def __init__(self, peers: Peers, recorder: Recorder | None = None,
                 fetcher: Fetcher | None = None):
        self.peers, self.agent, self.config = peers, peers.agent, peers.config
        self.fetcher = fetcher  # with etcd: reads peers' records (`kvxfer.nixl.etcd.Fetcher`)
        self.recorder = recorder or Recorder()
        self._under_way: dict[str, _Handshake] = {}
        # peer -> (until, the instance asked for, why): a P restarted since is tried afresh
        self._failed: dict[str, tuple[float, str | None, KvxferError]] = {}
        self._next_sweep = 0.0
        self._probes: dict[str, Any] = {}  # peer -> answer deadline, or the answer
        # This start of D, named in every hello: a P that kept an earlier start's NIXL
        # metadata under D's name forgets it (NIXL refuses new metadata under a held name).
        self.start = new_instance()
        self.sent_to: set[tuple[str, int]] = set()  # P listeners that hold D's metadata
        # with a fleet key: metadata both ways through P's gate, never NIXL's listener
        self.exchanges = (Exchanges(self.agent, self.config.name, self.config.fleet_keys,
                                    self.config.handshake_timeout_s)
                          if gated(self.config) else None)

    def connect(self, peer: str, host: str, port: int) -> dict[str, Any]:
        """Handshake with P agent `peer` at `host:port` and wait for it; returns its layout.

        With `etcd_endpoints`, `peer`'s metadata is fetched by name from etcd
        (`host` and `port` are unused). Raises `TransferError` if the peer does
        not answer within `handshake_timeout_s` or sends a bad advertisement,
        and `LayoutMismatchError` if its layout is incompatible. For tools and
        tests: an engine thread uses `begin` and `status`, which never wait.
        """
        self._failed.pop(peer, None)  # asked for by name: try afresh
        self.begin(peer, host, port)
        while (state := self.status(peer)) is None:
            self.advance()
            time.sleep(0.002)
        if state is not True:
            raise state
        return self.peers.get(peer).layout

    def begin(self, peer: str, host: str, port: int, instance: str | None = None,
              now: float | None = None) -> None:
        """Start a handshake with `peer` (`advance` moves it on), for params naming
        `instance` of it, unless it is connected, being connected, or failed for that
        instance within the last `handshake_timeout_s`."""
        now = time.monotonic() if now is None else now
        if peer in self.peers or peer in self._under_way or self._failure(peer, instance, now):
            return
        self._failed.pop(peer, None)
        self.peers.take_advert(peer)
        handshake = _Handshake(host, port, now + self.config.handshake_timeout_s,
                               now + _REFETCH_S, instance, began=now)
        self._under_way[peer] = handshake
        try:
            if not self.config.uses_etcd and port == 0:
                raise TransferError(f"peer {peer!r} has no listener (port 0: it publishes its "
                                    f"metadata in etcd); give this D etcd_endpoints")
            self._fetch(peer, handshake)
        except Exception as e:
            self._give_up(peer, e, now)

    def status(self, peer: str, instance: str | None = None) -> bool | KvxferError | None:
        """True once `peer` is connected; None while a handshake with it is under way (or
        none was begun); else why the last one, for params naming `instance`, failed."""
        if peer in self.peers:
            return True
        if peer in self._under_way:
            return None
        return self._failure(peer, instance)

    def under_way(self, peer: str) -> bool:
        """Whether a handshake with `peer` is under way."""
        return peer in self._under_way

    def _failure(self, peer: str, instance: str | None, now: float | None = None
                 ) -> KvxferError | None:
        failed = self._failed.get(peer)
        if failed is None or failed[1] != instance:
            return None
        return failed[2] if now is None or failed[0] > now else None

    def ready(self, p: ReadParams) -> bool | KvxferError | str | None:
        """Whether the P agents `p` names are connected as the instance it names: True; None
        while connecting to them or asking one who it is; an error that fails the read;
        or the name of a connected peer that did not answer for itself (drop it, and the
        read connects afresh)."""
        for name in p.peers:
            connected = self.peers.get(name)
            if connected is None:
                self.begin(name, p.host, p.port, p.instance)
                state = self.status(name, p.instance)
                if state is not True:
                    return state
            elif connected.instance != p.instance:
                # Params from a restarted P, or stale ones: ask the connected P who it is.
                answer = self._probe(connected)
                if answer is False:
                    return None
                if answer != connected.instance:
                    return name
                self.peers.mark_past(name, p.instance)  # alive: these params are not its own
                return TransferError(f"params of {p.req_id!r} are from P instance "
                                     f"{p.instance} of {name!r}, which is not the live one "
                                     f"(P restarted)")
        return True

    def advance(self, now: float | None = None) -> None:
        """Read notifications and move every handshake and probe on; never waits."""
        self.peers.drain()
        if self.fetcher is not None:
            self.fetcher.tick()
        now = time.monotonic() if now is None else now
        if self._failed and now >= self._next_sweep:
            self._failed = {peer: f for peer, f in self._failed.items() if f[0] > now}
            self._next_sweep = now + _SWEEP_S
        for peer, handshake in list(self._under_way.items()):
            try:
                self._step(peer, handshake, now)
            except Exception as e:
                self._give_up(peer, e, now)
        for peer, deadline in list(self._probes.items()):
            if not isinstance(deadline, float):
                continue
            advert = self.peers.take_advert(peer)
            if advert is not None or now > deadline:
                instance = advert.get("instance") if isinstance(advert, dict) else None
                self._probes[peer] = instance if isinstance(instance, str) else _NO_ANSWER

    def _step(self, peer: str, handshake: _Handshake, now: float) -> None:
        if not handshake.hello_sent:
            refused = self.exchanges.status(peer) if self.exchanges is not None else None
            if isinstance(refused, KvxferError):
                raise TransferError(f"peer {peer!r} {self._where(handshake)}: no metadata "
                                    f"through its gate: {refused}")
            if self.agent.check_remote_metadata(peer):
                if not self.config.uses_etcd and self.exchanges is None:
                    self.agent.send_local_metadata(handshake.host, handshake.port)
                    self.sent_to.add((handshake.host, handshake.port))
                send(self.agent, peer, "hello", agent=self.config.name, start=self.start)
                handshake.hello_sent, handshake.hello_at = True, now
            elif now > handshake.deadline:
                raise TransferError(
                    f"peer {peer!r} {self._where(handshake)} sent no NIXL metadata within "
                    f"{self.config.handshake_timeout_s}s (unknown peer or not "
                    f"{'published' if self.config.uses_etcd else 'listening'})")
            elif now > handshake.refetch:
                # NIXL may first spend a fetch on a cached socket to a previous
                # listener at that address (a restarted P), which it then closes;
                # a P starting up may not have published yet.
                self._fetch(peer, handshake)
                handshake.refetch = now + _REFETCH_S
            return
        advert = self.peers.take_advert(peer)
        if advert is None:
            if now > handshake.deadline:
                raise TransferError(f"peer {peer!r} {self._where(handshake)} sent no layout "
                                    f"within {self.config.handshake_timeout_s}s")
            if now > handshake.hello_at + _REHELLO_S:
                # No answer: the metadata may be a dead P's (a stale etcd record, a listener
                # since restarted). Fetch it afresh and say hello again.
                self.peers.forget(peer)
                self._fetch(peer, handshake)
                handshake.hello_sent, handshake.refetch = False, now + _REFETCH_S
                self.recorder.count("d_handshake_retries")
            return
        if isinstance(advert, TransferError):
            raise advert
        accepted = self.peers.connected(peer, advert)
        del self._under_way[peer]
        self.recorder.observe("d_handshake_s", now - handshake.began)
        logger.debug("D %s connected to %s (instance %s) %s", self.config.name, peer,
                     accepted.instance, self._where(handshake))

    def _probe(self, peer: Peer) -> str | None | bool:
        """Who answered a fresh `hello` over the connection to `peer`: its instance, None if
        none did within `handshake_timeout_s`, or False while waiting (the first call sends
        the hello). A dead or replaced peer does not answer. Each answer is given once."""
        state = self._probes.get(peer.name)
        if state is None:
            self.peers.take_advert(peer.name)
            try:
                send(self.agent, peer.name, "hello", agent=self.config.name, start=self.start)
            except TransferError:
                return None
            self._probes[peer.name] = time.monotonic() + self.config.handshake_timeout_s
            return False
        if isinstance(state, float):
            return False
        del self._probes[peer.name]
        return None if state is _NO_ANSWER else state

    def _give_up(self, peer: str, error: Exception, now: float) -> None:
        handshake = self._under_way.pop(peer, None)
        self.peers.forget(peer)
        self.recorder.count("d_handshake_failures")
        if not isinstance(error, KvxferError):
            where = self._where(handshake) if handshake else ""
            error = TransferError(f"handshake with peer {peer!r} {where} failed: {error}")
        self._failed.pop(peer, None)  # re-inserted last: the newest failure is kept longest
        self._failed[peer] = (now + self.config.handshake_timeout_s,
                              handshake.instance if handshake else None, error)
        while len(self._failed) > MAX_FAILED:
            del self._failed[next(iter(self._failed))]
        logger.warning("D %s: %s", self.config.name, error)

    def _fetch(self, peer: str, handshake: _Handshake) -> None:
        """Ask for `peer`'s metadata: from etcd (through `fetcher`), or from its listener."""
        if self.config.uses_etcd and self.fetcher is not None:
            self.fetcher.fetch(peer)
        elif self.exchanges is not None:
            self.exchanges.start(peer, handshake.host, handshake.port)
        else:
            self.agent.fetch_remote_metadata(peer, *self._source(handshake))

    def _source(self, handshake: _Handshake) -> tuple[Any, ...]:
        return () if self.config.uses_etcd else (handshake.host, handshake.port)

    def _where(self, handshake: _Handshake) -> str:
        if self.config.uses_etcd:
            return f"in etcd at {self.config.etcd_endpoints}"
        return f"at {handshake.host}:{handshake.port}"
