"""Streams: D reads a request's blocks as P names them final, while P still prefills it.

A router gives P and D one stream id per request (`kvxfer.nixl.wire.new_stream_id`).
D subscribes with it (`want`) once connected to P; P names to it each block
no later chunk copies again (`chunk`: keys, slots, the request's secret and
instance, and with the last chunk the generation D's `done` names); D reads
the chunks named since its last READ in one READ, checks their tags, and
reports them as they arrive. P holds a streamed request from its first
staged block; its lease runs from its last chunk, as any other's. If P gives
up on it (aborted, preempted), it tells D (`chunk` with `aborted`) and frees
it once D let go (`drop`) or a lease later.

P answers each `want` at once and, until its last chunk, says so again about once a
second (`wait`), whether the request still waits in P's queue or is being prefilled:
D's deadline follows P's word, not a guess of P's queue. A D that gives up on a stream
(its deadline, or its engine dropped the request) says `drop`; P then frees what it
staged for it and stages no more of it (the scheduler side stops planning its saves).

- `Published`: P's side (in `kvxfer.nixl.prefill.PrefillTransport`).
- `StreamReads`: D's side, a part of `kvxfer.nixl.decode.DecodeTransport`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvxfer.errors import InvalidInputError, TransferError
from kvxfer.nixl.agent import send
from kvxfer.nixl.reads import Leg, LegState, Read, read_descriptors
from kvxfer.nixl.wire import (
    ReadParams,
    StreamParams,
    done_token,
    is_generation,
    is_stream_id,
    is_wire_index,
    message_field,
    parse_entries,
)
from kvxfer.plan.blocks import is_int
from kvxfer.stats import Trace

if TYPE_CHECKING:
    from kvxfer.device.staging import Staging
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.handshake import Handshakes
    from kvxfer.nixl.peers import Peers

__all__ = ["Published", "StreamReads"]

logger = logging.getLogger(__name__)


# -- P ---------------------------------------------------------------------------------


@dataclass
class _Stream:
    """A streamed request on P: what was named final so far, and who reads it."""

    req_id: str
    secret: str
    prompt: str | None
    keys: list[list[int]]  # per group, named so far
    slots: list[list[int]]
    entries: list[dict[int, str]]  # per group, the keys tagged from a pool entry's secret
    last: bool = False
    reader: str | None = None  # the D agent that subscribed
    cancelled: bool = False


class Published:
    """P's streams: who subscribed to which, and what each was told.

    Arguments:
        agent: P's NIXL agent; `name`, `instance`: P's agent name and instance.
        num_groups: KV cache groups; `max_wants`: subscriptions kept for streams P
            does not know yet (a D may subscribe before P's scheduler added the request);
            one D agent may hold a quarter of them (at least 16), so one peer sending
            made-up subscriptions cannot starve the others. A subscription over either
            bound is refused at once (D fails that request by name), never dropped.
        wait_s: how long such a subscription waits before P refuses it.
        every_s: how often P tells each subscribed D that a stream it has not finished
            is still coming (`wait`).
    """

    def __init__(self, agent: Any, name: str, instance: str, num_groups: int, max_wants: int,
                 wait_s: float, every_s: float = 1.0):
        self.agent, self.name, self.instance = agent, name, instance
        self.num_groups, self.max_wants, self.wait_s = num_groups, max_wants, wait_s
        self.every_s, self._next_word = every_s, 0.0
        self._streams: dict[str, _Stream] = {}  # stream id -> the request streamed
        self._stream_of: dict[str, str] = {}  # request id -> its stream id
        self._wants: dict[str, tuple[str, float]] = {}  # stream not yet known -> (D, until)
        self._wants_of: dict[str, int] = {}  # D -> how many of `_wants` are its
        self.max_wants_per_peer = max(16, max_wants // 4)
        self._warned: set[str] = set()  # Ds told about once that they are over a bound
        self._gone: dict[str, None] = {}  # the last streams freed or given up, oldest first

    def publish(self, req_id: str, stream: str, secret: str, prompt: str | None,
                keys: Sequence[Sequence[int]], slots: Sequence[Sequence[int]], last: bool,
                generation: int | None, entries: Sequence[Mapping[int, str]] = ()
                ) -> bool | None:
        """Name blocks of `req_id` final (see `PrefillTransport.publish`); whether this is
        the stream's first call (P holds the request for D from now); None for a stream
        its D gave up on, or one freed already: nobody will read it, so hold nothing."""
        if not is_stream_id(stream):
            raise InvalidInputError(f"request {req_id!r}: stream must be 32 hex digits, got "
                                    f"{stream!r:.80}")
        if len(keys) != self.num_groups or len(slots) != self.num_groups or any(
                len(k) != len(s) for k, s in zip(keys, slots)):
            raise InvalidInputError(f"request {req_id!r}: equal-length keys and slots of "
                                    f"{self.num_groups} groups expected")
        if entries and not (isinstance(entries, Sequence) and len(entries) == self.num_groups
                            and all(isinstance(e, Mapping) and set(e) <= set(k)
                                    for e, k in zip(entries, keys))):
            raise InvalidInputError(f"request {req_id!r}: entries must map keys named in each "
                                    f"of {self.num_groups} groups to secrets, got {entries!r:.80}")
        st, first = self._streams.get(stream), False
        if st is None and stream in self._gone:
            return None
        if st is None:
            if req_id in self._stream_of:
                raise InvalidInputError(f"request {req_id!r} is already streamed")
            st = self._streams[stream] = _Stream(req_id, secret, prompt,
                                                 [[] for _ in range(self.num_groups)],
                                                 [[] for _ in range(self.num_groups)],
                                                 [{} for _ in range(self.num_groups)])
            self._stream_of[req_id], first = stream, True
            want = self._pop_want(stream)
            if want is not None:
                st.reader = want[0]
        elif st.req_id != req_id or st.last or st.cancelled:
            state = "done" if st.last else "cancelled" if st.cancelled else "another request's"
            raise InvalidInputError(f"request {req_id!r}: stream {stream} is {state}")
        for g in range(self.num_groups):
            st.keys[g] += list(keys[g])
            st.slots[g] += list(slots[g])
            if entries:
                st.entries[g].update(entries[g])
        st.last = bool(last)
        if st.reader is not None:
            self._tell(st, keys, slots, generation)
        return first

    def _tell(self, st: _Stream, keys: Sequence[Sequence[int]], slots: Sequence[Sequence[int]],
              generation: int | None) -> None:
        """Send the subscribed D blocks now final (and, with the last, the generation)."""
        shared = [[[int(k), e[k]] for k in ks if k in e] for ks, e in zip(keys, st.entries)]
        try:
            send(self.agent, st.reader, "chunk", stream=self._stream_of[st.req_id],
                 req_id=st.req_id, instance=self.instance, secret=st.secret, prompt=st.prompt,
                 keys=[list(map(int, k)) for k in keys], slots=[list(map(int, s)) for s in slots],
                 last=st.last, generation=generation if st.last else None,
                 **({"entries": shared} if any(shared) else {}))
        except TransferError as e:
            logger.warning("P %s: stream of %s loses its reader: %s", self.name, st.req_id, e)
            st.reader = None

    def cancel(self, req_id: str) -> bool | None:
        """P gave up on `req_id`: its D is told. Whether it may be freed now (no D
        subscribed, or D cannot be told); None for a request not streamed."""
        stream = self._stream_of.get(req_id)
        if stream is None:
            return None
        st = self._streams[stream]
        st.cancelled = True
        if st.reader is None:
            return True
        try:
            send(self.agent, st.reader, "chunk", stream=stream, req_id=req_id,
                 instance=self.instance, aborted=True)
        except TransferError as e:
            logger.warning("P %s: %s", self.name, e)
            return True
        return False

    def on_want(self, sender: str, msg: dict[str, Any], now: float,
                generation: Callable[[str], int | None]) -> None:
        """D subscribes: tell it everything named so far (`generation(req_id)`: the one its
        last chunk names), or wait a while for a stream P does not know yet."""
        stream = message_field(msg, "stream", is_stream_id, "32 hex digits", sender)
        st = self._streams.get(stream)
        if st is None:
            if stream in self._gone:  # freed already (its lease lapsed while D queued it)
                self._refuse(sender, stream)
            elif stream in self._wants:
                if self._wants[stream][0] != sender:  # a stream has one reader
                    self._refuse(sender, stream)
            elif (len(self._wants) >= self.max_wants
                  or self._wants_of.get(sender, 0) >= self.max_wants_per_peer):
                if sender not in self._warned:  # once per D: a hostile one sends many
                    self._warned = {sender} | (self._warned if len(self._warned) < 1024 else set())
                    logger.warning("P %s refuses subscriptions of %s to streams it does not know: "
                                   "%d pending from it, %d in all (at most %d per D, %d in all)",
                                   self.name, sender, self._wants_of.get(sender, 0),
                                   len(self._wants), self.max_wants_per_peer, self.max_wants)
                self._refuse(sender, stream)
            else:
                self._wants[stream] = (sender, now + self.wait_s)
                self._wants_of[sender] = self._wants_of.get(sender, 0) + 1
                self._word(sender, stream)
        elif st.reader not in (None, sender) or st.cancelled:
            self._refuse(sender, stream)
        else:
            st.reader = sender
            if any(st.keys) or st.last:
                self._tell(st, st.keys, st.slots, generation(st.req_id))
            else:
                self._word(sender, stream)

    def keep_alive(self, now: float) -> None:
        """Every `every_s`, tell each D subscribed to a stream whose last chunk is still to
        come (waiting for P's scheduler, or being prefilled) that P has not forgotten it."""
        if now < self._next_word:
            return
        self._next_word = now + self.every_s
        for stream, (sender, _) in list(self._wants.items()):
            self._word(sender, stream)
        for st in list(self._streams.values()):
            if st.reader is not None and not (st.last or st.cancelled):
                self._word(st.reader, self._stream_of[st.req_id])

    def _word(self, reader: str, stream: str) -> None:
        try:
            send(self.agent, reader, "wait", stream=stream, instance=self.instance)
        except TransferError as e:  # its D is gone: its deadline or a lease ends the stream
            logger.debug("P %s: %s", self.name, e)

    def on_drop(self, sender: str, msg: dict[str, Any]) -> str | None:
        """D let go of a stream (P gave up on it, or D did): the request to free now, else
        None. A D that let go does not come back (a stream has one reader), so P frees its
        blocks at once and, for a stream P does not know yet, stages none of it later."""
        stream = message_field(msg, "stream", is_stream_id, "32 hex digits", sender)
        if self._wants.get(stream, (None,))[0] == sender:  # gave up before P had the request
            self._pop_want(stream)
            self._remember(stream)
        st = self._streams.get(stream)
        if st is None or st.reader != sender:
            return None
        st.reader = None
        return st.req_id

    def expire_wants(self, now: float) -> None:
        """Refuse subscriptions to streams that never came (a D asked for one P never had)."""
        for stream, (sender, until) in list(self._wants.items()):
            if until <= now:
                self._pop_want(stream)
                self._refuse(sender, stream)

    def _pop_want(self, stream: str) -> tuple[str, float] | None:
        want = self._wants.pop(stream, None)
        if want is not None:
            left = self._wants_of[want[0]] - 1
            if left:
                self._wants_of[want[0]] = left
            else:
                del self._wants_of[want[0]]
        return want

    def forget(self, req_id: str) -> None:
        """`req_id` is freed: a D that subscribes to its stream from now on is refused at
        once (the last `max_wants` streams freed are remembered), not after `wait_s`."""
        stream = self._stream_of.pop(req_id, None)
        if stream is not None:
            del self._streams[stream]
            self._remember(stream)

    def _remember(self, stream: str) -> None:
        self._gone[stream] = None
        if len(self._gone) > self.max_wants:
            del self._gone[next(iter(self._gone))]

    def _refuse(self, sender: str, stream: str) -> None:
        try:
            send(self.agent, sender, "chunk", stream=stream, req_id="", instance=self.instance,
                 aborted=True)
        except TransferError as e:
            logger.warning("P %s: %s", self.name, e)


# -- D ---------------------------------------------------------------------------------


class StreamReads:
    """D's streamed reads, a part of `DecodeTransport`: subscribing once P's agent is
    connected, the chunks P names final and the `wait`s between them, one READ of those
    named since the last, and letting P know when D gives a stream up.

    It shares the transport's reads (`reads`, by D's request id) and acts on them only
    through the transport's own steps, given here: `fail(read, why, reason)`,
    `drop_peer(peer, why)` and `post(leg, descriptors, req_id)` (a READ on D's poster
    thread); `piece` is what D's staging holds of each block, `(lo, hi, units)`: D reads
    those units from P's one agent, which holds every unit of its blocks. `readers`: the
    processes of D's instance; a stream has one reader, so a D across hosts refuses it.
    """

    def __init__(self, config: TransportConfig, agent: Any, stagings: Sequence[Staging],
                 peers: Peers, handshakes: Handshakes, piece: tuple[int, int, int],
                 reads: dict[str, Read], fail: Callable[..., None],
                 drop_peer: Callable[[str, str], None], post: Callable[..., Future],
                 readers: int = 1):
        self.config, self.agent, self.stagings, self.piece = config, agent, stagings, piece
        self.readers = readers
        self.peers, self.handshakes, self.reads = peers, handshakes, reads
        self.fail, self.drop_peer, self.post = fail, drop_peer, post

    def start(self, req_id: str, params: StreamParams, logical_ids: Sequence[int],
              skip: Sequence[int] | None = None, prompt: str | None = None,
              trace: Trace | None = None,
              hashes: Sequence[Sequence[str]] | None = None) -> None:
        """`DecodeTransport.start_stream`, once the request id and logical ids are checked."""
        if not isinstance(params, StreamParams):
            raise InvalidInputError(f"params must be StreamParams, got {type(params).__name__}")
        if any(r.stream is not None and r.stream.stream == params.stream
               for r in self.reads.values()):
            raise InvalidInputError(f"stream {params.stream} is already being read")
        skip = [0] * len(self.stagings) if skip is None else list(skip)
        if len(skip) != len(self.stagings) or not all(is_int(k) and k >= 0 for k in skip):
            raise InvalidInputError(f"skip must be {len(self.stagings)} non-negative ints, got "
                                    f"{skip!r:.80}")
        read = Read(req_id, "", "", 0, list(logical_ids),
                     time.monotonic() + self.config.transfer_timeout_s,
                     legs={params.peer: Leg(params.peer, state=LegState.READ)},
                     stream=params, skip=skip, prompt=prompt, hashes=hashes,
                     trace=trace or Trace(req_id, "D", "", params.peer, self.config.name))
        self.reads[req_id] = read
        if self.readers > 1:
            self.fail(read, TransferError(f"a stream has one reader, and this D spans "
                                           f"{self.readers} processes: D reads by params "
                                           f"instead"), "refused")
            return
        self.subscribe(read)

    def subscribe(self, read: Read) -> None:
        """Once P's agent is connected, subscribe to the read's stream. Never waits."""
        s = read.stream
        self.handshakes.begin(s.peer, s.host, s.port)
        state = self.handshakes.status(s.peer)
        if state is None:
            return
        if state is not True:
            self.fail(read, state)
            return
        try:
            send(self.agent, s.peer, "want", stream=s.stream)
        except TransferError as e:
            # A stream names no P instance: a P restarted under its name and address shows
            # only here, as a connection to its past start that is gone. Connect afresh
            # (once) and subscribe then; the drop fails the reads of that past start.
            if not read.reconnected:
                read.reconnected = True
                self.drop_peer(s.peer, f"{e} (restarted?); connecting afresh")
                return
            self.fail(read, reason="peer_gone")
            self.drop_peer(s.peer, str(e))
            return
        read.waiting = False
        read.wait_until = time.monotonic() + self.config.stream_wait_s
        read.instance = self.peers.get(s.peer).instance
        read.mark = read.trace.phase("connect", read.started)

    def on_chunk(self, sender: str, msg: dict[str, Any]) -> None:
        """P names blocks of a stream final (or gives the stream up): queue them to read. A
        `wait` (P still has the stream's last chunk to come) moves its deadline on, for at
        most `stream_wait_s` after subscribing or the last chunk."""
        stream = message_field(msg, "stream", is_stream_id, "32 hex digits", sender)
        read = next((r for r in self.reads.values() if r.stream is not None
                     and r.stream.stream == stream and r.stream.peer == sender), None)
        if read is None or read.waiting:
            return
        if msg["t"] == "wait":
            if msg.get("instance") == read.instance and not read.last:  # not a past P's word
                read.deadline = max(read.deadline, min(
                    time.monotonic() + self.config.transfer_timeout_s, read.wait_until))
            return
        if msg.get("aborted") is True:
            self.fail(read, TransferError(f"P gave up on stream {stream}"), "refused")
            return
        try:
            keys, slots, fields, generation = _chunk_fields(msg, len(self.stagings), sender, stream)
        except TransferError as e:  # from the peer the stream names: fail this request alone
            self.fail(read, e, "refused")
            return
        last = fields["last"]
        if read.last:
            raise TransferError(f"chunk of stream {stream} from {sender!r} after its last")
        why = None
        if not read.p_req_id:  # the first chunk: what the request is
            if fields["instance"] != read.instance:
                why = f"P instance {fields['instance']} is not the one D connected to"
            elif read.prompt is not None and fields["prompt"] != read.prompt:
                why = "D's prompt differs from the one P computed"
            read.p_req_id, read.secret = fields["req_id"], fields["secret"]
            read.token = done_token(read.secret)  # a stream D holds whole has no params
            read.trace.p_req_id = read.p_req_id
        elif (fields["req_id"], fields["instance"], fields["secret"]) != (
                read.p_req_id, read.instance, read.secret):
            why = "a chunk names another request"
        if why is not None:
            self.fail(read, TransferError(f"stream {stream} of {read.req_id!r}: {why}"),
                       "refused")
            return
        kept = [[(k, s) for k, s in zip(gk, gs) if k >= skip]
                for gk, gs, skip in zip(keys, slots, read.skip)]
        shared = tuple(tuple((k, e) for k, e in g if k >= skip)
                       for g, skip in zip(fields["entries"], read.skip))
        read.chunks.append(ReadParams(
            sender, read.instance, read.stream.host, read.stream.port, read.p_req_id,
            generation or 1, tuple(tuple(k for k, _ in g) for g in kept),
            tuple(tuple(s for _, s in g) for g in kept), read.secret, fields["prompt"],
            entries=shared if any(shared) else ()))
        if last:
            read.last, read.generation = True, generation
        now = time.monotonic()
        if last or any(keys):  # P's request progresses
            read.wait_until = now + self.config.stream_wait_s
        # A chunk naming nothing (a step that completed no block) is word from a live P, as
        # a `wait` is: it moves the deadline no further than `stream_wait_s` since progress.
        read.deadline = max(read.deadline, min(now + self.config.transfer_timeout_s,
                                               read.wait_until))

    def _next_chunk(self, read: Read) -> bool:
        """Post the stream's chunks named since its last READ as one READ; whether one was
        posted. Not in parts: measured on the 2-core machine, reading in parts of 4-64 MiB
        (to write one part while the next is read) made single requests 1.2-2.5x slower
        and `kvxfer bench e2e`'s stream about 25% slower (the read and the write contend
        for the same cores, and the poster waits for the engine's thread between parts)."""
        if not read.chunks:  # D's engine asks every step: nothing named since the last READ
            return False
        n = len(self.stagings)
        chunks, read.chunks = read.chunks, []
        keys = tuple(tuple(k for c in chunks for k in c.keys[g]) for g in range(n))
        if not any(keys):
            return False
        shared = tuple(tuple(e for c in chunks if c.entries for e in c.entries[g])
                       for g in range(n))
        p = replace(chunks[0], keys=keys, slots=tuple(tuple(s for c in chunks for s in c.slots[g])
                                                      for g in range(n)),
                    entries=shared if any(shared) else ())
        if any(set(k) & set(s.blocks(read.req_id) if read.req_id in s else ())
               for k, s in zip(p.keys, self.stagings)):
            raise TransferError(f"P names a block of {read.req_id!r} twice")
        p = p.from_one_agent(self.piece[2])
        self.peers.check_source(p, p.sources[0])
        read.params = p
        read.d_slots = [s.assign(read.req_id, k) for s, k in zip(self.stagings, p.keys)]
        leg = read.legs[p.peer]
        leg.state, leg.posted = LegState.XFER, None
        descriptors = functools.partial(read_descriptors, self.peers.get(p.peer), self.stagings,
                                        self.piece, p.slots, read.d_slots, self.piece[:2], True)
        leg.posting = self.post(leg, descriptors, read.req_id)
        return True

    def read_on(self, read: Read) -> bool:
        """Post the chunks named since the last READ; whether the read still waits for P
        (a READ posted, or its last chunk not yet named)."""
        try:
            return self._next_chunk(read) or not read.last
        except Exception as e:
            self.fail(read, e, "refused")
            return True

    def let_go(self, read: Read) -> None:
        """A failed stream: tell P, which frees a stream it gave up on once D let go of it."""
        if read.stream is not None and not read.waiting and read.stream.peer in self.peers:
            try:
                send(self.agent, read.stream.peer, "drop", stream=read.stream.stream)
            except TransferError as e:
                logger.warning("D %s: %s", self.config.name, e)


def _chunk_fields(msg: dict[str, Any], n: int, sender: str, stream: str
                  ) -> tuple[list[list[int]], list[list[int]], dict[str, Any], int | None]:
    """A `chunk`'s keys, slots, fields and generation, every one checked (`TransferError`
    naming the first bad one): ints off the wire are range-checked here, where parsed."""

    def groups(v: object) -> bool:
        return (isinstance(v, list) and len(v) == n and all(
            isinstance(g, list) and all(is_wire_index(x) for x in g) for g in v))

    keys = message_field(msg, "keys", groups, f"{n} lists of keys below 2**63", sender)
    slots = message_field(msg, "slots", groups, f"{n} lists of slots below 2**63", sender)
    fields = {key: message_field(msg, key, check, what, sender) for key, check, what in (
        ("req_id", lambda v: isinstance(v, str) and bool(v), "a non-empty str"),
        ("instance", lambda v: isinstance(v, str) and bool(v), "a non-empty str"),
        ("secret", lambda v: is_stream_id(v), "32 hex digits"),
        ("prompt", lambda v: v is None or is_stream_id(v), "absent or 32 hex digits"),
        ("last", lambda v: isinstance(v, bool), "a bool"))}
    generation = message_field(msg, "generation", lambda v: v is None or is_generation(v),
                               "a positive int or None", sender)
    if any(len(k) != len(s) for k, s in zip(keys, slots)) or (fields["last"]
                                                               and generation is None):
        raise TransferError(f"chunk of stream {stream} from {sender!r} is malformed")
    entries = msg.get("entries", [None] * n)  # absent: every key's tags from the secret
    if not (isinstance(entries, list) and len(entries) == n):
        raise TransferError(f"chunk of stream {stream} from {sender!r}: 'entries' must be "
                            f"{n} lists, got {entries!r:.80}")
    try:
        fields["entries"] = [parse_entries(e, k, g) for g, (e, k) in enumerate(zip(entries, keys))]
    except InvalidInputError as e:
        raise TransferError(f"chunk of stream {stream} from {sender!r}: {e}") from None
    return keys, slots, fields, generation
