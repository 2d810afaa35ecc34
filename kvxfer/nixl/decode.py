"""D's transport: reads requests from P into staging, in a state machine per request.

`start_read` posts one NIXL READ per P agent of a request (a *leg*) on a
thread of D's own, with one descriptor per (group, layer, run of slots
contiguous on both sides) plus one per run for the slots' fingerprint rows.
Once every leg's READ is done D sends `done` to each P agent and waits for
its `ack`; a request is finished once every P agent acked `ok`. Every read
has a deadline (`transfer_timeout_s`, from `start_read` to the last ack);
a transfer error, a gone or restarted peer, a refused ack, stale params or
the deadline fail the request alone, in the logical block ids its caller
gave, and never hang D. D's slots of a failed read are released only once
NIXL has released its transfers. docs/internals.md ("The NIXL transport")
says why each rule is there.

Multi-host reads. Params with `sources` name every P process and its units.
A D process reads from each process holding units it needs exactly those
units (one descriptor per block, or per run of slots where the ranges match
whole; of replicas, the one its rank picks), and sends `done` to every P
process of the request, read from or not, so each frees its slots; the read
finishes once all of them have acked. Whether every D process finished is
the engine's to agree on (`kvxfer.connector`).

Streams (`start_stream`). D subscribes to P with the request's stream id
(`want`, once connected) and reads each `chunk` of blocks P names final, one
READ at a time (chunks that arrived meanwhile in one), checking each
chunk's tags as it lands; after the last chunk it says `done` under the
generation P named with it. Each chunk moves the read's deadline on, and so
does each `wait` P sends while the stream's last chunk is still to come (the
request waits in P's queue, or is being prefilled). Every
read's blocks, streamed or not, are reported as they arrive and check
(`arrived`), before `done` is even sent: the caller may write them out while
the ack travels, and reports the request only once `poll` says it finished.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from kvxfer.device.staging import Staging, free_in_all, stagings_of
from kvxfer.errors import InvalidInputError, LayoutMismatchError, TransferError
from kvxfer.nixl import reads
from kvxfer.nixl.agent import TransportConfig, close_transport, forget_me, start_agent
from kvxfer.nixl.etcd import Fetcher, Publication
from kvxfer.nixl.handshake import Handshakes
from kvxfer.nixl.peers import LayoutCheck, Peers
from kvxfer.nixl.reads import (
    Arrivals,
    Leg,
    LegState,
    Poster,
    Read,
    Zombies,
    acked,
    check_legs,
    check_new,
    posting,
    read_descriptors,
    say_done,
    settle_posts,
    wait_for_posts,
)
from kvxfer.nixl.streams import StreamReads
from kvxfer.nixl.wire import (
    ReadParams,
    StreamParams,
    check_piece,
    done_token,
)
from kvxfer.plan.blocks import is_int
from kvxfer.stats import Recorder, Trace

__all__ = ["DecodeTransport", "LegState"]

logger = logging.getLogger(__name__)


class DecodeTransport:
    """D side: handshakes with P peers, reads requests into staging, reports outcomes.

    **Arguments:**

    - `config`: `TransportConfig`.
    - `staging`: where reads land, one per KV cache group (a single `Staging`
      is one group); each must match P's block bytes and layer count.
    - `layout`: this side's JSON-able cache layout, checked against each peer's.
    - `layout_check`: `(local, remote) -> None`, raising `LayoutMismatchError`
      where a peer's blocks cannot land in D's (`kvxfer.device.layout.check_block_compatible`).
    - `piece`: `(lo, hi, units)`: this process's staging holds units `[lo, hi)` of each
      block (`kvxfer.device.pieces`); None: plain blocks, one unit each.
    - `reader`: `(rank, count)`: this D process among its instance's. P frees a
      request once all `count` have said done.
    - `recorder`: where handshake timings go (`kvxfer.stats`); None: one of its own.
    """

    def __init__(
        self,
        config: TransportConfig,
        staging: Staging | Sequence[Staging],
        layout: Mapping[str, Any],
        layout_check: LayoutCheck,
        piece: tuple[int, int, int] | None = None,
        reader: tuple[int, int] = (0, 1),
        recorder: Recorder | None = None,
    ):
        self.config, self.stagings, self.layout = config, stagings_of(staging), dict(layout)
        self.piece = check_piece(piece)
        if not (isinstance(reader, (tuple, list)) and len(reader) == 2
                and all(is_int(v) for v in reader) and 0 <= reader[0] < reader[1]):
            raise InvalidInputError(f"reader must be (rank, count) with 0 <= rank < count, "
                                    f"got {reader!r:.80}")
        self.reader = (int(reader[0]), int(reader[1]))
        self.agent, self.port, self._reg = start_agent(config, self.stagings)
        self._publication = Publication(self.agent, config)  # P fetches D's from etcd too
        self.peers = Peers(self.agent, config, self.stagings, self.layout, layout_check,
                           self.piece, on_ack=self._on_ack,
                           on_chunk=lambda sender, msg: self.streams.on_chunk(sender, msg))
        self.recorder = recorder or Recorder()
        self.peers.complaints.recorder, self.peers.complaints.counter = (self.recorder,
                                                                         "d_messages_dropped")
        self._fetcher = Fetcher(self.agent, config) if config.uses_etcd else None
        self.handshakes = Handshakes(self.peers, self.recorder, self._fetcher)
        self._reads: dict[str, Read] = {}
        self.leases = Leases(config, self.peers, self.handshakes, self.reader)
        self.streams = StreamReads(config, self.agent, self.stagings, self.peers, self.handshakes,
                                   self.piece, self._reads, self._fail, self._drop_peer, self._post,
                                   readers=self.reader[1])
        self._zombies = Zombies(self.stagings)
        # READs are posted on a thread of their own: over UCX `cma` the post itself
        # copies the bytes (NIXL releases the GIL meanwhile), which would hold the
        # engine's thread for the whole read.
        self._poster = Poster(config.name)
        self._done: list[str] = []
        self._failed: dict[str, list[int]] = {}
        self.arrivals = Arrivals(self.stagings, self.recorder, config.name)

    @property
    def staging(self) -> Staging:  # the first group's (the only one of a single-group model)
        return self.stagings[0]

    def _drop_peer(self, peer: str, why: str) -> None:
        """Disconnect `peer` (gone, restarted or failing); its reads fail with it."""
        if not self.peers.drop(peer):
            return
        logger.warning("D %s drops peer %s: %s", self.config.name, peer, why)
        for read in [r for r in self._reads.values() if peer in r.legs and not r.waiting]:
            self._fail(read, reason="peer_gone")  # those still waiting connect afresh
        self.peers.forget(peer)  # after its reads' posts have settled

    # -- reads

    def expect(self, params: ReadParams) -> None:
        """Keep P's lease on a request alive until `start_read` takes it or `cancel` drops it
        (`Leases.expect`)."""
        self.leases.expect(_check_params(params, len(self.stagings)))

    def cancel(self, req_id: str, instance: str | None = None) -> None:
        """Stop keeping P's lease on P's request `req_id` of `instance` (`Leases.cancel`)."""
        self.leases.cancel(req_id, instance)

    def start_read(self, req_id: str, params: ReadParams, logical_ids: Sequence[int],
                   trace: Trace | None = None, prompt: str | None = None, hashes: Any = None
                   ) -> None:
        """Post the READ of `req_id`'s blocks from P into D's staging, under P's keys.

        `logical_ids` are the engine's (D's) block ids the request's blocks
        land in: what is reported if the read fails. Raises
        `InvalidInputError` for malformed params or a request already being
        read, before any state changes; never raises for a peer problem: the
        request is then reported failed by `poll`. Never waits for a peer: a
        P agent not yet connected is connected to in the background (`poll`
        moves the handshake on) and the read is posted once it is. `trace` gets
        its phases (`connect`, `read`, `ack`) and, if it fails, its outcome. Tags are
        checked under D's own `prompt` digest and `hashes` (`ReadParams.tag_secrets`).
        """
        self._check_new(req_id, logical_ids)
        p = _check_params(params, len(self.stagings)).from_one_agent(self.piece[2])
        self.leases.taken(p)
        read = Read(req_id, p.req_id, p.instance, p.generation, list(logical_ids),
                     time.monotonic() + self.config.transfer_timeout_s, params=p,
                     token=done_token(p.secret), prompt=prompt, hashes=hashes,
                     trace=trace or Trace(req_id, "D", p.req_id, p.peer, self.config.name))
        self._reads[req_id] = read
        try:
            past = [peer for peer in p.peers if self.peers.is_past(peer, p.instance)]
            if past:
                raise TransferError(f"params of {req_id!r} are from P instance {p.instance} of "
                                    f"{past}, which is not the live one (P restarted)")
            read.plan = _units_to_read(p, self.piece, self.reader[0], self.config.uses_etcd)
            read.legs = {peer: Leg(peer, state=LegState.XFER if read.plan[peer] else
                                    LegState.READ) for peer in p.peers}
        except Exception as e:  # any failure here is this request's, not the engine's
            self._fail(read, e, "refused")
            return
        self._try_post(read)

    def _try_post(self, read: Read) -> None:
        """Post `read` once every P agent it names is connected as the instance it names;
        until then, move its handshakes (and probes) on. Never waits."""
        p = read.params
        state = self.handshakes.ready(p)
        if state is None:
            return  # connecting, or asking who the connected P is
        if isinstance(state, str):  # connects afresh at the next poll
            self._drop_peer(state, f"params name instance {p.instance}; it does not answer")
            return
        if state is not True:
            self._fail(read, state)
            return
        try:
            for source in p.sources:
                self.peers.check_source(p, source)
            read.d_slots = [s.assign(read.req_id, keys) for s, keys in zip(self.stagings, p.keys)]
        except Exception as e:
            self._fail(read, e, "refused")
            return
        read.waiting = False
        read.mark = read.trace.phase("connect", read.started)
        for peer, span in read.plan.items():
            if span is not None:  # the leg reading this process's first units reads the tags
                descriptors = functools.partial(read_descriptors, self.peers.get(peer), self.stagings,
                                                self.piece, p.slots, read.d_slots, span,
                                                span[0] == self.piece[0])
                read.legs[peer].posting = self._post(read.legs[peer], descriptors, read.req_id)

    def start_stream(self, req_id: str, params: StreamParams, logical_ids: Sequence[int],
                     skip: Sequence[int] | None = None, prompt: str | None = None,
                     trace: Trace | None = None, hashes: Any = None) -> None:
        """Read `req_id` while P still prefills it: subscribe to its stream, read each chunk
        P names final as it is named (`arrived` reports them), and finish after the last
        (`kvxfer.nixl.streams.StreamReads`).

        `skip`: per group, the kernel positions below which D holds the blocks itself
        (not read); `prompt`: D's prompt digest, which P's must equal. Failures are as
        for `start_read`'s, in `logical_ids`; P giving up on the request fails it too.
        """
        self._check_new(req_id, logical_ids)
        self.streams.start(req_id, params, logical_ids, skip, prompt, trace, hashes)

    def _post(self, leg: Leg, descriptors: Callable[[], Any], req_id: str) -> Future:
        """Post `leg`'s READ of `descriptors()` on the poster thread, with `reads.post` as it
        is at the call (tests replace it to hold posts)."""
        return self._poster.post(reads.post, self.agent, leg, descriptors, req_id,
                                 self.config.name, idle=not posting(self._reads.values()))

    def _check_new(self, req_id: str, logical_ids: object) -> None:
        check_new(req_id, logical_ids, self._reads, self._zombies, self.stagings)

    def arrived(self) -> dict[str, list[list[int]]]:
        """Per request, per group, the keys whose blocks landed in staging and checked since
        the last call (the request is not finished until `poll` says so; until then, or a
        failure, its slots stay as they are)."""
        return self.arrivals.take()

    def _check_landed(self, read: Read) -> bool:
        """Check the blocks the read's last READs brought and report them; False if the
        read failed (its slots at P do not hold its blocks)."""
        if self.arrivals.check(read):
            return True
        self._fail(read, reason="binding")
        return False

    def poll(self, now: float | None = None) -> tuple[list[str], dict[str, list[int]]]:
        """Advance reads; returns `(finished, failed)` since the last call.

        `finished`: request ids whose blocks are in staging and confirmed by P
        (the caller copies them out, then frees them in every staging).
        `failed`: request id -> the logical ids given to `start_read`; their
        slots are freed here.
        """
        still_posting = wait_for_posts(self._reads.values())
        now = time.monotonic() if now is None else now
        if not still_posting:
            self.handshakes.advance(now)
            for read in list(self._reads.values()):
                if read.req_id not in self._reads:  # failed with a peer meanwhile
                    continue
                if read.waiting:
                    (self.streams.subscribe if read.stream else self._try_post)(read)
                else:
                    self._advance(read)
                if now > read.deadline and read.req_id in self._reads:
                    logger.warning("D %s read of %s %s", self.config.name, read.req_id,
                                   _late(read, self.config, now))
                    self._fail(read, reason="deadline")
                    # A P that never acked a `done` may hold no (or another start's) NIXL
                    # metadata under D's name (a `hello` under it from another start): every
                    # later ack would miss D too. Connect afresh: the hello names D's start.
                    for peer in [p for p, leg in read.legs.items() if leg.state is LegState.ACK]:
                        self._drop_peer(peer, f"no ack within transfer_timeout_s="
                                              f"{self.config.transfer_timeout_s:g} s")
            self.recorder.gauge("d_requests_waiting", len(self._reads) + len(self.leases))
            self._heartbeat(now)
            self._zombies.reap()
            self._publication.tick()
        done, self._done = self._done, []
        failed, self._failed = self._failed, {}
        return done, failed

    def reading(self, req_id: str) -> Read | None:
        """Where the read of `req_id` stands (its legs, whether anything is posted), while
        it is under way; None before it starts and once it finished or failed."""
        return self._reads.get(req_id)

    def _advance(self, read: Read) -> None:
        """Check `read`'s posted READs; once all are done, say done to every P agent."""
        failed = check_legs(read, self.agent, self.config.name)
        if failed is not None:
            self._fail(read, reason="peer_gone")
            self._drop_peer(*failed)
            return
        if any(leg.state is LegState.XFER for leg in read.legs.values()):
            return
        if not self._check_landed(read) or (read.stream and self.streams.read_on(read)):
            return
        failed = say_done(read, self.peers, self.reader)
        if failed is not None:
            self._fail(read, reason="peer_gone")
            self._drop_peer(*failed)

    def _on_ack(self, sender: str, msg: dict[str, Any]) -> None:
        read, ok = acked(self._reads, sender, msg)
        if read is None:
            return
        if not ok:
            logger.warning("D %s: P %s no longer held %s (lease expired or P restarted)",
                           self.config.name, sender, read.req_id)
            self._fail(read, reason="lease_expired")
            return
        read.legs[sender].state = LegState.OK
        if all(leg.state is LegState.OK for leg in read.legs.values()):
            read.trace.phase("ack", read.mark)
            del self._reads[read.req_id]
            self._done.append(read.req_id)
            logger.debug("D %s read %s in %.4fs", self.config.name, read.req_id,
                         time.monotonic() - read.started)

    def _heartbeat(self, now: float) -> None:
        for peer, error in self.leases.beat(now, self._reads).items():
            self._drop_peer(peer, error)

    def _fail(self, read: Read, why: Exception | None = None, reason: str = "peer_gone") -> None:
        if self._reads.pop(read.req_id, None) is None:
            return
        if isinstance(why, LayoutMismatchError):
            reason = "refused"  # P's caches cannot land in D's
        read.trace.outcome = read.trace.outcome or reason
        if why is not None:
            logger.warning("D %s cannot read %s from %s: %s", self.config.name, read.req_id,
                           read.params.peers if read.params else read.stream.peer, why)
        self._failed[read.req_id] = list(read.logical_ids)
        self.arrivals.forget(read.req_id)
        self.streams.let_go(read)
        settle_posts(read, self.config.name)
        self._zombies.bury(read.req_id, [leg.handle for leg in read.legs.values()])

    def free(self, req_id: str) -> None:
        """Release a request's staging: finished, its blocks copied out, or given up on (the
        instance failed it elsewhere): a read still in progress then stops, unreported."""
        if (read := self._reads.get(req_id)) is None:
            return free_in_all(self.stagings, req_id)
        self._fail(read, reason="cancelled")  # its slots are freed once NIXL lets them go
        self._failed.pop(req_id, None)

    def pending(self) -> list[str]:
        """Request ids with a read in progress."""
        return list(self._reads)

    def close(self) -> None:
        """Deregister staging and drop the agent (its listener stops with it)."""
        if self.agent is None:
            return
        self._poster.shutdown(wait=True, cancel_futures=True)  # none may start on a closed agent
        forget_me(self.agent, self.handshakes.sent_to, f"D {self.config.name}")
        close_transport(self.agent, self._reg, self._publication, self._fetcher,
                        f"D {self.config.name}", self.config)
        self.agent = None


