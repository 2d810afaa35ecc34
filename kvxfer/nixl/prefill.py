"""P's transport: holds staged blocks for D's reads, and frees them on `done` or lease expiry.

Every P start draws a new `instance` id, named in its advertisement and in
every param set; D's `done` and `hb` name it back, so a restarted P never
answers for params of the one before. `lease` holds a request under a fresh
generation for `lease_s` (heartbeats extend it); P frees a request when
every D process said done, or when its lease expires, and only inside
`poll`. A lease once expired is never revived, so "held when the `done`
arrived" implies "held during the whole read": P acks `ok` only then.

Streams. A request given a stream id (`publish`) is held from its first
staged block: D subscribes with the id (`want`) and P names to it each
block once no later chunk copies it again (`chunk`: its keys and slots, the
request's secret and instance, and with the last chunk the generation D's
`done` names). Its lease runs from its last chunk, as any other's; before
that only P's own give-up (`cancel_stream`: P tells D and frees once D let
go, `drop`, or a lease later) or D's (`drop`: P frees at once and stages no more
of it) frees it. Until the last chunk, P tells its D about once a second that
the stream is still coming (`wait`), so D's deadline follows P's progress.

Answering. An engine calls `poll` once a step, and a step of a busy P is a
whole forward pass: a D whose read ended just after one waits that long for
its `ack`. `answer_in_background` answers D's messages (`done`, heartbeats,
`want`, `drop`, `hello`) from a thread of its own as they come; what the
engine's thread owns (the staging's slots, the counters, reaping leases)
still happens only in `poll`, which reports the requests freed in between.
"""


from __future__ import annotations

import functools
import hmac
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxfer.device.staging import Staging, block_tags, free_in_all, stagings_of
from kvxfer.errors import InvalidInputError, TransferError
from kvxfer.nixl.agent import TransportConfig, close_transport, send, start_agent
from kvxfer.nixl.complaints import Complaints
from kvxfer.nixl.etcd import Fetcher, Publication
from kvxfer.nixl.handshake import Hellos
from kvxfer.nixl.streams import Published
from kvxfer.nixl.wire import (
    ReadParams,
    check_piece,
    decode_message,
    done_token,
    is_done_token,
    is_generation,
    message_field,
    new_instance,
    new_secret,
)
from kvxfer.plan.blocks import is_int
from kvxfer.stats import Recorder, Trace

__all__ = ["PrefillTransport"]

logger = logging.getLogger(__name__)


@dataclass
class _Lease:
    generation: int
    expires: float
    token: str = ""  # what D's `done` and heartbeats carry (`done_token` of its secret)
    done_by: set[int] = field(default_factory=set)  # D processes (readers) that said done
    trace: Trace | None = None
    held_at: float = 0.0


_PENDING = 0  # a streamed request's generation before its last chunk
ANSWER_S = 0.001
"""How often `answer_in_background`'s thread looks for D's messages while P holds a request
or a hello waits (NIXL has no wait on notifications): at most this, plus a switch of the
GIL, before a `done` is acked."""
IDLE_ANSWER_S = 0.02
"""How often it looks while P holds nothing (a new lease wakes it at once)."""


