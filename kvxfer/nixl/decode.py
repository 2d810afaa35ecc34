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
generation P named with it. Each chunk moves the read's deadline on. Every
read's blocks, streamed or not, are reported as they arrive and check
(`arrived`), before `done` is even sent: the caller may write them out while
the ack travels, and reports the request only once `poll` says it finished.
"""

from __future__ import annotations

import enum
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvxfer.blocks import coalesce_pairs, is_int
from kvxfer.errors import InvalidInputError, LayoutMismatchError, TransferError
from kvxfer.nixl.agent import TransportConfig, close_agent, release_name, send, start_agent
from kvxfer.nixl.etcd import Publication
from kvxfer.nixl.handshake import Handshakes
from kvxfer.nixl.peers import LayoutCheck, Peer, Peers
from kvxfer.staging import Staging, block_tags, free_in_all, stagings_of
from kvxfer.stats import Recorder, Trace
from kvxfer.wire import (
    ReadParams,
    Source,
    StreamParams,
    check_piece,
    is_generation,
    is_stream_id,
    message_field,
)

__all__ = ["DecodeTransport", "LegState"]

logger = logging.getLogger(__name__)


class LegState(enum.Enum):
    """Where one P agent's part of a read stands."""

    XFER = "xfer"  # READ posted (or being posted)
    READ = "read"  # nothing (more) to read; `done` not yet sent
    ACK = "ack"  # `done` sent, waiting for P's ack
    OK = "ok"  # P acked: its part is delivered


@dataclass
class _Leg:
    """One P agent's part of a read: what D reads from it, and where its `done` stands."""

    peer: str
    handle: Any = None
    posting: Future | None = None  # the poster thread's `_post`, until `_advance` takes its handle
    state: LegState = LegState.XFER
    posted: tuple[float, float, int, int] | None = None  # the poster's (start, end, descs, bytes)


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
    params: ReadParams | None = None
    plan: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # units per P agent
    waiting: bool = True  # for its peers: nothing posted yet
    d_slots: list[list[int]] = field(default_factory=list)  # per group, D's slots of `params.keys`
    trace: Trace | None = None
    mark: float = 0.0  # when the stage under way began (posted, done sent)
    stream: StreamParams | None = None  # streamed: P names its blocks chunk by chunk
    skip: list[int] = field(default_factory=list)  # streamed: per group, keys below are D's own
    prompt: str | None = None  # streamed: the prompt digest P's must equal, if known
    secret: str = ""  # streamed: the request's, from its first chunk
    chunks: list[ReadParams] = field(default_factory=list)  # streamed: named, not yet posted
    last: bool = False  # streamed: P named its last chunk
    landed: bool = False  # its posted READs are done, their blocks not yet checked