def _late(read: Read, config: TransportConfig, now: float) -> str:
    """Why `read` missed its deadline: a stream's P fell silent, or said `wait` for longer
    than `stream_wait_s` without a chunk, or where its legs stood."""
    if read.stream is not None and not read.waiting:
        if now >= read.wait_until:
            return (f"failed: P {read.stream.peer} said stream {read.stream.stream} is still "
                    f"coming, without naming a chunk of it, for longer than stream_wait_s="
                    f"{config.stream_wait_s:g} s; D drops it")
        return (f"failed: P {read.stream.peer} said nothing of stream {read.stream.stream} "
                f"(no chunk, no wait) for {config.transfer_timeout_s} s")
    return f"timed out in states {({p: leg.state.value for p, leg in read.legs.items()})}"


_Cancelled = tuple[str, list[str], str, int, str, float]
"""A request D cancelled: P's id, P agents, instance, generation, done token, and until when
to wait for a handshake with one of those agents to say it (at most a lease)."""


class Leases:
    """D's hold on P's leases: the requests D expects to read (not yet started) and those
    it reads are heartbeated (`beat`), so P keeps their staging; a cancelled one is said
    done, once D is connected to its P, so P frees it at once."""

    def __init__(self, config: TransportConfig, peers: Peers, handshakes: Handshakes,
                 reader: tuple[int, int]):
        self.config, self.peers, self.handshakes, self.reader = config, peers, handshakes, reader
        # (P instance, P's req) -> (peers, generation, done token): P instances may share ids
        self._expected: dict[tuple[str, str], tuple[list[str], int, str]] = {}
        self._cancelled: list[_Cancelled] = []  # to say done for (`_due`)

    def __len__(self) -> int:
        """How many requests D expects."""
        return len(self._expected)

    def expect(self, p: ReadParams) -> None:
        """Keep P's lease on `p`'s request alive (heartbeats; connecting to P in the
        background) until a read takes it (`taken`) or `cancel` drops it."""
        self._expected[(p.instance, p.req_id)] = (p.peers, p.generation, done_token(p.secret))
        for peer in p.peers:
            self.handshakes.begin(peer, p.host, p.port, p.instance)

    def taken(self, p: ReadParams) -> None:
        """A read of `p`'s request started: its lease is kept as the read's."""
        self._expected.pop((p.instance, p.req_id), None)

    def cancel(self, req_id: str, instance: str | None = None) -> None:
        """Stop keeping P's lease on P's request `req_id` of `instance` (None: any), which D
        will not read: P may free it (`done`, once D is connected to P). Unknown ids: ignored."""
        if not isinstance(req_id, str) or not isinstance(instance, (str, type(None))):
            raise InvalidInputError(f"cancel takes P's request id (a str), got {req_id!r:.80}, "
                                    f"and its instance (a str or None), got {instance!r:.80}")
        until = time.monotonic() + self.config.lease_s  # P's lease lapses by then anyway
        for key in [k for k in self._expected if k[1] == req_id and instance in (None, k[0])]:
            peers, generation, token = self._expected.pop(key)
            self._cancelled.append((req_id, peers, key[0], generation, token, until))

    def beat(self, now: float, reads: Mapping[str, Read]) -> dict[str, str]:
        """Extend P's leases of the requests D reads or expects, and say done for those
        cancelled; returns the peers that failed, with why."""
        self._cancelled, cancelled = _due(self._cancelled, now, self.peers, self.handshakes)
        failed = self.peers.heartbeat(lambda: _wanted(reads, self._expected), now)
        failed.update(self.peers.say_done([c[:5] for c in cancelled], self.reader))
        return failed