def _locked(method):
    """Runs `method` under the transport's lock: the answering thread and the engine's
    take turns at the leases, the streams and the agent."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class PrefillTransport:
    """P side: holds staged blocks for D's reads and frees them on `done` or lease expiry.

    **Arguments:**

    - `config`: `TransportConfig`; `config.name` is the name D connects to.
    - `staging`: the staging P saves blocks into, one per KV cache group (a
      single `Staging` is one group); their regions are registered here.
    - `layout`: JSON-able cache layout advertised to D at handshake.
    - `instance`: this start's identity (`new_instance()` when None); a
      scheduler that hands out params in another process draws it and passes
      it here.
    - `piece`: `(lo, hi, units)`: this process's staging holds units `[lo, hi)` of each
      block (`kvxfer.device.pieces`); None: plain blocks, one unit each.
    - `recorder`: where finished leases' traces go (`kvxfer.stats`); None: one of its own.

    With several D processes (readers), P frees a request's slots once every
    one of them has said done (each names itself and their count), or when
    its lease expires.
    """

    def __init__(self, config: TransportConfig, staging: Staging | Sequence[Staging],
                 layout: Mapping[str, Any], instance: str | None = None,
                 piece: tuple[int, int, int] | None = None, recorder: Recorder | None = None):
        self.config, self.stagings, self.layout = config, stagings_of(staging), dict(layout)
        self.recorder = recorder or Recorder()
        if instance is not None and (not isinstance(instance, str) or not instance):
            raise InvalidInputError(f"instance must be a non-empty str, got {instance!r}")
        self.piece = check_piece(piece)
        self.instance = instance or new_instance()
        self.agent, self.port, self._reg = start_agent(config, self.stagings)
        self._publication = Publication(self.agent, config)
        self._fetcher = Fetcher(self.agent, config) if config.uses_etcd else None
        self._leases: dict[str, _Lease] = {}
        self._next_generation = 1
        self._freed: list[str] = []
        self._ended: list[tuple[str, _Lease, str]] = []  # leases ended, slots not yet freed
        self._lock = threading.RLock()
        self._answering: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # a lease began: answer at the busy pace
        self.complaints = Complaints(f"P {config.name}", logger, self.recorder, "p_messages_dropped")
        self.hellos = Hellos(self.agent, config, self._fetcher, self.advertisement, self.complaints)
        self.streams = Published(self.agent, config.name, self.instance, len(self.stagings),
                                 4 * self.staging.num_slots, config.lease_s,
                                 min(1.0, config.heartbeat_interval_s))

    @property
    def staging(self) -> Staging:
        """The first group's staging (the only one for a single-group model)."""
        return self.stagings[0]

    def advertisement(self) -> dict[str, Any]:
        """What D receives at handshake (the `layout` message's fields)."""
        return {
            "agent": self.config.name,
            "instance": self.instance,
            "piece": list(self.piece),
            "layout": self.layout,
            "groups": [{"regions": [list(r) for r in s.region_addresses()],
                        "prints": list(s.prints_address()), "tags": list(s.tags_address()),
                        "block_bytes": s.block_bytes, "num_slots": s.num_slots}
                       for s in self.stagings],
        }

    @_locked
    def hold(self, req_id: str, now: float | None = None) -> dict[str, Any]:
        """Start `req_id`'s lease; returns the params D needs to read it.

        Call once the request's last chunk is staged: its blocks' tags are written
        here, from a fresh secret the params carry. A request is held once:
        holding it again before it is freed raises `InvalidInputError`.
        """
        if req_id in self._leases:
            raise InvalidInputError(f"request {req_id!r} is already held for D")
        params = ReadParams.staged(self.stagings, req_id, peer=self.config.name,
                                   instance=self.instance, host=self.config.host,
                                   port=self.port, generation=self._next_generation,
                                   secret=new_secret())
        if params is None:
            raise InvalidInputError(f"request {req_id!r} has nothing staged to hold")
        for g, (staging, keys, slots) in enumerate(zip(self.stagings, params.keys, params.slots)):
            staging.tag(list(slots), block_tags(params.secret, g, keys))
        self.lease(req_id, params.generation, params.secret, now)
        return params.to_dict()

    @_locked
    def lease(self, req_id: str, generation: int, secret: str, now: float | None = None,
              trace: Trace | None = None) -> None:
        """Start `req_id`'s lease under a `generation` and `secret` its params already name.

        For a caller that made the params itself (vLLM's scheduler process
        hands them out before the worker has saved the last chunk), and wrote
        the blocks' tags with their secret (`kvxfer.device.staging.block_tags`): the
        generation must be fresh for this instance, else a late `done` for an
        earlier hold could free this one. `trace`: the request's so far (its
        gathers), finished with a `staged` stage when the lease ends.
        """
        now = time.monotonic() if now is None else now
        held = self._leases.get(req_id)
        if held is not None and held.generation != _PENDING:
            raise InvalidInputError(f"request {req_id!r} is already held for D")
        if not is_generation(generation) or generation < self._next_generation:
            raise InvalidInputError(f"request {req_id!r}: generation {generation!r} is not "
                                    f"fresh (next is {self._next_generation})")
        token = done_token(secret)  # a `done` without it frees nothing
        self._next_generation = generation + 1
        trace = trace or Trace(req_id, "P", req_id)
        trace.p = self.config.name
        if held is not None:  # streamed: held since its first block, its lease runs from now
            held.generation, held.expires, held.trace = generation, now + self.config.lease_s, trace
            held.held_at, held.token = time.monotonic(), token
            return
        self._leases[req_id] = _Lease(generation, now + self.config.lease_s, token, trace=trace,
                                      held_at=time.monotonic())
        self._wake.set()
        logger.debug("P %s holds %s gen %s", self.config.name, req_id, generation)

    @_locked
    def held(self) -> list[str]:
        return list(self._leases)

    @_locked
    def publish(self, req_id: str, stream: str, secret: str, prompt: str | None,
                keys: Sequence[Sequence[int]], slots: Sequence[Sequence[int]],
                last: bool = False, entries: Sequence[Mapping[int, str]] = ()) -> None:
        """Name blocks of streamed request `req_id` final: staged (with their tags) and
        never copied again. Per group, their keys (kernel positions) and slots, and
        `entries`: the keys whose tags come from a host pool entry's secret, with it.

        The first call holds the request for D under `stream` (its slots are freed
        only by D's `done`, a lease, or `cancel_stream`); `last` once its prefill is
        done, after `lease` gave it its generation. The subscribed D, if any, is told now
        (`kvxfer.nixl.streams`). A stream whose D gave up on it is held no more: `poll`
        reports the request freed, and the scheduler side stages none of it from then on.
        """
        lease = self._leases.get(req_id)
        first = self.streams.publish(req_id, stream, secret, prompt, keys, slots, last,
                                     lease.generation if lease else None, entries)
        if first is None:
            logger.info("P %s stages no more of %s: its D gave up on stream %s",
                        self.config.name, req_id, stream)
            if lease is not None:
                self._free(req_id, "cancelled")
            else:
                free_in_all(self.stagings, req_id)
                self._freed.append(req_id)
        elif first:
            self._leases.setdefault(req_id, _Lease(_PENDING, float("inf")))
            self._wake.set()

    @_locked
    def cancel_stream(self, req_id: str) -> None:
        """P gave up on streamed `req_id` (aborted, or preempted) before its last chunk: its
        D is told, and its slots are freed once D let go of them (`drop`), or a lease
        from now; at once if no D subscribed. Unknown ids are ignored."""
        if req_id not in self._leases:
            return
        free_now = self.streams.cancel(req_id)
        if free_now:
            self._free(req_id, "cancelled")
        elif free_now is False:
            self._leases[req_id].expires = time.monotonic() + self.config.lease_s

    @_locked
    def poll(self, now: float | None = None) -> list[str]:
        """Handle D's notifications and reap expired leases.

        Returns the request ids freed since the last call (read by D, or expired).
        Never raises because of what a peer sent: a bad message is logged and dropped.
        """
        now = time.monotonic() if now is None else now
        self._take_messages(now)
        if self._fetcher is not None:
            self._fetcher.tick()
        self.hellos.answer(now)
        self.streams.expire_wants(now)
        self.streams.keep_alive(now)
        self._publication.tick()  # D cannot find P until etcd holds P's record
        for req_id in [r for r, lease in self._leases.items() if lease.expires <= now]:
            logger.debug("P %s lease of %s expired", self.config.name, req_id)
            self._free(req_id, "lease_expired")
        self._free_ended()
        freed, self._freed = self._freed, []
        self.recorder.gauge("p_requests_held", len(self._leases))
        return freed

    def answer_in_background(self, every_s: float = ANSWER_S) -> None:
        """Answer D's messages from a thread of its own, every `every_s`, as well as in
        `poll` (see the module's docs); `close` stops it. Calling it again does nothing."""
        if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or not 0 < every_s <= 1:
            raise InvalidInputError(f"answer_in_background every_s must be seconds in (0, 1]: {every_s!r}")
        if self._answering is not None or self.agent is None:
            return
        self._answering = threading.Thread(target=_answer, args=(self, every_s), daemon=True,
                                           name=f"kvxfer-P-{self.config.name}-answers")
        self._answering.start()

    def _take_messages(self, now: float) -> None:
        for sender, messages in self.agent.get_new_notifs().items():
            for raw in messages:
                try:
                    self._handle(sender, decode_message(raw, sender), now)
                except TransferError as e:
                    self.complaints.note(sender, "malformed", e)

    def _handle(self, sender: str, msg: dict[str, Any], now: float) -> None:
        kind = msg["t"]
        if kind == "hello":
            self.hellos.heard(sender, msg.get("start"), now)
        elif kind == "done":
            req_id = message_field(msg, "req_id", lambda v: isinstance(v, str), "a str", sender)
            generation = message_field(msg, "generation", is_generation, "a positive int", sender)
            instance = message_field(msg, "instance", lambda v: isinstance(v, str), "a str", sender)
            readers = message_field(msg, "readers", lambda v: v is None or (is_int(v) and 1 <= v < 1 << 16),
                             "a positive int below 65536", sender) or 1
            reader = message_field(msg, "reader", lambda v: v is None or (is_int(v) and 0 <= v < readers),
                            f"an int in [0, {readers})", sender) or 0
            token = message_field(msg, "token", is_done_token, "32 hex digits", sender)
            lease = self._leases.get(req_id)
            ok = instance == self.instance and lease is not None and _holds(lease, generation, token)
            if ok:
                lease.done_by.add(reader)
                lease.trace.d = sender
                if len(lease.done_by) >= readers:  # every D process has read its units
                    self._free(req_id, "ok")
            logger.debug("P %s done %s gen %s from %s ok=%s", self.config.name, req_id,
                         generation, sender, ok)
            try:
                send(self.agent, sender, "ack", req_id=req_id, generation=generation, ok=ok)
            except TransferError as e:
                self.complaints.note(sender, "unanswered", e)
        elif kind == "hb":
            instance = message_field(msg, "instance", lambda v: isinstance(v, str), "a str", sender)
            reqs = message_field(msg, "reqs", lambda v: isinstance(v, list) and all(
                isinstance(r, list) and len(r) == 3 and isinstance(r[0], str)
                and is_generation(r[1]) and is_done_token(r[2]) for r in v),
                "a list of [req_id, generation, token]", sender)
            if instance != self.instance:
                return
            for req_id, generation, token in reqs:  # only a holder of the params extends
                lease = self._leases.get(req_id)
                if lease is not None and _holds(lease, generation, token):
                    lease.expires = max(lease.expires, now + self.config.lease_s)
        elif kind == "want":
            self.streams.on_want(sender, msg, now, lambda r: (
                self._leases[r].generation if r in self._leases else None))
        elif kind == "drop":
            if (req_id := self.streams.on_drop(sender, msg)) is not None:
                self._free(req_id, "cancelled")
        else:
            self.complaints.note(sender, "unknown_type", f"a {kind!r} message")

    @_locked
    def revoke(self) -> None:
        """A cache reset: end every lease now (outcome `revoked`), so a `done` for any request
        held before it is refused and its reader computes the prompt."""
        for req_id in list(self._leases):
            self._free(req_id, "revoked")

    def _free(self, req_id: str, outcome: str) -> None:
        """End `req_id`'s lease; its slots are freed in `poll` (`_free_ended`), on the
        engine's thread, which owns the staging and the counters."""
        lease = self._leases.pop(req_id)
        self.streams.forget(req_id)
        if lease.trace is not None:
            lease.trace.phase("staged", lease.held_at)
        self._ended.append((req_id, lease, outcome))

    def _free_ended(self) -> None:
        ended, self._ended = self._ended, []
        for req_id, lease, outcome in ended:
            free_in_all(self.stagings, req_id)
            self._freed.append(req_id)
            if lease.trace is not None:
                self.recorder.finish(lease.trace, outcome)

    def close(self) -> None:
        """Stop answering, deregister staging and drop the agent (its listener with it)."""
        self._stop.set()
        self._wake.set()
        if self._answering is not None and self._answering is not threading.current_thread():
            self._answering.join(timeout=5.0)
        with self._lock:
            if self.agent is None:
                return
            close_transport(self.agent, self._reg, self._publication, self._fetcher,
                            f"P {self.config.name}", self.config)
            self.agent = None


def _answer(p: PrefillTransport, every_s: float) -> None:
    """`answer_in_background`'s thread: D's messages and hellos, every `every_s` while P
    holds a request or a hello waits, else every `IDLE_ANSWER_S`, until `close`."""
    while True:
        p._wake.wait(every_s if p._leases or p.hellos else IDLE_ANSWER_S)  # a hint: no lock
        p._wake.clear()
        if p._stop.is_set():
            return
        with p._lock:
            if p.agent is None:
                return
            try:
                now = time.monotonic()
                p._take_messages(now)
                if p.hellos:
                    p.hellos.answer(now)
            except Exception:  # the engine's poll answers from now on
                logger.exception("P %s stops answering in the background", p.config.name)
                return


def _holds(lease: _Lease, generation: int, token: str) -> bool:
    """Whether a `done` or heartbeat naming `lease`'s generation with `token` comes from a
    holder of its params: the `done_token` of the request's secret, compared in constant time
    (instance, request id and generation are not secret; an empty lease token never matches)."""
    return (lease.generation == generation and bool(lease.token)
            and hmac.compare_digest(token.encode(), lease.token.encode()))