class DecodeTransport:
    """D side: handshakes with P peers, reads requests into staging, reports outcomes.

    **Arguments:**

    - `config`: `TransportConfig`.
    - `staging`: where reads land, one per KV cache group (a single `Staging`
      is one group); each must match P's block bytes and layer count.
    - `layout`: this side's JSON-able cache layout, checked against each peer's.
    - `layout_check`: `(local, remote) -> None`, raising `LayoutMismatchError`
      where a peer's blocks cannot land in D's (`kvxfer.layout.check_block_compatible`).
    - `piece`: `(lo, hi, units)` for one process of a multi-host D, whose
      staging holds units `[lo, hi)` of each block (`kvxfer.pieces`); None
      for whole blocks.
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
                           self.piece, on_ack=self._on_ack, on_chunk=self._on_chunk)
        self.recorder = recorder or Recorder()
        self.handshakes = Handshakes(self.peers, self.recorder)
        self._reads: dict[str, _Read] = {}
        self._expected: dict[str, tuple[list[str], str, int]] = {}  # req -> (peers, instance, gen)
        self._cancelled: list[tuple[str, list[str], str, int]] = []  # the same, to say done for
        self._zombies = _Zombies(self.stagings)
        # READs are posted on a thread of their own: over UCX `cma` the post itself
        # copies the bytes (NIXL releases the GIL meanwhile), which would hold the
        # engine's thread for the whole read.
        self._poster = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-post-{config.name}")
        self._done: list[str] = []
        self._failed: dict[str, list[int]] = {}
        self._arrived: dict[str, list[list[int]]] = {}  # req -> per group, keys read and checked

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
        """Keep P's lease on a request alive (heartbeats; connecting to P in the background)
        until `start_read` takes it or `cancel` drops it."""
        p = _check_params(params, len(self.stagings))
        self._expected[p.req_id] = (p.peers, p.instance, p.generation)
        for peer in p.peers:
            self.handshakes.begin(peer, p.host, p.port, p.instance)

    def cancel(self, req_id: str) -> None:
        """Stop keeping P's lease on an expected request D will not read (aborted, refused): P
        may free it (a `done`, sent by the next `poll`). `req_id` is P's; unknown ids are ignored."""
        if not isinstance(req_id, str):
            raise InvalidInputError(f"cancel takes P's request id (a str), got {req_id!r:.80}")
        entry = self._expected.pop(req_id, None)
        if entry is not None:
            self._cancelled.append((req_id, *entry))

    def start_read(self, req_id: str, params: ReadParams, logical_ids: Sequence[int],
                   trace: Trace | None = None) -> None:
        """Post the READ of `req_id`'s blocks from P into D's staging, under P's keys.

        `logical_ids` are the engine's (D's) block ids the request's blocks
        land in: what is reported if the read fails. Raises
        `InvalidInputError` for malformed params or a request already being
        read, before any state changes; never raises for a peer problem: the
        request is then reported failed by `poll`. Never waits for a peer: a
        P agent not yet connected is connected to in the background (`poll`
        moves the handshake on) and the read is posted once it is. `trace` gets
        its stages (`connect`, `read`, `ack`) and, if it fails, its outcome.
        """
        if req_id in self._reads or req_id in self._zombies:
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
        read = _Read(req_id, p.req_id, p.instance, p.generation, list(logical_ids),
                     time.monotonic() + self.config.transfer_timeout_s, params=p,
                     trace=trace or Trace(req_id, "D", p.req_id, p.peer, self.config.name))
        self._reads[req_id] = read
        try:
            past = [peer for peer in p.peers if self.peers.is_past(peer, p.instance)]
            if past:
                raise TransferError(f"params of {req_id!r} are from P instance {p.instance} of "
                                    f"{past}, which is not the live one (P restarted)")
            read.plan = _units_to_read(p, self.piece, self.reader[0])
            read.legs = {peer: _Leg(peer, state=LegState.XFER if read.plan[peer] else
                                    LegState.READ) for peer in p.peers}
        except Exception as e:  # any failure here is this request's, not the engine's
            self._fail(read, e, "refused")
            return
        self._try_post(read)

    def start_stream(self, req_id: str, params: StreamParams, logical_ids: Sequence[int],
                     skip: Sequence[int] | None = None, prompt: str | None = None,
                     trace: Trace | None = None) -> None:
        """Read `req_id` while P still prefills it: subscribe to its stream, read each chunk
        P names final as it is named (`arrived` reports them), and finish after the last.

        `skip`: per group, the kernel positions below which D holds the blocks itself
        (not read); `prompt`: D's prompt digest, which P's must equal. Failures are as
        for `start_read`'s, in `logical_ids`; P giving up on the request fails it too.
        """
        if req_id in self._reads or req_id in self._zombies:
            raise InvalidInputError(f"request {req_id!r} is already being read")
        if any(req_id in s for s in self.stagings):
            raise InvalidInputError(
                f"request {req_id!r} still holds D staging from an earlier read; free it first")
        if not isinstance(params, StreamParams):
            raise InvalidInputError(f"params must be StreamParams, got {type(params).__name__}")
        if any(r.stream is not None and r.stream.stream == params.stream
               for r in self._reads.values()):
            raise InvalidInputError(f"stream {params.stream} is already being read")
        skip = [0] * len(self.stagings) if skip is None else list(skip)
        if len(skip) != len(self.stagings) or not all(is_int(k) and k >= 0 for k in skip):
            raise InvalidInputError(f"skip must be {len(self.stagings)} non-negative ints, got "
                                    f"{skip!r:.80}")
        read = _Read(req_id, "", "", 0, list(logical_ids),
                     time.monotonic() + self.config.transfer_timeout_s,
                     legs={params.peer: _Leg(params.peer, state=LegState.READ)},
                     stream=params, skip=skip, prompt=prompt,
                     trace=trace or Trace(req_id, "D", "", params.peer, self.config.name))
        self._reads[req_id] = read
        if self.piece is not None:
            self._fail(read, TransferError("streams are read by a D of one process"), "refused")
            return
        self._try_subscribe(read)

    def _try_subscribe(self, read: _Read) -> None:
        """Once P's agent is connected, subscribe to the read's stream. Never waits."""
        s = read.stream
        self.handshakes.begin(s.peer, s.host, s.port)
        state = self.handshakes.status(s.peer)
        if state is None:
            return
        if state is not True:
            self._fail(read, state)
            return
        try:
            send(self.agent, s.peer, "want", stream=s.stream)
        except TransferError as e:
            self._fail(read, reason="peer_gone")
            self._drop_peer(s.peer, str(e))
            return
        read.waiting = False
        read.instance = self.peers.get(s.peer).instance
        read.mark = read.trace.stage("connect", read.started)

    def _on_chunk(self, sender: str, msg: dict[str, Any]) -> None:
        """P names blocks of a stream final (or gives the stream up): queue them to read."""
        stream = message_field(msg, "stream", is_stream_id, "32 hex digits", sender)
        read = next((r for r in self._reads.values() if r.stream is not None
                     and r.stream.stream == stream and r.stream.peer == sender), None)
        if read is None or read.waiting:
            return
        if msg.get("aborted") is True:
            self._fail(read, TransferError(f"P gave up on stream {stream}"), "refused")
            return
        n = len(self.stagings)

        def groups(v: object) -> bool:
            return (isinstance(v, list) and len(v) == n and all(
                isinstance(g, list) and all(is_int(x) and x >= 0 for x in g) for g in v))

        keys = message_field(msg, "keys", groups, f"{n} lists of keys", sender)
        slots = message_field(msg, "slots", groups, f"{n} lists of slots", sender)
        fields = {key: message_field(msg, key, check, what, sender) for key, check, what in (
            ("req_id", lambda v: isinstance(v, str) and bool(v), "a non-empty str"),
            ("instance", lambda v: isinstance(v, str) and bool(v), "a non-empty str"),
            ("secret", lambda v: is_stream_id(v), "32 hex digits"),
            ("prompt", lambda v: v is None or is_stream_id(v), "absent or 32 hex digits"),
            ("last", lambda v: isinstance(v, bool), "a bool"))}
        last = fields["last"]
        generation = message_field(msg, "generation", lambda v: v is None or is_generation(v),
                                   "a positive int or None", sender)
        if any(len(k) != len(s) for k, s in zip(keys, slots)) or (last and generation is None):
            raise TransferError(f"chunk of stream {stream} from {sender!r} is malformed")
        if read.last:
            raise TransferError(f"chunk of stream {stream} from {sender!r} after its last")
        why = None
        if not read.p_req_id:  # the first chunk: what the request is
            if fields["instance"] != read.instance:
                why = f"P instance {fields['instance']} is not the one D connected to"
            elif read.prompt is not None and fields["prompt"] != read.prompt:
                why = "D's prompt differs from the one P computed"
            read.p_req_id, read.secret = fields["req_id"], fields["secret"]
            read.trace.p_req_id = read.p_req_id
        elif (fields["req_id"], fields["instance"], fields["secret"]) != (
                read.p_req_id, read.instance, read.secret):
            why = "a chunk names another request"
        if why is not None:
            self._fail(read, TransferError(f"stream {stream} of {read.req_id!r}: {why}"),
                       "refused")
            return
        kept = [[(k, s) for k, s in zip(gk, gs) if k >= skip]
                for gk, gs, skip in zip(keys, slots, read.skip)]
        read.chunks.append(ReadParams(
            sender, read.instance, read.stream.host, read.stream.port, read.p_req_id,
            generation or 1, tuple(tuple(k for k, _ in g) for g in kept),
            tuple(tuple(s for _, s in g) for g in kept), read.secret, fields["prompt"]))
        if last:
            read.last, read.generation = True, generation
        read.deadline = time.monotonic() + self.config.transfer_timeout_s  # P is alive

    def _next_chunk(self, read: _Read) -> bool:
        """Post the stream's chunks named since its last READ, as one READ; whether one
        was posted."""
        chunks, read.chunks = read.chunks, []
        keys = tuple(tuple(k for c in chunks for k in c.keys[g]) for g in range(len(self.stagings)))
        if not any(keys):
            return False
        p = replace(chunks[0], keys=keys,
                    slots=tuple(tuple(s for c in chunks for s in c.slots[g])
                                for g in range(len(self.stagings))))
        if any(set(k) & set(s.blocks(read.req_id) if read.req_id in s else ())
               for k, s in zip(keys, self.stagings)):
            raise TransferError(f"stream of {read.req_id!r} names a block twice")
        self.peers.check_source(p, Source(p.peer, 0, 1))
        read.params = p
        read.d_slots = [s.assign(read.req_id, k) for s, k in zip(self.stagings, keys)]
        leg = read.legs[p.peer]
        leg.state, leg.posted = LegState.XFER, None
        descriptors = functools.partial(_descriptors, self.peers.get(p.peer), self.stagings,
                                        self.piece, p.slots, read.d_slots, (0, 1), True)
        leg.posting = self._poster.submit(_post, self.agent, leg, descriptors, read.req_id,
                                          self.config.name)
        return True

    def _try_post(self, read: _Read) -> None:
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
            for source in p.sources or [Source(p.peer, 0, 1)]:
                self.peers.check_source(p, source)
            read.d_slots = [s.assign(read.req_id, keys) for s, keys in zip(self.stagings, p.keys)]
        except Exception as e:
            self._fail(read, e, "refused")
            return
        read.waiting = False
        read.mark = read.trace.stage("connect", read.started)
        for peer, span in read.plan.items():
            if span is not None:  # the leg reading this process's first units reads the tags
                descriptors = functools.partial(_descriptors, self.peers.get(peer), self.stagings,
                                                self.piece, p.slots, read.d_slots, span,
                                                span[0] == (self.piece or (0,))[0])
                read.legs[peer].posting = self._poster.submit(
                    _post, self.agent, read.legs[peer], descriptors, read.req_id,
                    self.config.name)

    def poll(self, now: float | None = None) -> tuple[list[str], dict[str, list[int]]]:
        """Advance reads; returns `(finished, failed)` since the last call.

        `finished`: request ids whose blocks are in staging and confirmed by P
        (the caller copies them out, then frees them in every staging).
        `failed`: request id -> the logical ids given to `start_read`; their
        slots are freed here.
        """
        now = time.monotonic() if now is None else now
        if not _posting(self._reads.values()):
            self.handshakes.advance(now)
            for read in list(self._reads.values()):
                if read.req_id not in self._reads:  # failed with a peer meanwhile
                    continue
                if read.waiting:
                    (self._try_subscribe if read.stream else self._try_post)(read)
                else:
                    self._advance(read)
                if now > read.deadline and read.req_id in self._reads:
                    logger.warning("D %s read of %s timed out in states %s", self.config.name,
                                   read.req_id, {p: leg.state.value for p, leg in read.legs.items()})
                    self._fail(read, reason="deadline")
            self.recorder.gauge("d_requests_waiting", len(self._reads) + len(self._expected))
            self._heartbeat(now)
            self._zombies.reap()
            self._publication.tick()
        done, self._done = self._done, []
        failed, self._failed = self._failed, {}
        return done, failed

    def _advance(self, read: _Read) -> None:
        """Check `read`'s posted READs; once all are done, say done to every P agent."""
        for leg in read.legs.values():
            if leg.state is not LegState.XFER:
                continue
            if leg.posting is not None:
                if not leg.posting.done():
                    continue
                posting, leg.posting = leg.posting, None
                try:
                    leg.handle = posting.result()
                except Exception as e:
                    self._fail(read, reason="peer_gone")
                    self._drop_peer(leg.peer, f"posting the READ of {read.req_id} failed: {e}")
                    return
            try:
                state = self.agent.check_xfer_state(leg.handle)
            except Exception as e:
                logger.warning("D %s xfer state of %s: %s", self.config.name, read.req_id, e)
                state = "ERR"
            if state == "DONE":
                _release(leg.handle)
                leg.handle, leg.state, read.landed = None, LegState.READ, True
            elif state == "ERR":
                self._fail(read, reason="peer_gone")
                self._drop_peer(leg.peer, f"READ of {read.req_id} failed")
                return
        if any(leg.state is LegState.XFER for leg in read.legs.values()):
            return
        if read.landed or (read.params is not None and not read.stream
                           and read.trace.stages[-1][0] == "connect"):  # nothing to read here
            read.landed = False
            _trace_read(read, self.recorder)
            if not _tags_match(self.stagings, read):
                logger.warning("D %s refuses %s: its slots at P do not hold its blocks (params "
                               "altered, or not its own)", self.config.name, read.req_id)
                self._fail(read, reason="binding")
                return
            arrived = self._arrived.setdefault(read.req_id, [[] for _ in self.stagings])
            for into, keys in zip(arrived, read.params.keys):
                into += keys
        if read.stream is not None:
            try:
                if self._next_chunk(read) or not read.last:
                    return
            except Exception as e:
                self._fail(read, e, "refused")
                return
        for leg in read.legs.values():
            if leg.state is LegState.READ:
                try:
                    self.peers.send_done(leg.peer, read.p_req_id, read.instance,
                                         read.generation, self.reader)
                    leg.state = LegState.ACK
                except TransferError as e:
                    self._fail(read, reason="peer_gone")
                    self._drop_peer(leg.peer, str(e))
                    return

    def _on_ack(self, sender: str, msg: dict[str, Any]) -> None:
        req_id = message_field(msg, "req_id", lambda v: isinstance(v, str), "a str", sender)
        generation = message_field(msg, "generation", is_generation, "a positive int", sender)
        ok = message_field(msg, "ok", lambda v: isinstance(v, bool), "a bool", sender)
        read = next((r for r in self._reads.values() if r.p_req_id == req_id
                     and sender in r.legs and r.generation == generation), None)
        if read is None or read.legs[sender].state is not LegState.ACK:
            return
        if not ok:
            logger.warning("D %s: P %s no longer held %s (lease expired or P restarted)",
                           self.config.name, sender, read.req_id)
            self._fail(read, reason="lease_expired")
            return
        read.legs[sender].state = LegState.OK
        if all(leg.state is LegState.OK for leg in read.legs.values()):
            read.trace.stage("ack", read.mark)
            del self._reads[read.req_id]
            self._done.append(read.req_id)
            logger.debug("D %s read %s in %.4fs", self.config.name, read.req_id,
                         time.monotonic() - read.started)

    def _heartbeat(self, now: float) -> None:
        """Extend P's leases of the requests D still wants (reading or expected), and say
        done for those cancelled."""
        cancelled, self._cancelled = self._cancelled, []
        for say in (lambda: self.peers.heartbeat(_wanted(self._reads, self._expected), now),
                    lambda: self.peers.say_done(cancelled, self.reader)):  # after those drops
            for peer, error in say().items():
                self._drop_peer(peer, error)

    def _fail(self, read: _Read, why: Exception | None = None, reason: str = "peer_gone") -> None:
        if self._reads.pop(read.req_id, None) is None:
            return
        if isinstance(why, LayoutMismatchError):
            reason = "refused"  # P's caches cannot land in D's
        read.trace.outcome = read.trace.outcome or reason
        if why is not None:
            logger.warning("D %s cannot read %s from %s: %s", self.config.name, read.req_id,
                           read.params.peers if read.params else read.stream.peer, why)
        self._failed[read.req_id] = list(read.logical_ids)
        self._arrived.pop(read.req_id, None)
        if read.stream is not None and not read.waiting and read.stream.peer in self.peers:
            try:  # P frees a stream it gave up on once D let go of it
                send(self.agent, read.stream.peer, "drop", stream=read.stream.stream)
            except TransferError as e:
                logger.warning("D %s: %s", self.config.name, e)
        _settle_posts(read, self.config.name)
        self._zombies.bury(read.req_id, [leg.handle for leg in read.legs.values()])

    def arrived(self) -> dict[str, list[list[int]]]:
        """Per request, per group, the keys whose blocks landed in staging and checked since
        the last call (the request is not finished until `poll` says so; until then, or a
        failure, its slots stay as they are)."""
        arrived, self._arrived = self._arrived, {}
        return arrived

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
        self._publication.close()
        close_agent(self.agent, self._reg, f"D {self.config.name}", self.config.uses_etcd)
        self.agent = None
        release_name(self.config.name)