def _due(cancelled: list[_Cancelled], now: float, peers: Peers, handshakes: Handshakes
         ) -> tuple[list[_Cancelled], list[_Cancelled]]:
    """`(still waiting, to say done for now)`: one whose P D is still connecting to waits."""
    keep, due = [], []
    for entry in cancelled:
        waits = now < entry[5] and any(name not in peers and handshakes.under_way(name)
                                       for name in entry[1])
        (keep if waits else due).append(entry)
    return keep, due


def _wanted(reads: Mapping[str, Read],
            expected: Mapping[tuple[str, str], tuple[list[str], int, str]]
            ) -> dict[str, list[list[Any]]]:
    """Per P agent, the `[P's request id, generation, done token]` of each request D reads
    from it or expects (P extends a lease only for the token of its secret)."""
    wanted: dict[str, list[list[Any]]] = {}
    held = [(peers, key[1], generation, token)
            for key, (peers, generation, token) in expected.items()]
    held += [(r.legs, r.p_req_id, r.generation, r.token)
             for r in reads.values() if r.generation]
    for peers, req_id, generation, token in held:
        if not generation:  # a stream before its last chunk: P holds it without a lease
            continue
        for peer in peers:
            wanted.setdefault(peer, []).append([req_id, generation, token])
    return wanted