class _Zombies:
    """Failed reads whose transfers NIXL has not released: a READ could still land, so their
    D slots are freed only once NIXL releases every one."""

    def __init__(self, stagings: Sequence[Staging]):
        self.stagings = stagings
        self._held: list[tuple[str, Any]] = []  # (request, NIXL transfer handle)

    def __contains__(self, req_id: object) -> bool:
        return any(r == req_id for r, _ in self._held)

    def bury(self, req_id: str, handles: Sequence[Any]) -> None:
        """Release a failed read's transfers; its slots are freed once all are released."""
        held = [h for h in handles if h is not None and not _release(h)]
        if held:
            self._held += [(req_id, h) for h in held]
        else:
            free_in_all(self.stagings, req_id)

    def reap(self) -> None:
        still = [(req_id, h) for req_id, h in self._held if not _release(h)]
        for req_id in {r for r, _ in self._held} - {r for r, _ in still}:
            free_in_all(self.stagings, req_id)
        self._held = still


def _wanted(reads: Mapping[str, _Read], expected: Mapping[str, tuple[list[str], str, int]]
            ) -> dict[str, list[list[Any]]]:
    """Per P agent, the `[P's request id, generation]` of each request D reads from it or
    expects."""
    wanted: dict[str, list[list[Any]]] = {}
    for peers, req_id, generation in [*((r.legs, r.p_req_id, r.generation)
                                        for r in reads.values()),
                                      *((e[0], r, e[2]) for r, e in expected.items())]:
        if not generation:  # a stream before its last chunk: P holds it without a lease
            continue
        for peer in peers:
            wanted.setdefault(peer, []).append([req_id, generation])
    return wanted


def _posting(reads: Iterable[_Read]) -> bool:
    """Whether the poster thread is inside NIXL. Over UCX `cma` a post copies the bytes
    while holding the agent, so any NIXL call from the engine's thread would wait for the
    whole copy: `poll` leaves the agent alone until it is done (notifications wait in UCX;
    deadlines are checked at the next poll)."""
    return any(leg.posting is not None and not leg.posting.done()
               for read in reads for leg in read.legs.values())


def _trace_read(read: _Read, recorder: Recorder) -> None:
    """Every leg's READ is done: the `read` stage, from the first post to now, with what the
    posts moved (the poster wrote `posted` into each leg before its future was done); a
    stream's reads add up in one."""
    posted = [leg.posted for leg in read.legs.values() if leg.posted is not None]
    read.trace.extend("read", min((t0 for t0, _, _, _ in posted), default=read.mark))
    for t0, t1, descriptors, nbytes in posted:
        recorder.observe("d_post_s", t1 - t0)
        read.trace.descriptors += descriptors
        read.trace.wire_bytes += nbytes
    read.mark = time.monotonic()


def _settle_posts(read: _Read, who: str) -> None:
    """Cancel a failed read's posts not started and wait for those under way, so every leg's
    transfer handle is known."""
    pending = [leg.posting for leg in read.legs.values()
               if leg.posting is not None and not leg.posting.cancel()]
    futures.wait(pending)
    for leg in read.legs.values():
        posting, leg.posting = leg.posting, None
        if posting is None or posting.cancelled():
            continue
        if posting.exception() is not None:
            logger.warning("D %s: posting the READ of %s from %s failed: %s", who, read.req_id,
                           leg.peer, posting.exception())
        else:
            leg.handle = posting.result()