def _check_params(params: object, num_groups: int) -> ReadParams:
    if not isinstance(params, ReadParams):
        raise InvalidInputError(f"params must be ReadParams (ReadParams.parse of P's dict), got "
                                f"{type(params).__name__}")
    if len(params.keys) != num_groups:
        raise InvalidInputError(f"params name {len(params.keys)} KV cache groups, this D stages "
                                f"{num_groups}")
    return params


def _units_to_read(p: ReadParams, piece: tuple[int, int, int], rank: int,
                   uses_etcd: bool) -> dict[str, tuple[int, int] | None]:
    """Per P agent of the request, the units this D process reads from it (None: none):
    from each distinct unit range that overlaps this process's piece, the overlap, read
    from one of the sources holding that range (replicas: the one this reader's rank picks).
    Without etcd, agents are reached at the params' address, where only P's own is: params
    naming another would connect to that name at the wrong address for every request.
    """
    if not uses_etcd and p.peers != [p.peer]:
        raise TransferError(f"params of {p.req_id!r} name P agents {p.peers[:4]} without etcd: "
                            f"only {p.peer!r} is at {p.host}:{p.port}")
    if p.units != piece[2]:
        raise TransferError(f"params of {p.req_id!r} name {p.units} units per block, this D "
                            f"process holds units [{piece[0]}, {piece[1]}) of {piece[2]}")
    plan: dict[str, tuple[int, int] | None] = {s.peer: None for s in p.sources}
    lo, hi = piece[:2]
    for span in sorted({(s.lo, s.hi) for s in p.sources}):
        a, b = max(span[0], lo), min(span[1], hi)
        if a < b:
            holders = [s.peer for s in p.sources if (s.lo, s.hi) == span]
            plan[holders[rank % len(holders)]] = (a, b)
    return plan