def _post(agent: Any, leg: _Leg, descriptors: Callable[[], tuple[np.ndarray, np.ndarray]],
          req_id: str, who: str) -> Any:
    """Post one READ from `leg.peer` of `descriptors()` (on D's poster thread); returns its
    transfer handle. Writes only `leg.posted`, which the engine's thread reads once done."""
    start, peer = time.monotonic(), leg.peer
    local, remote = descriptors()
    handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                   agent.get_xfer_descs(remote, "DRAM"), peer)
    try:
        state = agent.transfer(handle)
    except Exception as e:  # part of it may be posted: `_advance` finds it in error
        logger.warning("D %s: NIXL raised posting the READ of %s from %s: %s", who, req_id,
                       peer, e)
        return handle
    if state == "ERR":
        _release(handle)
        raise TransferError(f"NIXL refused the READ of {req_id!r} from {peer!r}")
    leg.posted = (start, time.monotonic(), len(local), int(local[:, 1].sum()))
    logger.debug("D %s posted READ of %s from %s (%s descriptors)", who, req_id, peer,
                 len(local))
    return handle


def _tags_match(stagings: Sequence[Staging], read: _Read) -> bool:
    """Whether every slot read holds the block its params name: the tags P wrote with the
    request's secret at each block's position (`kvxfer.staging.block_tags`)."""
    p = read.params
    return all(not keys or np.array_equal(staging.tags[slots], block_tags(p.secret, g, keys))
               for g, (staging, keys, slots) in enumerate(zip(stagings, p.keys, read.d_slots)))


def _release(handle: Any) -> bool:
    """Release a NIXL transfer; whether NIXL let it go (a READ in flight may not)."""
    try:
        handle.release()
        return True
    except Exception:
        return False


def _check_params(params: object, num_groups: int) -> ReadParams:
    if not isinstance(params, ReadParams):
        raise InvalidInputError(f"params must be ReadParams (ReadParams.parse of P's dict), got "
                                f"{type(params).__name__}")
    if len(params.keys) != num_groups:
        raise InvalidInputError(f"params name {len(params.keys)} KV cache groups, this D stages "
                                f"{num_groups}")
    return params


def _descriptors(peer: Peer, stagings: Sequence[Staging], piece: tuple[int, int, int] | None,
                 p_slots: Sequence[Sequence[int]], d_slots: Sequence[Sequence[int]],
                 span: tuple[int, int], tags: bool) -> tuple[np.ndarray, np.ndarray]:
    """`(local, remote)` NIXL descriptors `[n, 3]` (address, length, device) of one READ.

    Units `span` of every slot of every group: the blocks, then the fingerprint
    rows of the same slots, and with `tags` the slots' whole tags; one
    descriptor per run of slots contiguous on both sides where a slot is read
    whole, else one per slot.
    """
    theirs_piece, ours_piece = peer.piece or (0, 1, 1), piece or (0, 1, 1)
    local, remote = [], []
    for theirs, ours, ps, ds in zip(peer.groups, stagings, p_slots, d_slots, strict=True):
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
        if tags:
            row = ours.tags.strides[0]
            runs = np.asarray(coalesce_pairs(ps, ds), dtype=np.uint64).reshape(-1, 3)
            remote.append(np.stack([theirs.tags[0] + runs[:, 0] * row, runs[:, 2] * row,
                                    0 * runs[:, 2]], 1))
            local.append(np.stack([ours.tags_address()[0] + runs[:, 1] * row, runs[:, 2] * row,
                                   0 * runs[:, 2]], 1))
    return np.concatenate(local), np.concatenate(remote)


def _units_to_read(p: ReadParams, piece: tuple[int, int, int] | None,
               rank: int) -> dict[str, tuple[int, int] | None]:
    """Per P agent of the request, the units this D process reads from it (None: none).

    One P process: the whole block, `(0, 1)`. Several: from each distinct unit
    range that overlaps this process's piece, the overlap, read from one of the
    sources holding that range (replicas: the one this reader's rank picks).
    """
    if not p.sources:
        if piece is not None:
            raise TransferError(f"params of {p.req_id!r} are from a P of whole blocks, "
                                f"this D process holds units {piece}")
        return {p.peer: (0, 1)}
    if piece is None or p.units != piece[2]:
        raise TransferError(f"params of {p.req_id!r} name {p.units} units per block, this D "
                            f"process holds {piece or 'whole blocks'}")
    plan: dict[str, tuple[int, int] | None] = {s.peer: None for s in p.sources}
    lo, hi = piece[:2]
    for span in sorted({(s.lo, s.hi) for s in p.sources}):
        a, b = max(span[0], lo), min(span[1], hi)
        if a < b:
            holders = [s.peer for s in p.sources if (s.lo, s.hi) == span]
            plan[holders[rank % len(holders)]] = (a, b)
    return plan
